"""Nothing outlives a stopped run (edge): the harness dies with its parent, and a small
reaper outlives the harness just long enough to stop what the harness started.

Each way a run can be stopped, and what catches it:

| how it is stopped | the harness sees | the servers are stopped by |
| --- | --- | --- |
| Ctrl-C (SIGINT to the foreground group) | SIGINT | its own teardown (cluster.py) |
| SIGTERM to the group (Buildkite's cancel) | SIGTERM | its own teardown |
| SIGTERM or SIGKILL to nox alone | SIGTERM (parent death) | its own teardown |
| SIGKILL to the harness (*) | nothing | the reaper; each server's parent-death SIGTERM |

(*) Buildkite 10 s after its SIGTERM, nox 0.5 s after Ctrl-C unless told to wait
(:func:`nox_run_options`), the OOM killer.

The servers run in sessions of their own (so the teardown alone decides how they stop), so no
signal to our group reaches them: only the harness, or the reaper, stops them.

- **Parent death** (:class:`ParentWatch`): ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` makes the kernel
  send SIGTERM to the harness the moment its parent (nox) exits, however it exits; a thread
  polling ``os.getppid()`` every 0.25 s does the same where prctl does not exist.
- **The reaper** (:class:`Reaper`, ``python -m pd_sessions.lifeline``): a process in its own
  session (so a signal to our group, SIGKILL included, misses it), fed over a pipe with every
  process the harness starts (name, PID, start time), when a teardown begins (and when its grace
  ends), and when a teardown has verified them gone. The pipe's end is its only trigger: when the
  harness exits, however it exits, the kernel closes the pipe; the reaper then stops whatever is
  still recorded (SIGTERM, the rest of the grace the harness had begun, SIGKILL, every PID
  verified gone, as process.stop does), logs what it did to ``<results>/reaper.log``, and exits.
  After a clean exit nothing is recorded and it exits at once.
- **Children** get ``PR_SET_PDEATHSIG = SIGTERM`` too (:func:`child_preexec`), set between fork
  and exec, so a server whose PID the reaper never heard of (the harness killed in the
  microseconds between fork and recording it) still hears that the harness is gone.

Standard library only at import: the noxfile imports :func:`nox_run_options`.

Why ``python -m`` (not a ``pd-sessions`` subcommand): a process boundary. The reaper is a process
of its own, in a session of its own, that must outlive the harness; the harness starts it, never
a user.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

PR_SET_PDEATHSIG = 1
# The harness's own stop waits: see process.stop (kill_wait_s) and cluster.DEFAULT_GRACE_S.
DEFAULT_GRACE_S = 10.0
KILL_WAIT_S = 5.0
# After its teardown the harness writes summary.json, summary.txt and junit.xml (well under 1 s).
RESULTS_MARGIN_S = 5.0


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


_PRCTL = _load_prctl()


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (0 clears it).
    False where that is not possible (not Linux)."""
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def child_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that gives a child SIGTERM when this process dies, or None.

    The kernel ties the signal to the *thread* that forked the child, so it is set only when
    the main thread spawns (a helper thread's exit must not stop a server). Between fork and
    exec the child checks that we are still its parent: if we died before the prctl, it kills
    itself rather than run unnoticed.
    """
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    prctl, parent, term, kill = _PRCTL, os.getpid(), int(signal.SIGTERM), int(signal.SIGKILL)

    def setup() -> None:  # runs in the child between fork and exec: no locks, no imports
        prctl(PR_SET_PDEATHSIG, term, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), kill)

    return setup


class ParentWatch:
    """SIGTERM to this process when its parent exits: prctl where it exists, and a thread
    polling ``os.getppid()`` (``poll_s``) everywhere. The CLI turns SIGTERM into a teardown."""

    def __init__(self, poll_s: float = 0.25):
        self.ppid = os.getppid()
        self.armed = set_parent_death_signal(signal.SIGTERM)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._poll, args=(poll_s,), name="pd-parent-watch", daemon=True
        )
        self._thread.start()
        if os.getppid() != self.ppid:  # gone between reading it and arming: the kernel won't tell
            os.kill(os.getpid(), signal.SIGTERM)

    def _poll(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            if os.getppid() != self.ppid:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def gone(self) -> bool:
        return os.getppid() != self.ppid

    def close(self) -> None:
        self._stop.set()
        if self.armed:
            set_parent_death_signal(0)
        self._thread.join(1.0)


_watch: ParentWatch | None = None


def parent_note() -> str:
    """': the parent process (pid N) is gone' once the watched parent has exited, else ''
    (said with "stopped by SIGTERM", so a stop nobody sent by hand explains itself)."""
    if _watch is None or not _watch.gone():
        return ""
    return f": the parent process (pid {_watch.ppid}) is gone"


class _Process(Protocol):
    name: str
    create_time: float

    @property
    def pid(self) -> int: ...


class Reaper:
    """The harness's side of the reaper: starts it, and tells it what to stop if we die.

    Used as a process observer (``process.observed(reaper)``): ``spawned`` when a process
    starts, ``stopping`` when its teardown begins (with the wall-clock time its grace ends),
    ``stopped`` once it is verified gone. ``close`` ends the pipe and waits for the reaper.
    """

    def __init__(self, log_path: Path, *, grace_s: float, warn: Callable[[str], None]):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._warn = warn
        self._broken = False
        here = str(Path(__file__).resolve().parent.parent)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [here] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
            ),
        }
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pd_sessions.lifeline",
                    "--grace",
                    str(grace_s),
                    "--harness",
                    str(os.getpid()),
                ],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def _send(self, msg: dict[str, Any]) -> None:
        if self._broken or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as e:
            self._broken = True
            self._warn(
                f"the reaper (pid {self.proc.pid}) is gone ({e}): if pd-sessions is now killed "
                f"with SIGKILL, its servers may outlive it; see {self.log_path}"
            )

    def spawned(self, r: _Process) -> None:
        self._send({"add": {"name": r.name, "pid": r.pid, "create_time": r.create_time}})

    def stopping(self, rs: Sequence[_Process], kill_at: float) -> None:
        self._send({"stopping": [r.pid for r in rs], "kill_at": kill_at})

    def stopped(self, rs: Sequence[_Process]) -> None:
        self._send({"forget": [r.pid for r in rs]})

    def close(self, timeout: float = 2.0) -> None:
        """End the pipe; the reaper stops anything still recorded (nothing, after a clean
        teardown) and exits."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._warn(
                f"the reaper (pid {self.proc.pid}) is still stopping processes that survived "
                f"the teardown; see {self.log_path}"
            )


