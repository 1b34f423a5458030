"""House rules read from the source (AST): one way in, no dead code, no one-line aliases.

Each rule says why it exists; each was broken once (issue 19). ruff's banned-api (TID251, in
pyproject.toml) also keeps pd_sessions.cli from being imported back and sys.argv from being
parsed by hand; the import rules here are the ones a per-project ban cannot say.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from helpers import ROOT

PKG = ROOT / "pd_sessions"


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# pd_sessions/data/ is what the package ships as files, not its modules: the fake stack's scripts
# (data/fake_stack/, run in processes of their own by the packing bench and the tests).
MODULES = {_name(p): p for p in sorted(PKG.rglob("*.py")) if PKG / "data" not in p.parents}


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _with_parents(names: set[str]) -> set[str]:
    return {".".join(n.split(".")[:i]) for n in names for i in range(1, len(n.split(".")) + 1)}


def _imports(module: str, *, at_import_time: bool) -> set[str]:
    """What ``module`` imports (absolute names, with their parent packages): only what runs when it
    is imported (module level, not under ``if TYPE_CHECKING``), or every import in the file."""
    found: set[str] = set()

    def add(node: ast.stmt) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(
                f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES
            )

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            add(node)
            if isinstance(node, ast.If) and not (
                isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            ):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    tree = _tree(MODULES[module])
    if at_import_time:
        visit(tree.body)
    else:
        for node in ast.walk(tree):
            if isinstance(node, ast.stmt):
                add(node)
    return _with_parents(found)


def reached(module: str) -> set[str]:
    """Every module importing ``module`` imports too (pd_sessions' and others', transitively)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            if m in MODULES:
                todo.extend(_imports(m, at_import_time=True))
    return seen - {module}


# ------------------------------------------------------------------ layering
# The layers, purity of the core and the absence of cycles are import-linter contracts
# (pyproject.toml, run by `nox -s lint`; tests/test_layers.py shows each can fail).


def test_nothing_imports_the_cli_back():
    """The CLI is the top layer: it parses and dispatches; what others need is in console.py."""
    importers = [
        m
        for m in MODULES
        if m != "pd_sessions.__main__" and "pd_sessions.cli" in _imports(m, at_import_time=False)
    ]
    assert importers == []


# ------------------------------------------------------------------ one way in

# Modules run with `python -m` besides the CLI itself: each is a process boundary.
PROCESS_BOUNDARIES = {
    "pd_sessions.env.envfacts",  # describes another interpreter, from inside it
    # imports connectors in a process of its own (a native crash ends it alone)
    "pd_sessions.env.import_canary",
    "pd_sessions.runtime.reaper",  # the reaper, which must outlive the harness
    "pd_sessions.canary",  # the canary's documented name, kept when it moved to env/ (delegates)
    "pd_sessions.bench.fake_backend",  # servers the router benchmark starts
    "pd_sessions.bench.py_proxy",
    "pd_sessions.vllm_side.perf_driver",  # vLLM's bench serve, with vLLM's interpreter, in the perf check
    "pd_sessions.vllm_side.link_probe",  # the KV transport alone, in processes of its own (the perf check)
    "pd_sessions.runtime.gate",  # the router, imported ahead and held until its workers are ready
    "pd_sessions.runtime.hop_fault",  # the fault proxy fault_hop_retry starts at the router -> decode hop
}


def _runnable(module: str) -> bool:
    if module.endswith(".__main__"):
        return True
    for node in _tree(MODULES[module]).body:
        if (
            isinstance(node, ast.If)
            and "__main__" in ast.unparse(node.test)
            and "__name__" in ast.unparse(node.test)
        ):
            return True
    return False


def test_one_way_in():
    """Commands are pd-sessions subcommands (cli.py); `python -m pd_sessions.X` exists only where a
    process boundary needs it, and its docstring says why."""
    runnable = {m for m in MODULES if _runnable(m)}
    assert runnable == {"pd_sessions.__main__"} | PROCESS_BOUNDARIES
    for m in sorted(PROCESS_BOUNDARIES):
        doc = ast.get_docstring(_tree(MODULES[m])) or ""
        assert "Why ``python -m``" in doc, f"{m}: say in the docstring why it is a `python -m` entry"


# A runnable module kept under its documented name that hands over to where the code lives.
DELEGATES = {"pd_sessions.canary": "pd_sessions.env.import_canary"}


def test_entry_points_parse_with_argparse():
    """Every module that can be run builds an argparse parser (none reads sys.argv by hand)."""
    for m in PROCESS_BOUNDARIES:
        src = DELEGATES.get(m, m)
        if src != m:
            assert f"from {src} import main" in MODULES[m].read_text(), m
        assert "argparse.ArgumentParser(" in MODULES[src].read_text(), m


# ------------------------------------------------------------------ dead code

# Defined but referenced by nothing in the package, the noxfile or pyproject.toml, and why that is right.
NOT_DEAD = {
    "pytest_addoption": "a pytest hook (pytest_plugin)",
    "pytest_runtest_setup": "a pytest hook (pytest_plugin)",
    "pytest_runtest_makereport": "a pytest hook (pytest_plugin)",
    "kv_delta": "the pd_cluster fixture's API for users' tests (docs/tutorials/own-tests.md)",
    # the simulated hosts' interface (runtime/simhosts.py) for issue 26's launcher and sweep
    "simulated_hosts": "the context manager --simulate-hosts enters (issue 26 part B), the tests' fixture",
    "ray_init_kwargs": "the driver's ray.init arguments (issue 26 part B's launcher), the tests",
    # the fault proxy's handler (runtime/hop_fault.py): http.server calls them by name
    "log_message": "http.server's hook, silenced in runtime/hop_fault.py",
    "do_GET": "http.server's handler name (runtime/hop_fault.py)",
    "do_POST": "http.server's handler name (runtime/hop_fault.py)",
    "protocol_version": "http.server's attribute (runtime/hop_fault.py)",
}


