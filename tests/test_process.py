"""Teardown with real throwaway processes: every PID we started is gone, a bystander lives."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers.procs import FAMILY, IGNORES_TERM, move_btime, old_rule_same, session_members, wait_for_members
from helpers.waiting import wait_for_text, within

from pd_sessions.core.errors import StopError
from pd_sessions.runtime import process
from pd_sessions.runtime.logtail import log_tail
from pd_sessions.runtime.process import kernel_state, spawn, stop


@pytest.mark.procs
def test_stop_kills_whole_family_and_spares_bystander(tmp_path, bystander):
    r = spawn("family", [sys.executable, "-c", FAMILY], env=os.environ, log_path=tmp_path / "f.log")
    wait_for_text(tmp_path / "f.log", "family up")
    members = wait_for_members(r.pid, 3)  # leader, grandchild, orphan
    rep = stop([r], grace_s=5)
    assert session_members(r.pid) == []
    assert not [
        m for m in members if psutil.pid_exists(m) and psutil.Process(m).status() != psutil.STATUS_ZOMBIE
    ]
    assert set(members) <= set(rep.pids)
    assert rep.killed == []  # all obeyed SIGTERM
    assert bystander.poll() is None, "the bystander must survive"


@pytest.mark.procs
def test_child_ignoring_sigterm_is_killed_after_grace(tmp_path, bystander):
    r = spawn("stubborn", [sys.executable, "-c", IGNORES_TERM], env=os.environ, log_path=tmp_path / "s.log")
    wait_for_text(tmp_path / "s.log", "ignoring SIGTERM")
    t0 = time.monotonic()
    rep = stop([r], grace_s=1.0)
    took = time.monotonic() - t0
    assert rep.killed == ["stubborn"]
    assert took >= 1.0
    within(took - 1.0, 3.0, "the stop past its 1 s grace")
    assert bystander.poll() is None


@pytest.mark.procs
def test_stop_after_exit_is_clean(tmp_path):
    r = spawn("quick", [sys.executable, "-c", "print('bye')"], env=os.environ, log_path=tmp_path / "q.log")
    r.popen.wait(10)
    rep = stop([r], grace_s=1.0)
    assert rep.killed == []
    assert "bye" in log_tail(tmp_path / "q.log")


@pytest.mark.procs
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


@pytest.mark.procs
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


def _fake_task(proc, pid, tid, comm, state, wchan, stack=()):
    t = proc / str(pid) / "task" / str(tid)
    t.mkdir(parents=True)
    (t / "comm").write_text(comm + "\n")
    # /proc/PID/stat: pid (comm) state ppid ... utime (14th) stime (15th)
    (t / "stat").write_text(f"{tid} ({comm}) {state} 1 2 3 4 5 6 7 8 9 10 1234 56 0 0\n")
    (t / "wchan").write_text(wchan)
    (t / "syscall").write_text("running\n" if state == "R" else "202 0x1 0x2\n")
    (t / "stack").write_text("".join(f"[<0>] {f}+0x10/0x20\n" for f in stack))
    (proc / str(pid) / "comm").write_text("VLLM::Worker\n")


def test_kernel_state_sums_up_where_each_thread_is(tmp_path):
    """The evidence a SIGKILL survivor is reported with: its threads by state, where each
    waits (wchan, else the top of its kernel stack), and per thread the CPU ticks and stack."""
    _fake_task(tmp_path, 70, 70, "VLLM::Worker", "R", "0", ["process_vm_rw_core", "process_vm_rw"])
    for tid in (71, 72):
        _fake_task(tmp_path, 70, tid, "gloo_tcp_loop", "S", "do_epoll_wait")
    _fake_task(tmp_path, 70, 73, "ucx", "S", "futex_do_wait")
    s = kernel_state(70, proc=tmp_path)
    assert s.line == (
        "VLLM::Worker: 4 threads: 1 R in process_vm_rw_core, 3 S (do_epoll_wait 2, futex_do_wait 1)"
    )
    assert (
        "tid 70 'VLLM::Worker' state R cpu 1234+56 ticks (last on CPU ?, allowed ?, nice ?) wchan 0" in s.full
    )
    assert "stack process_vm_rw_core < process_vm_rw" in s.full
    assert kernel_state(71, proc=tmp_path).line == "gone"


@pytest.mark.procs
def test_kernel_state_of_a_live_process_names_where_it_sleeps():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        end = time.monotonic() + 10
        while "nanosleep" not in (line := kernel_state(p.pid).line) and time.monotonic() < end:
            time.sleep(0.02)
        assert ": 1 thread: 1 S in " in line and "nanosleep" in line, line
    finally:
        p.kill()
        p.wait()
    assert kernel_state(p.pid).line == "gone"


@pytest.mark.procs
def test_a_sigkill_survivor_is_named_with_its_kernel_state(tmp_path, monkeypatch):
    """process.kill: a process that outlives its SIGKILL (a NIXL worker did, for minutes) is
    named with where its threads are, so the failure carries its own evidence."""
    r = spawn(
        "victim",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env=os.environ,
        log_path=tmp_path / "v.log",
    )
    monkeypatch.setattr(process, "_wait_gone", lambda procs, timeout: list(procs))
    monkeypatch.setattr(
        process, "kernel_state", lambda pid: process.KernelState("python: 1 thread: 1 R", "full")
    )
    with pytest.raises(
        StopError, match=rf"processes survived SIGKILL: victim pid {r.pid} \(python: 1 thread: 1 R\)"
    ):
        process.kill(r, kill_wait_s=0.1)
    r.popen.wait(10)


# An API server in small: an "engine core" child, and a resource tracker (its argv names
# multiprocessing.resource_tracker, like Python's) that exits once its parent is gone. On SIGTERM
# the engine core is stopped at once; the server logs uvicorn's last line (or not) and lingers.
API_SERVER = r"""
import signal, subprocess, sys, time
say_done, lingers = sys.argv[1] == "logs", float(sys.argv[2])
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
tracker = subprocess.Popen([sys.executable, "-c",
    "import os, time\nparent = os.getppid()\nwhile os.getppid() == parent: time.sleep(0.01)",
    "from multiprocessing.resource_tracker import main"])