def teardown_budget_s(grace_s: float) -> float:
    """How long pd-sessions may take after Ctrl-C before anyone should kill it: its grace,
    the wait after SIGKILL, and writing the results."""
    return grace_s + KILL_WAIT_S + RESULTS_MARGIN_S


def grace_from_args(args: Sequence[str]) -> float:
    """The ``--grace`` in a command line (``--grace S`` or ``--grace=S``), else the default;
    an unreadable value is the default (the CLI itself refuses it)."""
    value: str | None = None
    for i, a in enumerate(args):
        if a == "--grace" and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith("--grace="):
            value = a.split("=", 1)[1]
    try:
        return float(value) if value is not None else DEFAULT_GRACE_S
    except ValueError:
        return DEFAULT_GRACE_S


def nox_run_options(posargs: Sequence[str]) -> dict[str, float]:
    """Keyword arguments for nox's ``session.run`` of a sweep.

    On Ctrl-C nox waits ``interrupt_timeout`` (0.3 s by default), then SIGTERMs and, 0.2 s later,
    SIGKILLs its command: far too soon for a teardown. It waits for the teardown's budget instead;
    the reaper still covers a teardown that overruns it.
    """
    return {"interrupt_timeout": teardown_budget_s(grace_from_args(posargs))}


class Lifeline:
    """Parent watch + reaper for one sweep: ``with Lifeline(results_dir, ...) as lifeline:``
    then ``process.observed(lifeline.reaper)``; see the module docstring."""

    def __init__(self, results_dir: Path, *, grace_s: float, warn: Callable[[str], None]):
        global _watch
        self.reaper = Reaper(results_dir / "reaper.log", grace_s=grace_s, warn=warn)
        self.parent = _watch = ParentWatch()

    def __enter__(self) -> Lifeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reaper.close()
        self.parent.close()


def _reap(grace_s: float, harness: int, say: Callable[[str], None]) -> int:
    """The reaper process: read the harness's records until the pipe ends, then stop what is
    left (see the module docstring). Exit 1 if anything survived SIGKILL."""
    from pd_sessions import process  # psutil: only in the reaper, not in what nox imports
    from pd_sessions.errors import StopError

    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    known: dict[int, process.Leader] = {}
    kill_at: dict[int, float] = {}
    say(f"reaper pid {os.getpid()}: watching pd-sessions pid {harness}")
    for line in sys.stdin:
        msg = json.loads(line)
        if "add" in msg:
            leader = process.Leader(**msg["add"])
            known[leader.pid] = leader
        elif "stopping" in msg:
            kill_at.update(dict.fromkeys(msg["stopping"], float(msg["kill_at"])))
        elif "forget" in msg:
            for pid in msg["forget"]:
                known.pop(pid, None)
                kill_at.pop(pid, None)
    if not known:
        say("pd-sessions is done, and stopped everything it started itself: nothing to do")
        return 0
    now = time.time()
    deadline = max(kill_at.get(pid, now + grace_s) for pid in known)
    say(
        f"pd-sessions pid {harness} is gone while {len(known)} of its processes may still run: "
        f"{', '.join(f'{x.name} pid {x.pid}' for x in known.values())}; stopping them "
        f"(SIGKILL in {max(0.0, deadline - now):.1f} s)"
    )
    try:
        rep = process.stop_leaders(
            list(known.values()), grace_s=max(0.0, deadline - time.time()), kill_wait_s=KILL_WAIT_S
        )
    except StopError as e:
        say(f"FAILED: {e}")
        return 1
    say(
        f"done in {rep.seconds:.2f} s: {len(rep.pids)} processes gone"
        + (f"; needed SIGKILL: {', '.join(rep.killed)}" if rep.killed else "")
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pd_sessions.lifeline",
        description="the reaper: started by pd-sessions itself, not by hand",
    )
    p.add_argument("--grace", type=float, required=True)
    p.add_argument("--harness", type=int, required=True)
    args = p.parse_args(argv)

    def say(msg: str) -> None:
        print(f"[reaper {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    return _reap(args.grace, args.harness, say)


if __name__ == "__main__":
    sys.exit(main())
