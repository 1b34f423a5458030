"""Spawning and stopping processes (edge). The only module that sends signals.

Every process starts in its own session (so its process group holds it and
every child that does not leave the group). Stopping is: SIGTERM to each group
and to every tracked descendant, a grace period, SIGKILL to what is left, then a
check that every PID we tracked is gone. We never look processes up by name.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from pd_sessions.errors import StopError

log = logging.getLogger(__name__)


@dataclass
class Running:
    """A live process we started, and where its output goes."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    url: str | None = None
    # create_time of the leader, to tell it from a later process with the same PID
    create_time: float = 0.0

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        return f"(log unreadable: {e})"
    return "\n".join(deque(data.splitlines(), maxlen=lines))


def spawn(name: str, argv: Sequence[str], *, env: Mapping[str, str], log_path: Path,
          url: str | None = None, cwd: Path | None = None) -> Running:
    """Start ``argv`` in a new session with stdout+stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        out.write(f"# pd_sessions: starting {name}: {list(argv)}\n".encode())
        out.flush()
        popen = subprocess.Popen(list(argv), env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd)
    try:
        ct = psutil.Process(popen.pid).create_time()
    except psutil.Error:
        ct = 0.0
    log.debug("started %s pid %d", name, popen.pid)
    return Running(name=name, popen=popen, log_path=log_path, started_at=time.monotonic(),
                   url=url, create_time=ct)


@dataclass
class StopReport:
    seconds: float
    # names of processes that needed SIGKILL (ignored SIGTERM for the grace period)
    killed: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)


def _tracked(r: Running) -> list[psutil.Process]:
    """The leader, its descendants, and anything else still in its session."""
    procs: dict[int, psutil.Process] = {}
    try:
        leader = psutil.Process(r.pid)
        if r.create_time and abs(leader.create_time() - r.create_time) >= 0.01:
            return []  # the PID was recycled: our leader and its session are long gone
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


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_all(groups: set[int], procs: list[psutil.Process], sig: int) -> None:
    for pgid in groups:
        # Only while a process of ours is still in the group, so a recycled id is never hit.
        if any(_alive(p) and _pgid(p) == pgid for p in procs):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
    for p in procs:
        if _alive(p):
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except OSError:
        return None


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends (a cancel must not cut teardown short).

    A signal that arrives meanwhile is delivered, and acted on, right after.
    Only the main thread can do this; elsewhere it is a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def stop(running: Sequence[Running], *, grace_s: float = 10.0, kill_wait_s: float = 5.0) -> StopReport:
    """Stop ``running`` and all their descendants; raise StopError if any survive.

    SIGINT/SIGTERM to this process are deferred until it returns.
    """
    with signals_deferred():
        return _stop(running, grace_s=grace_s, kill_wait_s=kill_wait_s)


def _stop(running: Sequence[Running], *, grace_s: float, kill_wait_s: float) -> StopReport:
    t0 = time.monotonic()
    owner: dict[int, str] = {}
    procs: list[psutil.Process] = []
    for r in running:
        for p in _tracked(r):
            owner[p.pid] = r.name
            procs.append(p)
    groups = {r.pid for r in running}
    _signal_all(groups, procs, signal.SIGTERM)
    _, alive = psutil.wait_procs([p for p in procs if _alive(p)], timeout=grace_s)
    alive = [p for p in alive if _alive(p)]
    killed = sorted({owner[p.pid] for p in alive})
    if alive:
        log.warning("SIGKILL after %.0f s grace: %s", grace_s,
                    ", ".join(f"{owner[p.pid]} pid {p.pid}" for p in alive))
        _signal_all(groups, alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=kill_wait_s)
    for r in running:  # reap our direct children
        try:
            r.popen.wait(timeout=kill_wait_s)
        except subprocess.TimeoutExpired:
            pass
    survivors = [p for p in procs if _alive(p)]
    if survivors:
        raise StopError("processes survived SIGKILL: " + ", ".join(
            f"{owner[p.pid]} pid {p.pid}" for p in survivors))
    return StopReport(seconds=time.monotonic() - t0, killed=killed, pids=sorted(owner))
