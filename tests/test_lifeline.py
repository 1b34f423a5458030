"""The lifeline with real throwaway processes: the reaper stops what a dead harness left, a
child hears its parent die, the harness hears its parent die; and nox's side: the options,
and SIGTERM/SIGHUP to nox passed on and waited for (through nox's own command runner)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from helpers import ROOT
from helpers.procs import FAMILY, IGNORES_TERM, wait_for_members, wait_gone
from helpers.waiting import wait_for_text, wait_until, within

from pd_sessions.runtime import parentwatch, process
from pd_sessions.runtime.cluster import teardown
from pd_sessions.runtime.process import alive
from pd_sessions.runtime.reaper import Reaper


def _family(r: process.Running, tmp_path, marker: str, n: int) -> list[int]:
    wait_for_text(r.log_path, marker)
    return wait_for_members(r.pid, n)


@pytest.mark.procs
def test_the_reaper_stops_what_a_dead_harness_left(tmp_path):
    """The pipe ending (the harness gone, however it went) is the reaper's only trigger: it
    stops every recorded process with its session (a double-forked orphan included), SIGKILLs
    one that ignores SIGTERM after the grace, and exits."""
    reaper = Reaper(tmp_path / "reaper.log", grace_s=1.0, warn=pytest.fail)
    with process.observed(reaper):
        fam = process.spawn(
            "family", [sys.executable, "-c", FAMILY], env=os.environ, log_path=tmp_path / "f.log"
        )
        stubborn = process.spawn(
            "stubborn", [sys.executable, "-c", IGNORES_TERM], env=os.environ, log_path=tmp_path / "s.log"
        )
    members = _family(fam, tmp_path, "family up", 3) + _family(stubborn, tmp_path, "ignoring SIGTERM", 1)
    t0 = time.monotonic()
    reaper.proc.stdin.close()  # what the kernel does when the harness dies
    assert reaper.proc.wait(10) == 0
    took = time.monotonic() - t0
    wait_gone(members, 5.0, "every recorded process")
    assert took >= 1.0, took
    within(took - 1.0, 2.0, "the reaper's exit past its 1 s grace")
    log = (tmp_path / "reaper.log").read_text()
    assert "is gone while 2 of its processes may still run: family pid" in log
    assert "needed SIGKILL: stubborn" in log
    fam.popen.wait(1)
    stubborn.popen.wait(1)


@pytest.mark.procs
def test_the_reaper_removes_the_private_tmp_of_what_it_stopped_and_not_of_what_was_stopped(tmp_path):
    """A process with a private TMPDIR (process.spawn's private_tmp, as every cluster process
    has): when the harness dies the reaper stops it, then removes its folder with what it left
    there; one stopped by the harness itself had its folder removed then (nothing for the reaper)."""
    reaper = Reaper(tmp_path / "reaper.log", grace_s=1.0, warn=pytest.fail)
    leaves = "open(os.path.join(tempfile.gettempdir(), 'left'), 'w').close(); print('u' + 'p', flush=True)"
    sleeper = [sys.executable, "-c", f"import os, tempfile, time; {leaves}; time.sleep(600)"]
    with process.observed(reaper):
        done = process.spawn("done", sleeper, env=os.environ, log_path=tmp_path / "d.log", private_tmp=True)
        left = process.spawn("left", sleeper, env=os.environ, log_path=tmp_path / "l.log", private_tmp=True)
        wait_for_text(tmp_path / "d.log", "\nup")
        wait_for_text(tmp_path / "l.log", "\nup")
        done_tmp, left_tmp = done.tmp_dir, left.tmp_dir
        assert done_tmp and left_tmp and (left_tmp / "left").exists()
        process.stop([done], grace_s=2)
    assert not done_tmp.exists()
    reaper.proc.stdin.close()  # the harness dies
    assert reaper.proc.wait(10) == 0
    assert not left_tmp.exists()
    log = (tmp_path / "reaper.log").read_text()
    assert f"tmpdir {left_tmp}: removed" in log and str(done_tmp) not in log
    left.popen.wait(1)


@pytest.mark.procs
def test_the_reaper_keeps_to_the_grace_the_harness_began(tmp_path):
    """Harness killed mid-teardown: the SIGKILL comes when the harness's grace ends, not a
    whole grace later."""
    reaper = Reaper(tmp_path / "reaper.log", grace_s=30.0, warn=pytest.fail)
    with process.observed(reaper):
        stubborn = process.spawn(
            "stubborn", [sys.executable, "-c", IGNORES_TERM], env=os.environ, log_path=tmp_path / "s.log"
        )
    wait_for_text(stubborn.log_path, "ignoring SIGTERM")
    t0 = time.monotonic()
    reaper.stopping([stubborn], time.time() + 0.5)
    reaper.proc.stdin.close()
    assert reaper.proc.wait(10) == 0
    within(time.monotonic() - t0, 8.0, "the reaper's SIGKILL at the harness's 0.5 s (its own grace: 30 s)")
    wait_gone([stubborn.pid], 5.0, "the stubborn child")
    stubborn.popen.wait(1)


@pytest.mark.procs
def test_after_a_clean_teardown_the_reaper_has_nothing_to_do(tmp_path):
    reaper = Reaper(tmp_path / "reaper.log", grace_s=30.0, warn=pytest.fail)
    with process.observed(reaper):
        r = process.spawn(
            "quick",
            [sys.executable, "-c", "import time; time.sleep(600)"],
            env=os.environ,
            log_path=tmp_path / "q.log",
        )
        process.stop([r], grace_s=2)
    t0 = time.monotonic()
    reaper.close()
    assert reaper.proc.returncode == 0
    within(time.monotonic() - t0, 10.0, "the reaper's exit with nothing to do (its grace: 30 s)")
    assert "nothing to do" in (tmp_path / "reaper.log").read_text()


MIDDLE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from pd_sessions.runtime import process
    r = process.spawn("child", [sys.executable, "-c", "import time; time.sleep(600)"],
                      env=os.environ, log_path=Path({log!r}))
    print(r.pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.procs
def test_a_child_hears_its_harness_die(tmp_path):
    """A server spawned by a harness that is then SIGKILLed (before it could tell anyone)
    gets SIGTERM from the kernel."""
    script = MIDDLE.format(root=str(ROOT), log=str(tmp_path / "c.log"))
    middle = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(middle.stdout.readline())
    assert psutil.pid_exists(child)
    middle.kill()
    middle.wait()
    try:
        wait_gone([child], 2.0, "the child (it must not outlive its harness)")
    finally:
        if psutil.pid_exists(child):
            os.kill(child, signal.SIGKILL)


WATCHED = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    from pd_sessions.runtime import parentwatch
    if {no_prctl}:
        parentwatch._PRCTL = None  # only the getppid() watchdog
    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append(1))
    watch = parentwatch.ParentWatch(poll_s=0.1)
    open({out!r} + ".armed", "w").close()
    end = time.monotonic() + 20
    while not got and time.monotonic() < end:
        time.sleep(0.01)
    with open({out!r}, "w") as f:
        f.write(("SIGTERM" if got else "nothing") + (": parent gone" if watch.gone() else ""))
""")