def stop(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine.terminate(); engine.wait()
    if say_done:
        print("INFO:     Application shutdown " + "complete.", flush=True)  # not in the log's argv line
    time.sleep(lingers)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("server " + "up", flush=True)  # not in the log's argv line: up means its handler is set
time.sleep(60)
"""


def _api_server(tmp_path, logs: bool, lingers: float):
    from pd_sessions.runtime.cluster import ShutdownLogged

    log = tmp_path / "decode-0.log"
    r = spawn(
        "decode-0",
        [sys.executable, "-c", API_SERVER, "logs" if logs else "quiet", str(lingers)],
        env=os.environ,
        log_path=log,
    )
    wait_for_text(log, "server up")
    members = wait_for_members(r.pid, 3)  # the server, its engine core, its tracker
    return r, members, {"decode-0": ShutdownLogged(log)}


@pytest.mark.procs
def test_freed_comes_once_the_engine_core_is_gone_and_a_server_that_logged_its_shutdown_is_killed_then(
    tmp_path,
):
    r, members, ended = _api_server(tmp_path, logs=True, lingers=30.0)
    freed: list[tuple[float, list[int]]] = []
    t0 = time.monotonic()
    rep = stop(
        [r],
        grace_s=10,
        freed=lambda: freed.append((time.monotonic() - t0, [m for m in members if psutil.pid_exists(m)])),
        after_children=ended,
    )
    took = time.monotonic() - t0
    assert len(freed) == 1 and r.pid in freed[0][1], freed  # the server was still there: freed came first
    within(freed[0][0], 5.0, "freed, the engine core gone at the SIGTERM")
    assert rep.ended == ["decode-0"] and rep.killed == [], rep
    within(took, 5.0, "the stop of a server that logged its shutdown (it would linger 30 s)")
    assert session_members(r.pid) == [] and set(members) <= set(rep.pids)
    assert "Application shutdown complete." in (tmp_path / "decode-0.log").read_text()


@pytest.mark.procs
def test_a_server_that_never_logged_its_shutdown_is_left_to_exit_by_itself(tmp_path):
    r, _, ended = _api_server(tmp_path, logs=False, lingers=1.5)
    freed: list[float] = []
    t0 = time.monotonic()
    rep = stop([r], grace_s=10, freed=lambda: freed.append(time.monotonic() - t0), after_children=ended)
    took = time.monotonic() - t0
    assert rep.ended == [] and took >= 1.5, (rep, took)
    within(took - 1.5, 2.0, "the stop past the server's own 1.5 s exit")
    assert len(freed) == 1 and freed[0] < took - 1.0, (freed, took)  # its devices were free long before
    assert session_members(r.pid) == []


# A child that leaves files in its temporary folder, as vLLM does (ZeroMQ IPC sockets, vllm_dist_*).
LEAVES_TMP = (
    "import os, socket, tempfile, time; d = tempfile.gettempdir(); "
    "s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(d, 'ipc-sock')); "
    "open(os.path.join(d, 'vllm_dist_x'), 'w').close(); print('tmp', d, flush=True); time.sleep(600)"
)


def _tmp_of(log) -> str:
    wait_for_text(log, "\ntmp ")
    return next(line.split(" ", 1)[1] for line in log.read_text().splitlines() if line.startswith("tmp "))


@pytest.mark.procs
def test_a_private_tmp_is_the_childs_tmpdir_and_goes_once_it_is_verified_gone(tmp_path):
    """spawn(private_tmp=True): the child's TMPDIR is a folder of its own (pds-tmp-<name>-...,
    in the system's); what the child left there (a socket, a file) goes with it at stop(), and
    at kill(); without private_tmp the child keeps the harness's TMPDIR."""
    for end in (lambda r: stop([r], grace_s=2), process.kill):
        log = tmp_path / f"t{id(end)}.log"
        r = spawn("inst", [sys.executable, "-c", LEAVES_TMP], env=os.environ, log_path=log, private_tmp=True)
        got = Path(_tmp_of(log))
        assert got == r.tmp_dir and got.parent == Path(tempfile.gettempdir())
        assert got.name.startswith("pds-tmp-inst-")
        assert sorted(os.listdir(got)) == [process.TMP_OWNER, "ipc-sock", "vllm_dist_x"]
        assert (got / process.TMP_OWNER).read_text() == f"{r.pid} {r.start_ticks} ticks\n"
        end(r)
        assert not got.exists() and r.tmp_dir is None
    log = tmp_path / "plain.log"
    r = spawn("plain", [sys.executable, "-c", LEAVES_TMP.replace("ipc-sock", f"ipc-{os.getpid()}")],
              env={**os.environ, "TMPDIR": str(tmp_path)}, log_path=log)  # fmt: skip
    assert _tmp_of(log) == str(tmp_path) and r.tmp_dir is None
    stop([r], grace_s=2)


@pytest.mark.procs
def test_a_spawn_that_fails_leaves_no_private_tmp(tmp_path):
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), f"{process.TMP_PREFIX}nope-*")))
    with pytest.raises(FileNotFoundError):
        missing = [str(tmp_path / "missing")]
        spawn("nope", missing, env=os.environ, log_path=tmp_path / "n.log", private_tmp=True)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), f"{process.TMP_PREFIX}nope-*"))) == before
    with pytest.raises(ValueError, match="not a private temporary folder"):
        process.remove_tmp_dir(tmp_path)


