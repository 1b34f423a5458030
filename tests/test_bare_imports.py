"""The modules noxfile.py imports load in an interpreter without the project's dependencies.

nox imports the noxfile with nox's own interpreter, before any session has installed anything:
a module it imports that needs psutil, prometheus_client, pyelftools, torch or vLLM breaks
``nox -l``, ``--help`` and every session on a bare host. So those modules (found here by reading
the imports of noxfile.py and of the helper modules it imports, pd_sessions.env.nox_support
among them, at top level and inside functions) must import with the standard library alone,
plus ``packaging``.

``packaging`` is allowed, by choice: nox itself depends on it (checked below against nox's
metadata), so wherever the noxfile runs, packaging is there; lane_install.py and in_place.py use it
for version and requirement parsing rather than re-implementing PEP 440 and PEP 508.

The bare interpreter is this Python started with ``-S -E`` (no site-packages, no PYTHONPATH) with
only the checkout and a copy of packaging on its path; that psutil is out of its reach is checked
too, so the test cannot pass by accident on a full environment.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import shutil
import subprocess
import sys
from pathlib import Path

import packaging
import pytest
from helpers import ROOT
from packaging.requirements import Requirement

ALLOWED = {"packaging"}


def imported(source: str) -> set[str]:
    """Every pd_sessions module ``source`` imports, wherever in the file the import is."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pd_sessions":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                path = ROOT / Path(*sub.split("."))
                found.add(sub if path.with_suffix(".py").exists() or path.is_dir() else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "pd_sessions")
    return found


def module_path(module: str) -> Path:
    path = ROOT / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def noxfile_modules() -> list[str]:
    """Every pd_sessions module noxfile.py imports, and every one its helper modules (the ones
    the noxfile imports itself, e.g. pd_sessions.env.nox_support) import, wherever in the file."""
    direct = imported((ROOT / "noxfile.py").read_text())
    found = set(direct)
    for m in direct:
        found |= imported(module_path(m).read_text())
    return sorted(found)


def bare_python(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    if not (site / "packaging").exists():
        shutil.copytree(Path(packaging.__file__).parent, site / "packaging")
    prologue = f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(site)!r}]\n"
    return subprocess.run(
        [sys.executable, "-S", "-E", "-c", prologue + code], capture_output=True, text=True, timeout=60
    )


def test_the_noxfile_imports_what_this_test_expects():
    modules = noxfile_modules()
    for m in (
        "pd_sessions.env.nox_support",  # the noxfile's helpers
        "pd_sessions.bench.bench_args",  # the bench session parses its posargs with the bench's parser
        "pd_sessions.core.cliargs",
        "pd_sessions.core.config",
        "pd_sessions.core.errors",
        "pd_sessions.core.preflight",
        "pd_sessions.core.selection",
    ):
        assert m in modules, modules
    assert "pd_sessions.env.envfacts" in modules  # imported by the helpers: still found
    # the report page (and Jinja2, which it imports when it renders) stays out of nox's reach
    assert not [m for m in modules if m.startswith("pd_sessions.report")], modules
    # an import inside a function is found too
    assert imported("def f():\n    from pd_sessions.env import envfacts\n") == {"pd_sessions.env.envfacts"}


@pytest.mark.procs
def test_noxfile_modules_import_without_the_project_dependencies(tmp_path):
    modules = [*noxfile_modules(), "pd_sessions.core.check_registry"]  # the last through config
    probe = bare_python(tmp_path, "import psutil")
    assert probe.returncode != 0 and "No module named 'psutil'" in probe.stderr, (
        "the bare interpreter must not reach the project's dependencies"
    )
    code = (
        "import importlib, sys\n"
        "before = set(sys.modules)\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print(sorted({n.split('.')[0] for n in set(sys.modules) - before}))\n"
    )
    r = bare_python(tmp_path, code)
    assert r.returncode == 0, f"a module the noxfile imports needs a dependency:\n{r.stderr}"
    loaded = set(ast.literal_eval(r.stdout.strip().splitlines()[-1]))
    third_party = {n for n in loaded if n not in sys.stdlib_module_names and n != "pd_sessions"}
    assert third_party <= ALLOWED, f"beyond the standard library and packaging: {sorted(third_party)}"


def test_packaging_is_allowed_because_nox_depends_on_it():
    names = {Requirement(r).name.lower() for r in md.requires("nox") or () if "extra ==" not in r}
    assert names >= ALLOWED, f"nox no longer depends on {sorted(ALLOWED - names)}: drop it from ALLOWED"


# Every subcommand whose options cli.py parses; bench and wheelhouse hand their command line to
# their own module (wheelhouse's: test_wheelhouse_runs_where_nox_runs_it).
HELP = ["sweep", "serve", "tiny-model", "inventory", "bench-report", "buildkite", "report"]


@pytest.mark.procs
@pytest.mark.parametrize("args", [["--help"], *([c, "--help"] for c in HELP)], ids=" ".join)
def test_cli_help_runs_on_a_bare_interpreter(args):
    """`python -m pd_sessions [COMMAND] --help` needs nothing but the standard library (not even
    packaging): the CLI imports each command's module (and what needs psutil, prometheus_client
    or vLLM) only when that command runs."""
    r = subprocess.run(
        [sys.executable, "-S", "-E", "-m", "pd_sessions", *args],
        cwd=ROOT,  # -m puts the working directory first on the path; -S -E: nothing else
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, f"`python -m pd_sessions {' '.join(args)}` on a bare interpreter:\n{r.stderr}"
    assert r.stdout.startswith(f"usage: pd-sessions {args[0] if len(args) > 1 else ''}".rstrip())


@pytest.mark.procs
def test_wheelhouse_runs_where_nox_runs_it(tmp_path):
    """nox -s wheelhouse runs `python -m pd_sessions wheelhouse` in a venv holding only pip, uv
    and packaging, with this checkout on PYTHONPATH."""
    code = (
        "import runpy\n"
        "sys.argv = ['pd-sessions', 'wheelhouse', '--help']\n"
        "runpy.run_module('pd_sessions', run_name='__main__', alter_sys=True)\n"
    )
    r = bare_python(tmp_path, code)
    assert r.returncode == 0, r.stderr
    assert "--exclude-installed" in r.stdout
