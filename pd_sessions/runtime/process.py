"""Spawning and stopping processes (edge). The only module that sends signals.

Every process starts in its own session (so its process group holds it and
every child that does not leave the group). Stopping is: SIGTERM to each group
and to every tracked descendant, a grace period, SIGKILL to what is left, then a
check that every PID we tracked is gone. We never look processes up by name.
(parentwatch.py signals only this process itself, when its parent is gone; its reaper
stops what we started with :func:`stop_leaders` after we are gone.)

A process's identity is its PID and its start time in clock ticks since boot (:func:`start_ticks`,
field 22 of ``/proc/PID/stat``): the kernel fixes it at the fork and never changes it.
:func:`same_process` is the one test of "is this still the process we recorded?" for every "is its
owner gone?" decision (the simulated hosts' state files, the reaper, the private TMPDIRs, the Ray
agents). Not psutil's ``create_time()``: that adds ``btime`` of ``/proc/stat``, whole seconds the
kernel recomputes from the wall clock on every read, so a clock slew of a few milliseconds near a
second's boundary moves every process's create_time by 1 s, and a live owner looked dead to a
comparison with a tolerance (issue 38: a later run's sweep removed a live run's bridge).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import psutil

from pd_sessions.core.errors import StopError
from pd_sessions.runtime import parentwatch
from pd_sessions.runtime.logtail import log_tail

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Leader:
    """A process we started, as much as is needed to find its tree again (also from another
    process: the reaper, see reaper.py)."""

    name: str
    pid: int
    # the leader's start time in clock ticks (start_ticks), to tell it from a later process with
    # the same PID; None: unknown (the PID is trusted)
    start_ticks: int | None = None


class Observer:
    """Told about every process spawn() starts and stop() stops, and of every private TMPDIR
    made and removed for one (reaper.Reaper). Each method does nothing here: a subclass
    overrides what it keeps."""

    def spawned(self, r: Running) -> None:
        """``r`` started."""

    def stopping(self, rs: Sequence[Running], kill_at: float) -> None:
        """A stop of ``rs`` began; SIGKILL at wall-clock ``kill_at`` for what is still up."""

    def stopped(self, rs: Sequence[Running]) -> None:
        """``rs`` are verified gone."""

    def created(self, kind: str, name: str) -> None:
        """A resource of ``kind`` (:data:`TMP_DIR`) named ``name`` was made."""

    def removed(self, kind: str, name: str) -> None:
        """That resource is gone."""


_observers: list[Observer] = []


@contextlib.contextmanager
def observed(observer: Observer) -> Iterator[None]:
    """Tell ``observer`` about every spawn and stop inside the block."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


