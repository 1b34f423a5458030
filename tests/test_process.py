"""Teardown with real throwaway processes: every PID we started is gone, a bystander lives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from conftest import wait_for_text

from pd_sessions.runtime.logtail import log_tail
from pd_sessions.runtime.process import spawn, stop

# A parent that starts a grandchild (same session) and a detached-from-tree orphan
# (double fork, still in our session), then sleeps.
FAMILY = textwrap.dedent("""
    import os, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if os.fork() == 0:
        if os.fork() == 0:
            time.sleep(600)
        os._exit(0)
    print("family" + " up", flush=True)  # the log echoes argv: build the marker
    time.sleep(600)
""")

IGNORES_TERM = textwrap.dedent("""
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring" + " SIGTERM", flush=True)
    time.sleep(600)
""")


def _session_members(sid: int) -> list[int]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (OSError, psutil.Error):
            pass
    return out


@pytest.fixture
def bystander():
    """Someone else's server: 'vllm' in its command line, not started by our spawn()."""
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", "vllm serve bystander"], start_new_session=True
    )
    yield p
    p.kill()
    p.wait()


def test_stop_kills_whole_family_and_spares_bystander(tmp_path, bystander):
    r = spawn("family", [sys.executable, "-c", FAMILY], env=os.environ, log_path=tmp_path / "f.log")
    wait_for_text(tmp_path / "f.log", "family up")
    end = time.monotonic() + 10  # the orphan is forked by a child that may still be running
    while len(members := _session_members(r.pid)) < 3:
        assert time.monotonic() < end, members  # leader, grandchild, orphan
        time.sleep(0.02)
    rep = stop([r], grace_s=5)
    assert _session_members(r.pid) == []
    assert not [
        m for m in members if psutil.pid_exists(m) and psutil.Process(m).status() != psutil.STATUS_ZOMBIE
    ]
    assert set(members) <= set(rep.pids)
    assert rep.killed == []  # all obeyed SIGTERM
    assert bystander.poll() is None, "the bystander must survive"


def test_child_ignoring_sigterm_is_killed_after_grace(tmp_path, bystander):
    r = spawn("stubborn", [sys.executable, "-c", IGNORES_TERM], env=os.environ, log_path=tmp_path / "s.log")
    wait_for_text(tmp_path / "s.log", "ignoring SIGTERM")
    t0 = time.monotonic()
    rep = stop([r], grace_s=1.0)
    took = time.monotonic() - t0
    assert rep.killed == ["stubborn"]
    assert 1.0 <= took < 4.0
    assert bystander.poll() is None


def test_stop_after_exit_is_clean(tmp_path):
    r = spawn("quick", [sys.executable, "-c", "print('bye')"], env=os.environ, log_path=tmp_path / "q.log")
    r.popen.wait(10)
    rep = stop([r], grace_s=1.0)
    assert rep.killed == []
    assert "bye" in log_tail(tmp_path / "q.log")


def test_spawn_logs_argv_and_output(tmp_path):
    r = spawn(
        "echo",
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
        env=os.environ,
        log_path=tmp_path / "e.log",
    )
    r.popen.wait(10)
    text = (tmp_path / "e.log").read_text()
    assert "starting echo" in text and "out" in text and "err" in text
    assert os.getsid(os.getpid()) != r.pid  # its own session


def test_log_tail_limits_lines(tmp_path):
    p = tmp_path / "l.log"
    p.write_text("\n".join(f"line {i}" for i in range(100)))
    tail = log_tail(p, 5)
    assert tail.splitlines() == [f"line {i}" for i in range(95, 100)]


def test_sigterm_during_teardown_is_deferred_until_it_ends(tmp_path):
    """A cancel that lands mid-teardown is acted on after the children are gone."""
    got = []
    old_term = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(time.monotonic()))
    try:
        r = spawn(
            "stubborn", [sys.executable, "-c", IGNORES_TERM], env=os.environ, log_path=tmp_path / "s.log"
        )
        wait_for_text(tmp_path / "s.log", "ignoring SIGTERM")
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        rep = stop([r], grace_s=1.0)
        done = time.monotonic()
        timer.join()
        assert rep.killed == ["stubborn"]
        assert got and got[0] >= done - 0.05, "the SIGTERM was handled before teardown finished"
    finally:
        signal.signal(signal.SIGTERM, old_term)