def _references() -> set[str]:
    """Every name the package, the noxfile and pyproject.toml use (loads, attributes, imports and
    identifier strings such as getattr names)."""
    used = set(re.findall(r"\w+", (ROOT / "pyproject.toml").read_text()))
    for path in [*MODULES.values(), ROOT / "noxfile.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
                used.add(node.id)
            elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
                used.add(node.attr)
            elif isinstance(node, ast.alias):
                used.add(node.name.split(".")[-1])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                used.add(node.value)
    return used


def _definitions():
    for module, path in MODULES.items():
        tree = _tree(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                yield module, node.name, node.lineno
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(t, ast.Name):
                    yield module, t.id, node.lineno


def test_no_dead_code():
    """A function, class or module constant that nothing uses (tests do not count: code kept only
    for a test is dead too). This found Cluster.instance, TINY_MODEL and friends."""
    used = _references()
    dead = [
        f"{m}:{line} {name}"
        for m, name, line in _definitions()
        if name not in used and name not in NOT_DEAD and not (name.startswith("__") and name.endswith("__"))
    ]
    assert dead == [], "unused (remove it, or say in NOT_DEAD why it must stay):\n" + "\n".join(dead)


def test_no_one_line_aliases():
    """A module function whose whole body returns its argument's attribute (``served_name(c)`` was
    ``return c.model``) only hides the attribute: use the attribute."""
    aliases = []
    for m, path in MODULES.items():
        for node in _tree(path).body:
            if isinstance(node, ast.FunctionDef):
                body = [
                    s
                    for s in node.body
                    if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                ]
                if (
                    len(body) == 1
                    and isinstance(body[0], ast.Return)
                    and isinstance(body[0].value, ast.Attribute)
                    and isinstance(body[0].value.value, ast.Name)
                    and body[0].value.value.id in {a.arg for a in node.args.args}
                ):
                    aliases.append(f"{m}:{node.lineno} {node.name}: {ast.unparse(body[0])}")
    assert aliases == []


# ------------------------------------------------------------------ unique module names


def duplicate_basenames(paths: list[Path]) -> dict[str, list[str]]:
    """File name -> the modules that share it (``__init__``/``__main__`` aside): two modules of
    one name (three ``hosts.py`` once: this machine, the Ray hosts, the per-host plan) make a
    reader, a traceback and a grep guess which one is meant."""
    by_name: dict[str, list[str]] = {}
    for path in paths:
        if path.stem not in ("__init__", "__main__"):
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    return {name: sorted(where) for name, where in sorted(by_name.items()) if len(where) > 1}


def test_every_module_basename_is_unique():
    """Each module's name says what it does, once in the package (issue 39)."""
    assert duplicate_basenames(list(MODULES.values())) == {}, "rename one of each"


def test_the_basename_rule_finds_a_duplicate():
    paths = [PKG / "runtime" / "hosts.py", PKG / "run" / "hosts.py", PKG / "run" / "__init__.py"]
    paths += [PKG / "core" / "__init__.py", PKG / "cli.py"]
    assert duplicate_basenames(paths) == {
        "hosts.py": ["pd_sessions/run/hosts.py", "pd_sessions/runtime/hosts.py"]
    }
    assert duplicate_basenames([*MODULES.values(), PKG / "other" / "sweep.py"]) == {
        "sweep.py": ["pd_sessions/other/sweep.py", "pd_sessions/run/sweep.py"]
    }


# ------------------------------------------------------------------ short functions

MAX_FUNCTION_LINES = 80


def _function_lengths(tree: ast.AST) -> list[tuple[str, int, int]]:
    """(name, def line, lines) of every function in ``tree``: def and async def, methods and nested
    ones included, counted from the ``def`` line to the last (decorators excluded)."""
    return [
        (node.name, node.lineno, (node.end_lineno or node.lineno) - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def test_function_lengths_count_methods_nested_and_async_without_decorators():
    src = (
        "@decorator\n"
        "@other(1)\n"
        "def outer():\n"
        "    def inner():\n"
        "        return 1\n"
        "    return inner\n"
        "class C:\n"
        "    async def method(self):\n"
        "        x = 1\n"
        "\n"
        "        return x\n"
    )
    assert sorted(_function_lengths(ast.parse(src))) == [
        ("inner", 4, 2),
        ("method", 8, 4),
        ("outer", 3, 4),
    ]


def test_no_function_over_80_lines():
    """A function over 80 lines does too much to be read at once (issue 23 split plan_cluster,
    cmd_sweep, run_checks and bench.bench_results.markdown): split it into functions that each do one
    thing, pure decisions apart from their effects."""
    long = [
        f"{m}:{line} {name} ({n} lines)"
        for m, path in MODULES.items()
        for name, line, n in _function_lengths(_tree(path))
        if n > MAX_FUNCTION_LINES
    ]
    assert long == [], f"over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)


def test_the_rules_see_the_package():
    """The rules above would pass on nothing: make sure they read the real package."""
    assert len(MODULES) > 40 and "pd_sessions.cli" in MODULES
    assert "pd_sessions.runtime.process" in reached("pd_sessions.runtime.cluster")
    assert "psutil" in reached("pd_sessions.run.sweep")
