"""The layers contract (import-linter, pyproject.toml) holds, and breaks when it must: an upward
import put back, a third-party import in the core, an import cycle. Each broken case runs
``lint-imports`` on a copy of the package with one line added."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.procs

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tools")])}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_contracts_hold_on_the_tree():
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "5 kept, 0 broken" in r.stdout


@pytest.fixture
def copy(tmp_path):
    for name in ("pd_sessions", "tools"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def _add_line(path: Path, after: str, line: str) -> None:
    text = path.read_text()
    assert after in text, f"{path}: {after!r} not found"
    path.write_text(text.replace(after, f"{after}\n{line}", 1))


@pytest.mark.parametrize(
    "module,after,line,contract,expect",
    [
        (  # the planner once imported the vLLM plugin for one constant (issue 23)
            "core/plan/instance.py",
            "from __future__ import annotations",
            "from pd_sessions.vllm_side.vllm_plugin import NIXL_DELAY_ENV  # noqa",
            "layers: entry points",
            "pd_sessions.core.plan.instance -> pd_sessions.vllm_side.vllm_plugin",
        ),
        (  # code that runs inside vLLM reaching into the harness's edges
            "vllm_side/perf_driver.py",
            "from __future__ import annotations",
            "from pd_sessions.runtime import http  # noqa",
            "vllm_side: what runs inside vLLM's interpreter",
            "pd_sessions.vllm_side.perf_driver -> pd_sessions.runtime.http",
        ),
        (  # runtime reaching up into the checks
            "runtime/cluster.py",
            "from __future__ import annotations",
            "from pd_sessions.checks import runner  # noqa",
            "layers: entry points",
            "pd_sessions.runtime.cluster -> pd_sessions.checks.runner",
        ),
        (  # ports binds sockets: that is runtime's, not the core's
            "core/port_source.py",
            "from __future__ import annotations",
            "import socket  # noqa",
            "core is pure",
            "pd_sessions.core.port_source:",
        ),
        (  # psutil in the core
            "core/config.py",
            "from __future__ import annotations",
            "import psutil  # noqa",
            "core is pure",
            "imports psutil: not the standard library",
        ),
        (  # the wheelhouse's pure decisions reaching into its edge (uv and pip)
            "env/wheelhouse/resolve.py",
            "from __future__ import annotations",
            "from pd_sessions.env.wheelhouse import download  # noqa",
            "the wheelhouse: wheelhouse_command > download > resolve",
            "pd_sessions.env.wheelhouse.resolve -> pd_sessions.env.wheelhouse.download",
        ),
        (  # process once imported lifeline, and lifeline process (issue 23): a cycle
            "runtime/process.py",
            "from __future__ import annotations",
            "from pd_sessions.runtime import reaper  # noqa",
            "no import cycles",
            "No cycles are allowed in pd_sessions.runtime.",
        ),
    ],
)
def test_a_broken_rule_fails_lint(copy, module, after, line, contract, expect):
    _add_line(copy / "pd_sessions" / module, after, line)
    r = lint_imports(copy)
    assert r.returncode != 0, r.stdout
    broken = r.stdout[r.stdout.index("Broken contracts") :]
    assert contract in broken and expect in broken, r.stdout