@pytest.mark.procs
def test_a_later_run_removes_the_private_tmp_of_a_dead_owner_and_nothing_else(tmp_path, monkeypatch):
    """What a run whose stop was cut short leaves (its driver SIGKILLed across hosts: the nodes'
    Ray jobs end the processes, no one removes their folders) goes at the next run's start on
    that machine: a folder whose recorded owner is gone. A live owner's folder, a folder without
    an owner record (being made; an older pd-sessions) and other names stay."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    live = spawn("live", sleeper, env=os.environ, log_path=tmp_path / "l.log", private_tmp=True)
    dead = spawn("dead", sleeper, env=os.environ, log_path=tmp_path / "d.log", private_tmp=True)
    try:
        os.killpg(dead.pid, signal.SIGKILL)  # not process.stop/kill: nothing removes its folder
        dead.popen.wait(10)
        unrecorded = tmp_path / f"{process.TMP_PREFIX}making-x"
        unrecorded.mkdir()
        other = tmp_path / "someone-elses"
        other.mkdir()
        (other / process.TMP_OWNER).write_text(f"{dead.pid} {dead.start_ticks} ticks\n")
        assert dead.tmp_dir.is_dir()
        assert process.remove_orphan_tmp_dirs() == [str(dead.tmp_dir)]
        assert not dead.tmp_dir.exists() and live.tmp_dir.is_dir() and unrecorded.is_dir() and other.is_dir()
        assert process.remove_orphan_tmp_dirs() == []
    finally:
        stop([live, dead], grace_s=2)
    assert not live.tmp_dir and process.remove_orphan_tmp_dirs() == []


def test_start_ticks_is_field_22_of_stat_read_after_the_last_parenthesis(tmp_path):
    """The identity of a process: its PID and its start in clock ticks since boot, from a fake
    /proc root (a command name with spaces and parentheses; a zombie; no such PID) and from the
    real one (the same figure psutil divides by CLK_TCK before it adds btime)."""
    fake = tmp_path / "proc"
    fields = ["S", *(str(n) for n in range(4, 22)), "123456", *["0"] * 30]  # field 3 .. 52
    for pid, comm, state in ((42, "a) b (c", "S"), (43, "zz", "Z")):
        (fake / str(pid)).mkdir(parents=True)
        (fake / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join([state, *fields[1:]])}\n")
    assert process.start_ticks(42, fake) == 123456
    assert process.same_process(42, 123456, fake) and process.same_process(42, None, fake)
    assert not process.same_process(42, 123457, fake)  # a reused PID
    assert process.start_ticks(43, fake) == 123456 and not process.same_process(43, 123456, fake)  # zombie
    assert process.start_ticks(44, fake) is None and not process.same_process(44, None, fake)
    mine = process.start_ticks(os.getpid())
    assert mine is not None and process.same_process(os.getpid(), mine)
    since_boot = psutil.Process().create_time() - psutil.boot_time()
    assert abs(mine / os.sysconf("SC_CLK_TCK") - since_boot) < 0.02


@pytest.mark.procs
@pytest.mark.parametrize("by", [1.0, -1.0])
def test_a_live_owner_keeps_its_private_tmp_when_btime_moves_and_a_dead_ones_still_goes(
    tmp_path, monkeypatch, by
):
    """Issue 38: btime (/proc/stat) is whole seconds the kernel recomputes from the wall clock; a
    slew across a second's boundary moves every psutil create_time by 1 s. The owner of a private
    TMPDIR is told by its start ticks, which do not move: its folder stays; a dead owner's goes.
    (Under the rule before, create_time within 0.01 s, the live owner's folder was removed.)"""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    live = spawn("live", sleeper, env=os.environ, log_path=tmp_path / "l.log", private_tmp=True)
    dead = spawn("dead", sleeper, env=os.environ, log_path=tmp_path / "d.log", private_tmp=True)
    try:
        os.killpg(dead.pid, signal.SIGKILL)
        dead.popen.wait(10)
        recorded = psutil.Process(live.pid).create_time()  # what the rule before recorded
        move_btime(monkeypatch, by)
        assert psutil.Process(live.pid).create_time() == pytest.approx(recorded + by)
        assert not old_rule_same(live.pid, recorded)  # the rule before: "a reused PID, gone"
        assert process.remove_orphan_tmp_dirs() == [str(dead.tmp_dir)]
        assert live.tmp_dir.is_dir() and not dead.tmp_dir.exists()
        assert process.same_process(live.pid, live.leader.start_ticks)
    finally:
        stop([live, dead], grace_s=2)


@pytest.mark.procs
def test_an_owner_record_of_an_older_pd_sessions_is_kept(tmp_path, monkeypatch):
    """A ``.pd-sessions-owner`` with a wall-clock create_time (written before issue 38): an
    unknown owner, its folder is left."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = tmp_path / f"{process.TMP_PREFIX}old-x"
    old.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    (old / process.TMP_OWNER).write_text(f"{int(gone.stdout)} 1796456300.12\n")
    assert process.remove_orphan_tmp_dirs() == [] and old.is_dir()
