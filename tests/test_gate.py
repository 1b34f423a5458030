"""runtime/gate.py: a module imported at once, run as ``python -m MODULE ARG...`` only once the
gate opens (SIGUSR1 after the gate says it holds); a gate opened at once, or while the module
still imports, is not lost and never ends the process; SIGTERM still ends it while it waits."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.waiting import wait_until

from pd_sessions.core.errors import ReadinessTimeout
from pd_sessions.runtime import process
from pd_sessions.runtime.gate import HELD, gated, open_gate

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


def _start(tmp_path: Path, *, slow_import_s: float = 0.0) -> tuple[process.Running, Path]:
    out = tmp_path / "out.txt"
    code = MODULE.format(out=str(out))
    if slow_import_s:
        code = f"import time\ntime.sleep({slow_import_s})\n" + code
    (tmp_path / "gated_mod.py").write_text(code)
    argv = gated([sys.executable, "-m", "gated_mod", "--port", "1", "x"])
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    return process.spawn("gated", argv, env=env, log_path=tmp_path / "gated.log"), out


@pytest.mark.procs
def test_the_module_is_imported_at_once_and_runs_with_its_arguments_only_once_the_gate_opens(tmp_path):
    r, out = _start(tmp_path)
    try:
        wait_until(lambda: out.exists() and "imported as gated_mod" in out.read_text(), 30, "the import")
        time.sleep(0.5)
        assert "ran" not in out.read_text() and r.poll() is None  # held at the gate
        assert HELD in r.log_path.read_text()
        open_gate(r)
        assert r.popen.wait(30) == 0
        lines = out.read_text().splitlines()
        assert lines[1].startswith("imported as __main__") and lines[2].startswith("ran ['--port', '1', 'x']")
    finally:
        process.stop([r], grace_s=2)


@pytest.mark.procs
@pytest.mark.parametrize("slow_import_s", [0.0, 1.0])
def test_a_gate_opened_at_once_or_while_the_module_imports_runs_it_and_never_ends_it(tmp_path, slow_import_s):
    """The race CI found: opened right after the spawn, before the interpreter had blocked SIGUSR1,
    the signal's default action ended the process. open_gate waits for the gate's line first."""
    r, out = _start(tmp_path, slow_import_s=slow_import_s)
    try:
        open_gate(r)
        assert r.popen.wait(30) == 0, r.log_tail()
        assert "ran ['--port', '1', 'x']" in out.read_text()
    finally:
        process.stop([r], grace_s=2)


@pytest.mark.procs
def test_sigterm_ends_a_process_held_at_the_gate(tmp_path):
    r, out = _start(tmp_path)
    wait_until(lambda: out.exists(), 30, "the import")
    r.popen.send_signal(signal.SIGTERM)
    assert r.popen.wait(10) == -signal.SIGTERM
    assert "ran" not in out.read_text()
    process.stop([r], grace_s=2)


@pytest.mark.procs
def test_a_process_that_never_holds_is_named_and_one_that_exits_is_left_to_the_caller(tmp_path):
    quiet = process.spawn(
        "router",
        [sys.executable, "-c", "import time; time.sleep(30)"],
        env=os.environ,
        log_path=tmp_path / "q.log",
    )
    try:
        with pytest.raises(ReadinessTimeout) as e:
            open_gate(quiet, wait_s=0.5)
        assert "router" in str(e.value) and f"its gate never said {HELD!r}" in str(e.value)
    finally:
        process.stop([quiet], grace_s=2)
    gone = process.spawn(
        "router", [sys.executable, "-c", "pass"], env=os.environ, log_path=tmp_path / "g.log"
    )
    gone.popen.wait(10)
    open_gate(gone, wait_s=5)  # returns: the caller's liveness check names the exit
    process.stop([gone], grace_s=2)


def test_only_a_python_m_command_can_be_gated():
    assert gated(["/py", "-m", "vllm_router.launch_router", "--a"]) == [
        "/py", "-m", "pd_sessions.runtime.gate", "vllm_router.launch_router", "--a",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="not a `python -m MODULE` command"):
        gated(["/usr/bin/router", "--a"])
