"""Nothing outside the connectors package names a connector: what the harness knows about one lives
in its module (pd_sessions/core/connectors/), and everything else reads the spec.

The rule, read from the source (AST):

- **Where**: every Python file of the ``pd_sessions`` package, ``noxfile.py`` and ``tools/``,
  except the connectors package itself and the files in :data:`ALLOWED` (each with its reason).
  Not checked: the config files (``pd_sessions/configs/*.toml``: a sweep says which connector it
  runs), the docs, and ``tests/`` (a test of the planner's NIXL plan names NIXL, as a sweep file
  does; the connectors' own tests are tests/test_connectors.py).
- **What counts as a literal**: every string constant in the code, the literal parts of f-strings
  included. Docstrings (the first statement of a module, class or function) do not count: they
  are prose for people, and say which connector an example is about. Comments are not in the
  AST. Identifiers (a variable, attribute or config field named after its connector, e.g.
  ``mooncake_protocol``, which its connector's spec declares as an option) are not literals.
- **What names a connector**: a literal any of whose words -- maximal runs of letters and digits,
  so ``"mooncake_bootstrap"``, ``"VLLM_NIXL_SIDE_CHANNEL_PORT"``, ``"nixl-cu12"``,
  ``"vllm:nixl_xfer_time_seconds_count"``, ``"NixlPushConnector"`` and ``"NIXL agent"`` each
  have one -- begins, case-insensitively, with a root word of a registered connector: the first
  word of its name and its package's name (today ``mooncake`` and ``nixl``; a new connector adds
  its own). So a message for people takes the connector's name from its spec (``spec.title``),
  and a branch on a connector's name cannot be written at all.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import ROOT

from pd_sessions.core import connectors

PKG = ROOT / "pd_sessions"
CONNECTORS = PKG / "core" / "connectors"

# Files that may name connectors, and why.
ALLOWED = {
    # The CI job registry: data like a sweep file. Its GPU jobs mirror vLLM's own CI steps for each
    # connector (their keys, labels, the vLLM source paths that trigger them, MOONCAKE_DEVICE_NAME
    # on the B200 pool), so that the rendered steps drop into vLLM's test_areas unchanged.
    PKG / "report" / "buildkite_pipelines.py": "vLLM's CI step names and paths, per connector",
    # The perf check's "transport alone": each connector package's own library (NIXL agents,
    # Mooncake's transfer engine) driven outside vLLM, one pair of functions per transport, keyed
    # by the package's name (the check passes spec.package.name); its errors name the library.
    PKG / "vllm_side" / "link_probe.py": "each connector package's transport library, driven outside vLLM",
    # The fake vLLM and router (the bench's and the tests' fake stack, package data since the bench
    # runs from an installed package): it answers as vLLM's connectors and vllm-router do, under
    # their names (the router's --kv-connector choices, the connectors' metric and log lines).
    PKG / "data" / "fake_stack" / "fake_server.py": "the fake vLLM and router speak as the real ones",
}

WORD = re.compile(r"[A-Za-z0-9]+")


def roots() -> set[str]:
    """The words that name a registered connector."""
    out = set()
    for spec in connectors.ALL:
        out.add(WORD.findall(spec.name)[0].lower())
        out.add(spec.package.name.lower())
    return out


def checked_files() -> list[Path]:
    files = [ROOT / "noxfile.py", *sorted((ROOT / "tools").glob("*.py")), *sorted(PKG.rglob("*.py"))]
    return [f for f in files if CONNECTORS not in f.parents and f not in ALLOWED]


def docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes of the module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.add(id(value))
    return out


def connector_literals(source: str, words: set[str]) -> list[tuple[int, str]]:
    """(line, literal) of every string constant in ``source`` (docstrings aside) with a word that
    begins with one of ``words``."""
    tree = ast.parse(source)
    skip = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)) and id(node) not in skip:
            text = node.value.decode("latin-1") if isinstance(node.value, bytes) else node.value
            if any(w.lower().startswith(root) for w in WORD.findall(text) for root in words):
                found.append((node.lineno, node.col_offset, text))
    return [(line, text) for line, _, text in sorted(found)]


def test_no_connector_is_named_outside_its_module():
    words = roots()
    assert words == {"mooncake", "nixl"}  # today's; a new connector adds its own root
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for path in checked_files()
        for line, text in connector_literals(path.read_text(), words)
    ]
    assert bad == [], (
        "a connector is named outside pd_sessions/core/connectors/ (read its spec instead: "
        "connectors.get(config.connector), spec.title, spec.package...):\n" + "\n".join(bad)
    )


def test_the_rule_catches_what_it_says_and_spares_what_it_says():
    words = {"mooncake", "nixl"}
    caught = '''
"""A docstring naming Mooncake and NIXL is prose."""
if config.connector == "nixl":  # a comment naming mooncake is not code
    env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = "1"
label = f"{name}.mooncake_bootstrap"
say(f"NIXL agent {name}")
metric = "vllm:nixl_xfer_time_seconds_count"
wheels = ("nixl-cu12", b"MooncakeConnector")


def f():
    """Only the NixlPushConnector docstring is spared."""
    return "NixlPushConnector"
'''
    got = [text for _, text in connector_literals(caught, words)]
    assert got == [
        "nixl",
        "VLLM_MOONCAKE_BOOTSTRAP_PORT",
        ".mooncake_bootstrap",
        "NIXL agent ",
        "vllm:nixl_xfer_time_seconds_count",
        "nixl-cu12",
        "MooncakeConnector",
        "NixlPushConnector",
    ]
    spared = (
        "config.mooncake_protocol\nspec = connectors.get(c.connector)\n"
        'msg = f"{spec.title} agent"\nx = "pushing"\n'
    )
    assert connector_literals(spared, words) == []


def test_the_checked_files_are_the_package_the_noxfile_and_the_tools():
    files = checked_files()
    assert ROOT / "noxfile.py" in files and PKG / "core" / "config.py" in files
    assert not any(CONNECTORS in f.parents for f in files)
    assert all(f.exists() for f in ALLOWED)
