"""Throwaway processes, and finding what is left of a run's processes."""

from __future__ import annotations

import os
import textwrap

import psutil

from helpers.waiting import wait_until

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


def session_members(sid: int) -> list[int]:
    """PIDs of the session ``sid``'s processes that are not zombies."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (OSError, psutil.Error):
            pass
    return out


def wait_for_members(sid: int, n: int, timeout: float = 10.0) -> list[int]:
    """The session ``sid``'s processes once there are at least ``n`` (an orphan is forked by a
    child that may still be running)."""
    return wait_until(
        lambda: members if len(members := session_members(sid)) >= n else None,
        timeout,
        lambda: f"{n} processes in session {sid} (have {session_members(sid)})",
    )


def gone(pid: int) -> bool:
    """No process ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids, timeout: float, what: str = "") -> None:
    """Until every one of ``pids`` is gone; fails at ``timeout`` naming ``what`` and who is left."""
    wait_until(
        lambda: all(gone(p) for p in pids),
        timeout,
        lambda: f"{what or 'processes'} to be gone (left: {[p for p in pids if not gone(p)]})",
    )


def process_on_port(port: int, *, by_argv: bool = False) -> psutil.Process | None:
    """The process listening on ``port`` (vllm-router rewrites its title, so argv won't do); with
    ``by_argv``, else the one started with ``--port PORT`` (it may not listen yet)."""
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return psutil.Process(c.pid)
    if by_argv:
        for p in psutil.process_iter(["cmdline"]):
            argv = p.info["cmdline"] or []
            if "--port" in argv and argv[argv.index("--port") + 1] == str(port):
                return p
    return None


def processes_using(ports: dict[str, int]) -> list[str]:
    """Processes still serving or started for any of ``ports`` (by argv or a listening socket)."""
    wanted = {str(p) for p in ports.values()}
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        argv = p.info["cmdline"] or []
        for i, a in enumerate(argv[:-1]):
            if a == "--port" and argv[i + 1] in wanted:
                found.append(f"pid {p.pid}: {' '.join(argv)[:120]}")
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.laddr and str(c.laddr.port) in wanted:
            found.append(f"pid {c.pid} listens on {c.laddr.port}")
    return found


def move_btime(monkeypatch, by: float) -> None:
    """Move what ``/proc/stat``'s ``btime`` says by ``by`` seconds, as the kernel does when it
    recomputes it (whole seconds, wall clock minus CLOCK_BOOTTIME) after a slew of the clock
    across a second's boundary (issue 38): psutil's ``create_time()`` moves with it."""
    from psutil import _pslinux

    real = _pslinux.boot_time
    monkeypatch.setattr(_pslinux, "boot_time", lambda: real() + by)


def old_rule_same(pid: int, recorded_create_time: float) -> bool:
    """The identity rule before issue 38 (psutil create_time within 0.01 s)."""
    return abs(psutil.Process(pid).create_time() - recorded_create_time) < 0.01