@pytest.mark.procs
@pytest.mark.parametrize("no_prctl", [False, True], ids=["prctl", "getppid-watchdog"])
def test_the_harness_hears_its_parent_die(tmp_path, no_prctl):
    out = tmp_path / "out.txt"
    script = WATCHED.format(root=str(ROOT), no_prctl=no_prctl, out=str(out))
    # a parent (nox's stand-in) that starts the watched process and then dies by SIGKILL
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', {script!r}])\n"
            "time.sleep(600)\n",
        ]
    )
    wait_until((tmp_path / "out.txt.armed").exists, 10, "the watched process to arm its watch", proc=parent)
    watched = psutil.Process(parent.pid).children()[0]
    t0 = time.monotonic()
    parent.kill()
    parent.wait()
    wait_until(out.exists, 30, "the watched process to hear its parent die")
    took = time.monotonic() - t0
    assert out.read_text() == "SIGTERM: parent gone"
    within(took, 5.0, "hearing the parent die")
    watched.wait(5)


@pytest.mark.procs
def test_a_signal_while_spawning_is_acted_on_once_the_process_is_recorded(tmp_path):
    """The cluster spawns and records under signals_deferred: a cancel in between (here sent
    by an observer the moment the process exists) cannot leave the process unrecorded."""

    class Boom(BaseException):
        pass

    def handler(signum, frame):
        raise Boom()

    class SignalsMidSpawn(process.Observer):
        def spawned(self, r):
            os.kill(os.getpid(), signal.SIGTERM)

    recorded: list[process.Running] = []
    old = signal.signal(signal.SIGTERM, handler)
    try:
        with process.observed(SignalsMidSpawn()), pytest.raises(Boom), process.signals_deferred():
            recorded.append(
                process.spawn(
                    "s",
                    [sys.executable, "-c", "import time; time.sleep(600)"],
                    env=os.environ,
                    log_path=tmp_path / "s.log",
                )
            )
    finally:
        signal.signal(signal.SIGTERM, old)
    assert len(recorded) == 1
    process.stop(recorded, grace_s=2)