class Handle(Protocol):
    """What a Running needs of its process: subprocess.Popen, or a process on a Ray node
    (runtime/raylaunch.py)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class Running:
    """A live process we started, and where its output goes."""

    name: str
    popen: Handle
    log_path: Path
    started_at: float
    url: str | None = None
    # the leader's start time in clock ticks (start_ticks), to tell it from a later process with
    # the same PID; None: unknown
    start_ticks: int | None = None
    # the host it runs on when it is not this one (runtime/raylaunch.py); None: here
    node: str | None = None
    # its private temporary folder (its TMPDIR), removed once it is verified gone; None: none
    tmp_dir: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    @property
    def leader(self) -> Leader:
        return Leader(self.name, self.pid, self.start_ticks)


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    url: str | None = None,
    cwd: Path | None = None,
    new_session: bool = True,
    private_tmp: bool = False,
) -> Running:
    """Start ``argv`` in a new session with stdout+stderr appended to ``log_path``.

    ``private_tmp``: the process gets a temporary folder of its own as its ``TMPDIR``
    (:data:`TMP_PREFIX` in the system's), removed once it is verified gone (:func:`stop`,
    :func:`kill`; the reaper when pd-sessions itself was killed). vLLM leaves its ZeroMQ IPC
    sockets and ``vllm_dist_*`` rendezvous files in the temporary folder, even after a clean exit:
    16 files in /tmp per 1P1D on the CPU lane, never removed.

    From Popen until the observers (the reaper) have it, SIGINT/SIGTERM/SIGHUP are deferred,
    so a cancel cannot leave a started process unrecorded; started from the main thread, the
    child also gets SIGTERM if this process dies (parentwatch.child_preexec).

    ``new_session=False`` (a Ray node's agent, runtime/raylaunch.py): the child stays in the
    spawner's process group and session, from any thread with the parent-death signal. Ray
    kills an actor's worker by its process group: a tree in a session of its own would outlive
    every one of Ray's kill paths (the actor killed, its worker SIGKILLed, the driver gone).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out, signals_deferred():
        out.write(f"# pd_sessions: starting {name}: {list(argv)}\n".encode())
        out.flush()
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-")) if private_tmp else None
        if tmp:
            _tell_resource("created", str(tmp))
        try:
            popen = subprocess.Popen(
                list(argv),
                env={**env, "TMPDIR": str(tmp)} if tmp else dict(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=new_session,
                cwd=cwd,
                preexec_fn=parentwatch.child_preexec(any_thread=not new_session),
            )
        except BaseException:
            if tmp:
                remove_tmp_dir(tmp)
            raise
        ticks = start_ticks(popen.pid)
        if tmp:
            _write_owner(tmp, popen.pid, ticks)
        r = Running(
            name=name,
            popen=popen,
            log_path=log_path,
            started_at=time.monotonic(),
            url=url,
            start_ticks=ticks,
            tmp_dir=tmp,
        )
        for o in list(_observers):
            o.spawned(r)
    log.debug("started %s pid %d", name, popen.pid)
    return r


# The private temporary folders (spawn's private_tmp): their names begin so, and the reaper's
# record of one is of this kind.
TMP_PREFIX = "pds-tmp-"
TMP_DIR = "tmpdir"


# In each private folder: "<pid> <start ticks> ticks" of the process it was made for, so that a
# later pd-sessions on the same machine can tell a dead owner's folder (remove_orphan_tmp_dirs).
# (An older pd-sessions wrote "<pid> <create_time>": read as an unknown owner, the folder is kept.)
TMP_OWNER = ".pd-sessions-owner"

PROC = Path("/proc")


def start_ticks(pid: int, proc: Path = PROC) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22 of ``/proc/PID/stat``, read after
    the last ``)``: the command name may hold spaces and parentheses); None if there is no such
    process. Fixed by the kernel at the fork: no wall clock, no ``btime`` in it."""
    try:
        stat = (proc / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    try:
        return int(stat.rsplit(b")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def same_process(pid: int, ticks: int | None, proc: Path = PROC) -> bool:
    """Is ``pid`` (alive, not a zombie) still the process that started at ``ticks``
    (:func:`start_ticks`)? ``ticks`` None (unknown): whether anything by that PID is alive."""
    now = start_ticks(pid, proc)
    if now is None or (ticks is not None and now != ticks):
        return False
    try:
        stat = (proc / str(pid) / "stat").read_bytes()
        return stat.rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def remove_tmp_dir(path: Path) -> None:
    """Remove a private temporary folder (never anything not named :data:`TMP_PREFIX`...)."""
    if not path.name.startswith(TMP_PREFIX):
        raise ValueError(f"{path}: not a private temporary folder of pd-sessions")
    shutil.rmtree(path, ignore_errors=True)


def _write_owner(tmp: Path, pid: int, ticks: int | None) -> None:
    if ticks is None:
        return  # gone already: no owner record, the folder goes with the process's stop
    with contextlib.suppress(OSError):
        (tmp / TMP_OWNER).write_text(f"{pid} {ticks} ticks\n")


def remove_orphan_tmp_dirs(root: Path | None = None) -> list[str]:
    """Remove the private temporary folders in ``root`` (the system's temporary folder) whose
    owner is gone: its recorded PID not alive, or alive with another start time in clock ticks (a
    reused PID; :func:`same_process`). A folder without an owner record (being made), or with one
    an older pd-sessions wrote (a wall-clock create_time), is left.
    What is left behind this way: the folders of a run whose stopping was cut short, e.g. its
    driver SIGKILLed across hosts, where only the nodes' Ray jobs ended the processes (their
    folders stay until a later agent on that node calls this). The owner counts as gone when
    neither it nor anything of its tree or session is alive. Returns the folders removed."""
    base = Path(root or tempfile.gettempdir())
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for e in entries:
        if not e.name.startswith(TMP_PREFIX) or not e.is_dir(follow_symlinks=False):
            continue
        try:
            pid_s, ticks_s, unit = (Path(e.path) / TMP_OWNER).read_text().split()
            pid, ticks = int(pid_s), int(ticks_s)
        except (OSError, ValueError):
            continue
        if unit != "ticks":
            continue
        if any(alive(p) for p in _tracked(Leader(e.name, pid, ticks))):
            continue
        remove_tmp_dir(Path(e.path))
        removed.append(e.path)
    return removed


def release_tmp(running: Sequence[Running]) -> None:
    """Remove the private temporary folders of ``running`` (verified gone), telling the observers."""
    for r in running:
        if r.tmp_dir is not None:
            remove_tmp_dir(r.tmp_dir)
            _tell_resource("removed", str(r.tmp_dir))
            r.tmp_dir = None


def _tell_resource(what: Literal["created", "removed"], path: str) -> None:
    """Tell every observer that the private TMPDIR ``path`` was made or removed."""
    for o in list(_observers):
        if what == "created":
            o.created(TMP_DIR, path)
        else:
            o.removed(TMP_DIR, path)


@dataclass
class StopReport:
    seconds: float
    # names of processes that needed SIGKILL (ignored SIGTERM for the grace period)
    killed: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    # names SIGKILLed early (``early``): still up when their own, shorter wait ended
    cut: list[str] = field(default_factory=list)
    # names SIGKILLed once their workers were gone (``after_children``)
    ended: list[str] = field(default_factory=list)


def _tracked(r: Running | Leader) -> list[psutil.Process]:
    """The leader, its descendants, and anything else still in its session."""
    procs: dict[int, psutil.Process] = {}
    if r.start_ticks is not None and start_ticks(r.pid) not in (None, r.start_ticks):
        return []  # the PID was recycled: our leader and its session are long gone
    try:
        leader = psutil.Process(r.pid)
        procs[leader.pid] = leader
        for c in leader.children(recursive=True):
            procs[c.pid] = c
    except psutil.Error:
        pass
    # Orphans re-parented away from the tree keep their session id.
    for p in psutil.process_iter():
        if p.pid in procs:
            continue
        try:
            if os.getsid(p.pid) == r.pid:
                procs[p.pid] = p
        except (ProcessLookupError, PermissionError, OSError):
            continue
    return list(procs.values())


def alive(p: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def session_family(root: psutil.Process) -> list[psutil.Process]:
    """``root``, its descendants and every member of their sessions (servers run in sessions
    of their own; their engine cores are in those): everything a run started. The caller's
    own session is left out."""
    procs = {root.pid: root}
    with contextlib.suppress(psutil.Error):
        for c in root.children(recursive=True):
            procs[c.pid] = c
    sids = set()
    for p in list(procs.values()):
        with contextlib.suppress(OSError):
            sids.add(os.getsid(p.pid))
    sids.discard(os.getsid(0))
    for p in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(p.pid) in sids:
                procs.setdefault(p.pid, p)
    return list(procs.values())


def _wait_gone(
    procs: Sequence[psutil.Process],
    timeout: float,
    poll: float = 0.01,
    each: Callable[[list[psutil.Process]], None] | None = None,
) -> list[psutil.Process]:
    """Wait until every process in ``procs`` has exited (a zombie counts as exited); the
    ones still alive at ``timeout``. Polls /proc rather than waiting on each PID in turn
    (psutil.wait_procs), because orphans that exited stay zombies until init reaps them.
    ``each`` is told what is left at every poll."""
    end = time.monotonic() + timeout
    while True:
        left = [p for p in procs if alive(p)]
        if each is not None:
            each(left)
        if not left or time.monotonic() >= end:
            return left
        time.sleep(poll)


def _signal_all(groups: Sequence[int], procs: list[psutil.Process], sig: int) -> None:
    for pgid in groups:
        # Only while a process of ours is still in the group, so a recycled id is never hit.
        if any(alive(p) and _pgid(p) == pgid for p in procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
    for p in procs:
        if alive(p):
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except OSError:
        return None


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP until the block ends (a cancel must not cut teardown short).

    A signal that arrives meanwhile is recorded and raised again right after, when the
    previous handlers are back. Python-level handlers, not a signal mask: a mask holds
    only for the calling thread, and with other threads about (probes, guarded calls)
    the kernel hands the signal to one of them, whose handler then runs here anyway.
    Only the main thread can install handlers; elsewhere this is a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.getsignal(s) for s in sigs}
    for s in sigs:
        signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, handler in old.items():
            if handler is not None:  # None: installed outside Python, cannot be restored
                signal.signal(s, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)


def stop(
    running: Sequence[Running],
    *,
    grace_s: float = 10.0,
    kill_wait_s: float = 5.0,
    early: Mapping[str, float] | None = None,
    freed: Callable[[], None] | None = None,
    after_children: Mapping[str, Callable[[], bool]] | None = None,
) -> StopReport:
    """Stop ``running`` and all their descendants; raise StopError if any survive.

    SIGINT/SIGTERM/SIGHUP to this process are deferred until it returns. The observers
    (the reaper) hear when the grace ends, and that the processes are gone. ``early``,
    ``freed``, ``after_children``: see :func:`stop_leaders`.
    """
    with signals_deferred():
        for o in list(_observers):
            o.stopping(running, time.time() + grace_s)
        try:
            rep = stop_leaders(
                [r.leader for r in running],
                grace_s=grace_s,
                kill_wait_s=kill_wait_s,
                early=early,
                freed=freed,
                after_children=after_children,
            )
        finally:
            for r in running:  # reap our direct children (zombies by now, unless they survived)
                r.popen.poll()
        release_tmp(running)
        for o in list(_observers):
            o.stopped(running)
        return rep


# How long processes SIGKILLed on purpose may take to be gone: a vLLM worker with NIXL's
# registered memory took over 5 s on a loaded 2-core host (the kernel frees its address space).
KILL_WAIT_S = 30.0


def kill(running: Running, *, kill_wait_s: float = KILL_WAIT_S) -> StopReport:
    """SIGKILL ``running``'s group and every tracked process at once (no SIGTERM, no grace: a
    planned crash, e.g. a peer dying mid-transfer), then verify every PID gone within
    ``kill_wait_s`` (StopError names survivors). The observers (the reaper) hear of it as of any
    stop."""
    with signals_deferred():
        for o in list(_observers):
            o.stopping([running], time.time())
        t0 = time.monotonic()
        procs = _tracked(running.leader)
        try:
            _signal_all([running.pid], procs, signal.SIGKILL)
            left = _wait_gone(procs, kill_wait_s)
        finally:
            running.popen.poll()
        if left:
            states = {p.pid: kernel_state(p.pid) for p in left}
            for pid, st in states.items():
                log.warning(
                    "%s pid %d outlived SIGKILL by %.0f s: %s", running.name, pid, kill_wait_s, st.full
                )
            raise StopError(
                "processes survived SIGKILL: "
                + ", ".join(f"{running.name} pid {p.pid} ({states[p.pid].line})" for p in left)
            )
        release_tmp([running])
        for o in list(_observers):
            o.stopped([running])
        return StopReport(
            seconds=time.monotonic() - t0, killed=[running.name], pids=sorted(p.pid for p in procs)
        )


@dataclass(frozen=True)
class KernelState:
    """Where a process's threads are, as the kernel says (/proc/PID/task/*): ``line`` sums
    them up ('VLLM::Worker: 1 thread R in process_vm_rw_core, 40 S (futex_do_wait 30, ...)'),
    ``full`` has each thread's state, wchan, syscall and kernel stack (readable as root)."""

    line: str
    full: str


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def kernel_state(pid: int, proc: Path = Path("/proc")) -> KernelState:
    """What the kernel says of ``pid``'s threads: evidence for a process that outlives its
    SIGKILL (a thread spinning in the kernel, or one waiting where a fatal signal is not
    heard). Never raises; a process already gone reads as such."""
    base = proc / str(pid)
    comm = _read(base / "comm") or "?"
    try:
        tids = sorted((int(t.name) for t in (base / "task").iterdir()), key=lambda t: (t != pid, t))
    except (OSError, ValueError):
        return KernelState("gone", "gone")
    counts: dict[str, int] = {}
    where: dict[str, dict[str, int]] = {}
    rows = []
    for tid in tids:
        t = base / "task" / str(tid)
        stat = _read(t / "stat")
        fields = stat.rsplit(")", 1)[-1].split() if stat else []
        st = fields[0] if fields else "?"
        utime_stime = f"{fields[11]}+{fields[12]} ticks" if len(fields) > 12 else ""
        # the CPU it last ran on (stat field 39), the CPUs it may run on, and its nice value
        on_cpu = fields[36] if len(fields) > 36 else "?"
        nice = fields[16] if len(fields) > 16 else "?"
        allowed = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in _read(t / "status").splitlines()
                if ln.startswith("Cpus_allowed_list")
            ),
            "?",
        )
        stack = [ln.split("] ", 1)[-1].split("+", 1)[0] for ln in _read(t / "stack").splitlines()]
        wchan = _read(t / "wchan")
        spot = wchan if wchan not in ("", "0") else (stack[0] if stack else "")
        counts[st] = counts.get(st, 0) + 1
        if spot:
            where.setdefault(st, {})[spot] = where.setdefault(st, {}).get(spot, 0) + 1
        rows.append(
            f"  tid {tid} {_read(t / 'comm')!r} state {st} cpu {utime_stime} (last on CPU {on_cpu}, "
            f"allowed {allowed}, nice {nice}) wchan {wchan or '-'} "
            f"syscall {_read(t / 'syscall').split(' ')[0] or '-'}"
            + (f" stack {' < '.join(stack)}" if stack else "")
        )

    def at(st: str) -> str:
        w = sorted(where.get(st, {}).items(), key=lambda kv: -kv[1])
        if not w:
            return ""
        if counts[st] == 1:
            return f" in {w[0][0]}"
        return " (" + ", ".join(f"{k} {v}" for k, v in w[:3]) + (", ..." if len(w) > 3 else "") + ")"

    order = sorted(counts, key=lambda s: (s == "S", s))
    summary = ", ".join(f"{counts[s]} {s}{at(s)}" for s in order)
    line = f"{comm}: {len(tids)} thread{'s' if len(tids) != 1 else ''}: {summary}"
    return KernelState(line, f"{line}\n" + "\n".join(rows))


