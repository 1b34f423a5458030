"""The harness dies with its parent (edge, standard library only: the noxfile imports
:func:`nox_run_options`).

- **Parent death** (:class:`ParentWatch`): ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` makes the kernel
  send SIGTERM to the harness the moment its parent (nox) exits, however it exits; a thread
  polling ``os.getppid()`` every 0.25 s does the same where prctl does not exist.
- **Children** get ``PR_SET_PDEATHSIG = SIGTERM`` too (:func:`child_preexec`), set between fork
  and exec, so a server whose PID the reaper never heard of (the harness killed in the
  microseconds between fork and recording it) still hears that the harness is gone.
- **How long a stop may take** (:func:`teardown_budget_s`): what nox is told to wait on Ctrl-C.
- **nox's side** (:func:`nox_waits_for_the_harness`, in nox's interpreter around the harness's
  ``session.run``): SIGTERM and SIGHUP to nox are passed on to the harness and handled as nox
  handles Ctrl-C, so nox exits (128 + N) only once the harness has torn down and written results.

The reaper, which outlives the harness to stop what it left, is ``runtime.reaper``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

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


def child_preexec(*, any_thread: bool = False) -> Callable[[], None] | None:
    """A ``preexec_fn`` that gives a child SIGTERM when this process dies, or None.

    The kernel ties the signal to the *thread* that forked the child, so it is set only when
    the main thread spawns (a helper thread's exit must not stop a server), unless
    ``any_thread``: for a spawner whose threads live as long as it does (a Ray actor's method
    threads, runtime/raylaunch.py). Between fork and exec the child checks that we are still
    its parent: if we died before the prctl, it kills itself rather than run unnoticed.
    """
    if _PRCTL is None or (threading.current_thread() is not threading.main_thread() and not any_thread):
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


def watch() -> ParentWatch:
    """Start watching this process's parent (what :func:`parent_note` then reports on)."""
    global _watch
    _watch = ParentWatch()
    return _watch


def parent_note() -> str:
    """': the parent process (pid N) is gone' once the watched parent has exited, else ''
    (said with "stopped by SIGTERM", so a stop nobody sent by hand explains itself)."""
    if _watch is None or not _watch.gone():
        return ""
    return f": the parent process (pid {_watch.ppid}) is gone"


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


# ---------------------------------------------------------------- nox's side of a stop
# What nox must not die of while the harness runs: passed on, then waited for as Ctrl-C is
# (SIGHUP where it exists: nox imports this module wherever it runs).
NOX_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


class NoxStopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP to nox while it runs the harness, raised in nox's main thread as a
    KeyboardInterrupt: nox's ``popen`` then does what it does on Ctrl-C (waits
    ``interrupt_timeout`` for its command, then SIGTERM, SIGKILL 0.2 s later)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def child_pids(pid: int | None = None) -> list[int]:
    """The live (not zombie) children of ``pid`` (default: this process), read from /proc;
    [] where there is no /proc."""
    parent = os.getpid() if pid is None else pid
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []
    found = []
    for name in names:
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses, so split after the last ")"
        fields = stat.rpartition(b")")[2].split()
        if len(fields) > 1 and fields[0] != b"Z" and int(fields[1]) == parent:
            found.append(int(name))
    return found


@contextlib.contextmanager
def nox_waits_for_the_harness(say: Callable[[str], None]) -> Iterator[None]:
    """Around nox's ``session.run`` of the harness (with :func:`nox_run_options`), in nox's
    interpreter: nox exits only after the harness, and with the status of the signal it got.

    Left alone, SIGTERM and SIGHUP kill nox at once (it handles only SIGINT), while the harness
    it was running still tears down: a job whose main process is nox ends before the servers
    are gone and the results written. Here:

    | what nox gets while the harness runs | what nox does                                   |
    | ------------------------------------ | ----------------------------------------------- |
    | SIGTERM or SIGHUP, the first         | passes it on to its children (the harness: sent |
    |                                      | to nox alone, it would never hear of it; sent   |
    |                                      | to the group, the harness ignores the second    |
    |                                      | copy), raises :class:`NoxStopped`: nox waits as |
    |                                      | on Ctrl-C, then this exits 128 + N, also when   |
    |                                      | the harness ends with 0 (``serve``)             |
    | SIGTERM or SIGHUP again              | nothing (it already waits)                      |
    | SIGINT (Ctrl-C)                      | nox's own: waits for the harness, exits 130     |
    |                                      | (0 when the harness ends with 0: ``serve``)     |
    | nothing                              | the handlers nox had are back; nothing changes  |

    Python runs signal handlers in the main thread only: elsewhere (never under nox) this
    changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    forwarded: list[int] = []
    t0 = 0.0

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal t0
        if got:
            return
        got.append(signum)
        t0 = time.monotonic()
        for pid in child_pids():
            with contextlib.suppress(OSError):  # ended meanwhile
                os.kill(pid, signum)
                forwarded.append(pid)
        raise NoxStopped(signum)

    old = {s: signal.signal(s, handler) for s in NOX_STOP_SIGNALS}
    try:
        yield
    except BaseException:
        if not got:
            raise
        # NoxStopped: nox waited for its command as on Ctrl-C (or the command failed meanwhile)
    finally:
        if not got:
            for s, h in old.items():
                if h is not None:  # None: set outside Python, cannot be restored
                    signal.signal(s, h)
    if got:  # the handler stays: a later copy of the signal is ignored until nox has exited
        passed = f"passed it on to pid {', '.join(map(str, forwarded))}" if forwarded else "no child left"
        say(
            f"nox got {signal.Signals(got[0]).name} ({passed}) and waited "
            f"{time.monotonic() - t0:.1f} s for pd-sessions to end: nox exits {128 + got[0]}"
        )
        raise SystemExit(128 + got[0])