@pytest.mark.procs
def test_teardown_shares_one_grace_between_router_and_instances(tmp_path):
    """Three processes that all ignore SIGTERM: one grace for all, not one per group."""
    rs = [
        process.spawn(n, [sys.executable, "-c", IGNORES_TERM], env=os.environ, log_path=tmp_path / f"{n}.log")
        for n in ("router", "prefill-0", "decode-0")
    ]
    for r in rs:
        wait_for_text(r.log_path, "ignoring SIGTERM")
    t0 = time.monotonic()
    teardown(rs[0], rs[1:], grace_s=1.0)
    took = time.monotonic() - t0
    assert took >= 1.0, took
    within(took - 1.0, 1.0, "the teardown past its one grace (one grace per group: 1 s more)")
    assert process.still_running(rs) == []


@pytest.mark.parametrize(
    "posargs,grace",
    [
        ((), 10.0),
        (("--grace", "3"), 3.0),
        (("--grace=4.5",), 4.5),
        (("--grace", "x"), 10.0),
        (("--only", "1x1", "--grace"), 10.0),
    ],
)
def test_nox_waits_for_the_teardown_budget(posargs, grace):
    assert parentwatch.grace_from_args(posargs) == grace
    assert parentwatch.nox_run_options(posargs) == {"interrupt_timeout": grace + 5.0 + 5.0}


@pytest.mark.procs
def test_the_noxfile_import_is_standard_library_only():
    code = (
        "import sys; import pd_sessions.runtime.parentwatch; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pd_sessions', 'psutil')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['pd_sessions', 'pd_sessions.runtime', 'pd_sessions.runtime.parentwatch']"


# ------------------------------------------------------------------ nox's side: it waits for the harness

# nox's stand-in: nox's own command.run (its popen: Ctrl-C handling, interrupt_timeout) runs a
# "harness" under parentwatch.nox_waits_for_the_harness, as the noxfile's sweep session does.
NOX = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from nox.command import run
    from pd_sessions.runtime import parentwatch
    with parentwatch.nox_waits_for_the_harness(lambda m: print(m, flush=True)):
        run([sys.executable, "-c", {harness!r}], interrupt_timeout={budget})
""")

# A harness whose teardown takes 1 s on SIGTERM, ignoring later signals, then exits 143.
SLOW_TEARDOWN = textwrap.dedent("""
    import signal, sys, time
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"harness got signal {signum}", flush=True)
        time.sleep(1.0)
        print("harness" + " torn down", flush=True)
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    print("harness" + " up", flush=True)
    time.sleep(600)
""")


STUBBORN = textwrap.dedent("""
    import signal, time
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    print("ignoring" + " both", flush=True)
    time.sleep(600)
