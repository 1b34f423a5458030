"""runtime/gate.py: a module imported at once, run as ``python -m MODULE ARG...`` only once the
gate opens (SIGUSR1); a signal sent while it imports is kept; SIGTERM still ends it while it waits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, wait_until

from pd_sessions.runtime.gate import gated, open_gate

MODULE = """
import sys, time
from pathlib import Path
out = Path({out!r})
with out.open("a") as f:
    f.write(f"imported as {{__name__}} at {{time.time()}}\\n")
if __name__ == "__main__":
    with out.open("a") as f:
        f.write(f"ran {{sys.argv[1:]}} at {{time.time()}}\\n")
"""


def _start(tmp_path: Path, *, slow_import_s: float = 0.0) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "out.txt"
    code = MODULE.format(out=str(out))
    if slow_import_s:
        code = f"import time\ntime.sleep({slow_import_s})\n" + code
    (tmp_path / "gated_mod.py").write_text(code)
    argv = gated([sys.executable, "-m", "gated_mod", "--port", "1", "x"])
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    return subprocess.Popen(argv, env=env), out


def test_the_module_is_imported_at_once_and_runs_with_its_arguments_only_once_the_gate_opens(tmp_path):
    proc, out = _start(tmp_path)
    try:
        wait_until(lambda: out.exists() and "imported as gated_mod" in out.read_text(), 30, "the import")
        time.sleep(0.5)
        assert "ran" not in out.read_text() and proc.poll() is None  # held at the gate
        open_gate(proc.pid)
        assert proc.wait(30) == 0
        lines = out.read_text().splitlines()
        assert lines[1].startswith("imported as __main__") and lines[2].startswith("ran ['--port', '1', 'x']")
    finally:
        proc.kill()
        proc.wait()


def test_a_gate_opened_while_the_module_still_imports_is_not_lost(tmp_path):
    proc, out = _start(tmp_path, slow_import_s=1.0)
    try:
        time.sleep(0.3)  # the interpreter is up, the import not done
        open_gate(proc.pid)
        assert proc.wait(30) == 0
        assert "ran ['--port', '1', 'x']" in out.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_ends_a_process_held_at_the_gate(tmp_path):
    proc, out = _start(tmp_path)
    wait_until(lambda: out.exists(), 30, "the import")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == -signal.SIGTERM
    assert "ran" not in out.read_text()


def test_only_a_python_m_command_can_be_gated():
    assert gated(["/py", "-m", "vllm_router.launch_router", "--a"]) == [
        "/py", "-m", "pd_sessions.runtime.gate", "vllm_router.launch_router", "--a",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="not a `python -m MODULE` command"):
        gated(["/usr/bin/router", "--a"])