def stop_leaders(
    leaders: Sequence[Leader],
    *,
    grace_s: float,
    kill_wait_s: float = 5.0,
    early: Mapping[str, float] | None = None,
    freed: Callable[[], None] | None = None,
    after_children: Mapping[str, Callable[[], bool]] | None = None,
) -> StopReport:
    """SIGTERM to each leader's group and every tracked process, ``grace_s``, SIGKILL to what
    is left, then verify every PID gone (StopError names survivors). Needs no Popen: the
    reaper stops the harness's processes with it after the harness has died.

    ``early`` (leader name -> seconds; at or past ``grace_s`` it changes nothing): a leader
    whose group is still up that long after the SIGTERM gets its SIGKILL then. For a proxy
    (vllm-router): its graceful shutdown waits for the requests it forwards, and the servers
    behind it, stopping too, wait for the proxy's connections to close, so neither would end
    before the grace.

    ``freed`` is called once no process but the leaders themselves (and their resource
    trackers) is left (a vLLM API server holds only its port; its engine core and workers hold
    the devices), or at the latest when every process is verified gone: what waits for the
    devices may go on meanwhile.

    ``after_children`` (leader name -> predicate): once such a leader's own processes are gone
    (but its resource tracker) and its predicate says so, the leader alone gets SIGKILL then,
    rather than the rest of its graceful exit (a vLLM API server's interpreter shutdown, ~0.3 s
    on the CPU lane once its engine core and workers are gone); its tracker then exits by itself.
    """
    t0 = time.monotonic()
    owner: dict[int, str] = {}
    procs: list[psutil.Process] = []
    for r in leaders:
        for p in _tracked(r):
            owner[p.pid] = r.name
            procs.append(p)
    groups = list(dict.fromkeys(r.pid for r in leaders))  # in order: the router's first
    log.debug(
        "stop: %d processes of %d leaders found in %.3f s", len(procs), len(leaders), time.monotonic() - t0
    )
    _signal_all(groups, procs, signal.SIGTERM)
    left, waited, cut = procs, 0.0, []
    watch = _Watch(leaders, procs, owner, freed, after_children)
    for name, at in sorted((early or {}).items(), key=lambda kv: kv[1]):
        if at >= grace_s:
            break  # the SIGKILL at the end of the grace comes first
        left = _wait_gone(left, at - waited, each=watch)
        waited = at
        holding = [p for p in left if owner[p.pid] == name]
        if holding:
            log.info("%s still up %.1f s after SIGTERM: SIGKILL (what waits on it can end)", name, at)
            _signal_all([r.pid for r in leaders if r.name == name], holding, signal.SIGKILL)
            cut.append(name)
    left = _wait_gone(left, grace_s - waited, each=watch)
    killed = sorted({owner[p.pid] for p in left})
    if left:
        log.warning(
            "SIGKILL after %.0f s grace: %s", grace_s, ", ".join(f"{owner[p.pid]} pid {p.pid}" for p in left)
        )
        _signal_all(groups, left, signal.SIGKILL)
        _wait_gone(left, kill_wait_s)
    survivors = [p for p in procs if alive(p)]
    if survivors:
        raise StopError(
            "processes survived SIGKILL: " + ", ".join(f"{owner[p.pid]} pid {p.pid}" for p in survivors)
        )
    watch([])
    log.debug("stop: every process gone %.3f s after the start of the stop", _since(t0))
    if watch.ended:
        log.info("SIGKILLed once their workers were gone: %s", ", ".join(watch.ended))
    return StopReport(
        seconds=time.monotonic() - t0, killed=killed, pids=sorted(owner), cut=cut, ended=watch.ended
    )