""")


def _nox(tmp_path, harness: str, budget: float) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "nox.log"
    with open(log, "w") as out:
        nox = subprocess.Popen(
            [sys.executable, "-c", NOX.format(root=str(ROOT), harness=harness, budget=budget)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return nox, log


def _harness_pid(log) -> int:
    return int(re.search(r"passed it on to pid (\d+)\)", log.read_text()).group(1))


@pytest.mark.procs
def test_sigterm_to_nox_alone_is_passed_on_and_nox_exits_143_after_the_harness(tmp_path):
    """SIGTERM to nox alone (e.g. ``timeout``) reaches the harness through nox; a second one
    does not cut nox's wait short; nox exits 143 only once the harness has ended."""
    nox, log = _nox(tmp_path, SLOW_TEARDOWN, budget=20.0)
    try:
        wait_for_text(log, "harness up")
        harness = psutil.Process(nox.pid).children()[0]
        t0 = time.monotonic()
        os.kill(nox.pid, signal.SIGTERM)
        wait_for_text(log, "harness got signal 15", 5)
        os.kill(nox.pid, signal.SIGTERM)  # again, while it waits
        assert nox.wait(10) == 143, log.read_text()
        took = time.monotonic() - t0
        text = log.read_text()
        assert not alive(harness) and _harness_pid(log) == harness.pid
        assert text.index("harness torn down") < text.index("nox got SIGTERM (passed it on to pid")
        assert "for pd-sessions to end: nox exits 143" in text
        assert took >= 1.0, took  # the harness's 1 s teardown waited for
        within(took - 1.0, 8.0, "nox's exit past the harness's 1 s teardown (its budget: 20 s)")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(nox.pid, signal.SIGKILL)


@pytest.mark.procs
def test_a_harness_that_outlasts_the_budget_is_killed_and_nox_still_exits_with_the_signal(tmp_path):
    """nox waits the budget (interrupt_timeout), as on Ctrl-C, then SIGTERM and SIGKILL 0.2 s
    later (the reaper's case): it never waits longer than that, and exits 129 for SIGHUP. (A
    4 s budget: its end, 0.6 s, is far from a second budget.)"""
    nox, log = _nox(tmp_path, STUBBORN, budget=4.0)
    try:
        wait_for_text(log, "ignoring both")
        harness = psutil.Process(nox.pid).children()[0]
        t0 = time.monotonic()
        os.kill(nox.pid, signal.SIGHUP)
        assert nox.wait(10) == 129, log.read_text()
        took = time.monotonic() - t0
        assert not alive(harness) and _harness_pid(log) == harness.pid
        assert took >= 4.0, took
        within(took - 4.0, 3.0, "nox's exit past its 4 s budget")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(nox.pid, signal.SIGKILL)


@pytest.mark.procs
def test_child_pids_are_the_live_children_only(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", FAMILY], stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        members = wait_for_members(parent.pid, 3)
        assert parent.pid in parentwatch.child_pids()
        children = psutil.Process(parent.pid).children()  # the Popen'd child, the fork that exited
        assert set(parentwatch.child_pids(parent.pid)) == {c.pid for c in children if alive(c)} != set()
        assert not set(parentwatch.child_pids()) & (set(members) - {parent.pid})  # no grandchild
        os.killpg(parent.pid, signal.SIGKILL)
        wait_until(lambda: psutil.Process(parent.pid).status() == psutil.STATUS_ZOMBIE, 5, "a zombie")
        assert parent.pid not in parentwatch.child_pids()  # a zombie has ended
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(5)


def test_without_a_signal_nox_keeps_its_own_handlers():
    before = {s: signal.getsignal(s) for s in parentwatch.NOX_STOP_SIGNALS}
    said: list[str] = []
    with parentwatch.nox_waits_for_the_harness(said.append):
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    assert {s: signal.getsignal(s) for s in parentwatch.NOX_STOP_SIGNALS} == before and said == []
    with pytest.raises(ValueError), parentwatch.nox_waits_for_the_harness(said.append):
        raise ValueError("the harness failed")  # not a stop: goes on up as it was
    assert {s: signal.getsignal(s) for s in parentwatch.NOX_STOP_SIGNALS} == before
