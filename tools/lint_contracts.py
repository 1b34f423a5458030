"""import-linter contract types of this project (``nox -s lint`` puts this folder on the path).

``standard_library_only``: the modules under ``source_modules`` import only the standard library,
the packages named in ``allowed_packages`` and modules of their own root package. A per-project
``forbidden`` contract cannot say this: it names what is forbidden, so a new dependency slips in.
``forbidden_stdlib`` names standard-library modules that are still off limits (the edges:
processes, sockets, threads).
"""

from __future__ import annotations

import sys

from importlinter import Contract, ContractCheck, fields, output


class StandardLibraryOnlyContract(Contract):
    type_name = "standard_library_only"

    source_modules = fields.ListField(subfield=fields.ModuleExpressionField())
    allowed_packages = fields.ListField(subfield=fields.StringField(), required=False)
    forbidden_stdlib = fields.ListField(subfield=fields.StringField(), required=False)

    def check(self, graph, verbose: bool) -> ContractCheck:
        allowed = set(self.allowed_packages or [])  # type: ignore[arg-type]
        forbidden = set(self.forbidden_stdlib or [])  # type: ignore[arg-type]
        sources = [str(s.expression) for s in self.source_modules]  # type: ignore[attr-defined]
        root = {s.split(".")[0] for s in sources}
        bad: list[tuple[str, str, int | None, str]] = []
        for module in sorted(graph.modules):
            if not any(module == s or module.startswith(s + ".") for s in sources):
                continue
            for imported in sorted(graph.find_modules_directly_imported_by(module)):
                top = imported.split(".")[0]
                if top in root:
                    continue
                why = None
                if top in forbidden:
                    why = "an edge of the standard library, not for this layer"
                elif top not in sys.stdlib_module_names and top not in allowed:
                    why = "not the standard library" + (
                        f" nor {', '.join(sorted(allowed))}" if allowed else ""
                    )
                if why:
                    for d in graph.get_import_details(importer=module, imported=imported) or [{}]:
                        bad.append((module, imported, d.get("line_number"), why))
        return ContractCheck(kept=not bad, metadata={"bad": bad})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for module, imported, line, why in check.metadata["bad"]:
            output.print_error(f"{module}:{line} imports {imported}: {why}", bold=False)
            output.new_line()