# Python's multiprocessing resource tracker (argv "-c from multiprocessing.resource_tracker import
# main; main(N)"), a child of vLLM's API server: it holds no device, and it exits by itself once
# its parent has (after unlinking what the parent leaked).
RESOURCE_TRACKER = "multiprocessing.resource_tracker"


def _helper(p: psutil.Process) -> bool:
    """A process of ours that holds nothing: a resource tracker (told by its argv; never used
    to find a process to signal, only to tell which of ours still hold devices)."""
    try:
        return any(RESOURCE_TRACKER in a for a in p.cmdline())
    except psutil.Error:
        return False


def _since(t0: float) -> float:
    return time.monotonic() - t0


class _Watch:
    """Told what is left at every poll of a stop: calls ``freed`` once, the first time no process
    but the leaders and their helpers is left; SIGKILLs a leader of ``after_children`` once its
    own processes but helpers are gone and its predicate says it may go (its graceful exit has
    nothing left to do)."""

    def __init__(
        self,
        leaders: Sequence[Leader],
        procs: Sequence[psutil.Process],
        owner: Mapping[int, str],
        freed: Callable[[], None] | None,
        after_children: Mapping[str, Callable[[], bool]] | None,
    ):
        self.leaders = {r.pid for r in leaders}
        self.by_name = {r.name: r.pid for r in leaders}
        self.helpers = {p.pid for p in procs if p.pid not in self.leaders and _helper(p)}
        self.owner = owner
        self.freed = freed
        self.pending = dict(after_children or {})
        self.ended: list[str] = []

    def __call__(self, left: Sequence[psutil.Process]) -> None:
        holders = [p for p in left if p.pid not in self.leaders and p.pid not in self.helpers]
        if self.freed is not None and not holders:
            freed, self.freed = self.freed, None
            log.debug("stop: devices free (no engine core or worker left)")
            freed()
        for name, may_go in list(self.pending.items()):
            pid = self.by_name.get(name)
            leader = next((p for p in left if p.pid == pid), None)
            if leader is None:
                del self.pending[name]  # gone by itself
            elif not any(self.owner[p.pid] == name for p in holders) and may_go():
                del self.pending[name]
                with contextlib.suppress(psutil.Error):
                    leader.send_signal(signal.SIGKILL)
                log.debug("stop: %s SIGKILLed: its workers are gone and its shutdown logged", name)
                self.ended.append(name)


def cut_connections(addresses: Collection[tuple[str, int]]) -> int:
    """Shut down (``shutdown(2)``, both ways) every TCP connection of this process to one of
    ``addresses`` (host, port), whichever thread or library opened it; how many were cut.

    A server stopping gracefully (uvicorn under vLLM, vllm-router) waits for the requests it
    is serving. A request of ours still in flight (a check cancelled mid-request, its thread
    still blocked on it) would hold that server until its SIGKILL. The descriptor stays open:
    its owner sees the connection end, and closes it itself.
    """
    n = 0
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.fd < 0 or not c.raddr or (c.raddr.ip, c.raddr.port) not in addresses:
            continue
        try:
            s = socket.socket(fileno=c.fd)
        except OSError:
            continue  # closed meanwhile, or the number now names something else
        try:
            # Still that connection: its owner may have closed it and the number been reused.
            if tuple(s.getpeername()[:2]) == (c.raddr.ip, c.raddr.port):
                s.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError:
            pass
        finally:
            s.detach()
    return n


def terminate(running: Sequence[Running]) -> None:
    """SIGTERM to each group and tracked descendant, without waiting or verifying.

    Only for the benchmark's reproduction of the bash flow (``pkill`` then fixed
    sleeps); real teardown is :func:`stop`.
    """
    procs = [p for r in running for p in _tracked(r)]
    _signal_all([r.pid for r in running], procs, signal.SIGTERM)


def still_running(running: Sequence[Running]) -> list[str]:
    """'name pid N' for every tracked process of ``running`` that is still alive."""
    return [f"{r.name} pid {p.pid}" for r in running for p in _tracked(r) if alive(p)]
