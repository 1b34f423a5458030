"""Nothing outlives a stopped run (edge): the harness dies with its parent, and a small
reaper outlives the harness just long enough to stop what the harness started.

Each way a run can be stopped, and what catches it:

| how it is stopped | the harness sees | the servers are stopped by |
| --- | --- | --- |
| Ctrl-C (SIGINT to the foreground group) | SIGINT | its own teardown (cluster.py) |
| SIGTERM to the group (Buildkite's cancel) | SIGTERM | its own teardown |
| SIGTERM or SIGHUP to nox alone | the same, passed on by nox (which then waits for it) | its own teardown |
| SIGKILL to nox | SIGTERM (parent death) | its own teardown |
| SIGKILL to the harness (*) | nothing | the reaper; each server's parent-death SIGTERM |

(*) Buildkite 10 s after its SIGTERM, nox 0.5 s after Ctrl-C unless told to wait
(``parentwatch.nox_run_options``), the OOM killer.

The servers run in sessions of their own (so the teardown alone decides how they stop), so no
signal to our group reaches them: only the harness, or the reaper, stops them.

- **Parent death** (``runtime.parentwatch``): the kernel sends SIGTERM to the harness the moment
  its parent (nox) exits, however it exits; children get the same (``child_preexec``).
- **The reaper** (:class:`Reaper`, ``python -m pd_sessions.runtime.reaper``): a process in its own
  session (so a signal to our group, SIGKILL included, misses it), fed over a pipe with every
  process the harness starts (name, PID, start time in clock ticks: process.start_ticks), when a
  teardown begins (and when its grace ends), and when a teardown has verified them gone. The
  pipe's end is its only trigger: when the harness exits, however it exits, the kernel closes the
  pipe; the reaper then stops whatever is
  still recorded (SIGTERM, the rest of the grace the harness had begun, SIGKILL, every PID
  verified gone, as process.stop does), logs what it did to ``<results>/reaper.log``, and exits.
  After a clean exit nothing is recorded and it exits at once.
- **Resources** (``Reaper.created``): the simulated hosts' namespaces, bridge and veth links,
  and their files (a state file, a symbolic link), recorded before they are created. What is
  still recorded when the pipe ends is removed after the processes, newest first.

Why ``python -m`` (not a ``pd-sessions`` subcommand): a process boundary. The reaper is a process
of its own, in a session of its own, that must outlive the harness; the harness starts it, never
a user.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from pd_sessions.core.errors import PdError, StopError
from pd_sessions.runtime import netns, parentwatch, process
from pd_sessions.runtime.parentwatch import KILL_WAIT_S


class _Process(Protocol):
    name: str
    start_ticks: int | None

    @property
    def pid(self) -> int: ...


class Reaper(process.Observer):
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
        here = str(Path(__file__).resolve().parents[2])
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
                    "pd_sessions.runtime.reaper",
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
        self._send({"add": {"name": r.name, "pid": r.pid, "start_ticks": r.start_ticks}})

    def stopping(self, rs: Sequence[_Process], kill_at: float) -> None:
        self._send({"stopping": [r.pid for r in rs], "kill_at": kill_at})

    def stopped(self, rs: Sequence[_Process]) -> None:
        self._send({"forget": [r.pid for r in rs]})

    def created(self, kind: str, name: str) -> None:
        """A resource the harness is about to create (record first, then create): the
        simulated hosts' namespaces and links (kinds in runtime.netns), files (``file``:
        a file or symbolic link, never a folder) and the processes' private temporary folders
        (``tmpdir``, process.spawn). Left ones are removed after the processes,
        newest first."""
        self._send({"resource": [kind, name]})

    def removed(self, kind: str, name: str) -> None:
        self._send({"release": [kind, name]})

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


class Lifeline:
    """Parent watch + reaper for one sweep: ``with Lifeline(results_dir, ...) as lifeline:``
    then ``process.observed(lifeline.reaper)``; see the module docstring."""

    def __init__(self, results_dir: Path, *, grace_s: float, warn: Callable[[str], None]):
        self.reaper = Reaper(results_dir / "reaper.log", grace_s=grace_s, warn=warn)
        self.parent = parentwatch.watch()
        left = process.remove_orphan_tmp_dirs()  # an earlier run's, whose stop was cut short
        if left:
            more = f" and {len(left) - 4} more" if len(left) > 4 else ""
            names = ", ".join(Path(p).name for p in left[:4]) + more
            warn(f"removed {len(left)} private temporary folder(s) of processes an earlier run left: {names}")

    def __enter__(self) -> Lifeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reaper.close()
        self.parent.close()


def _reap(grace_s: float, harness: int, say: Callable[[str], None]) -> int:
    """The reaper process: read the harness's records until the pipe ends, then stop what is
    left (see the module docstring). Exit 1 if anything survived SIGKILL."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    known: dict[int, process.Leader] = {}
    kill_at: dict[int, float] = {}
    resources: dict[tuple[str, str], None] = {}  # in the order created
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
        elif "resource" in msg:
            resources[tuple(msg["resource"])] = None
        elif "release" in msg:
            resources.pop(tuple(msg["release"]), None)
    if not known and not resources:
        say("pd-sessions is done, and stopped everything it started itself: nothing to do")
        return 0
    status = _stop_left(known, kill_at, grace_s, harness, say) if known else 0
    return _remove_left(list(resources), say, keep_files=bool(status)) or status


def _stop_left(
    known: dict[int, process.Leader],
    kill_at: dict[int, float],
    grace_s: float,
    harness: int,
    say: Callable[[str], None],
) -> int:
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


def _remove_left(resources: list[tuple[str, str]], say: Callable[[str], None], *, keep_files: bool) -> int:
    """Remove what the harness created and did not remove, newest first (the namespaces and
    links after the processes in them); files only if everything else went (a run's state file
    stays for the next run's sweep when something could not be removed). Exit 1 on a failure."""
    if not resources:
        return 0
    say(f"removing what pd-sessions left: {', '.join(f'{k} {n}' for k, n in resources)}")
    failed: list[str] = []
    for kind, name in reversed(resources):
        try:
            if kind in ("file", process.TMP_DIR):
                if failed or keep_files:
                    say(f"{kind} {name}: kept (something else could not be removed)")
                    continue
                gone = _remove_file(Path(name)) if kind == "file" else _remove_tmp_dir(Path(name))
            else:
                gone = netns.remove(kind, name)
        except (OSError, PdError, ValueError) as e:
            failed.append(f"{kind} {name}: {e}")
            continue
        say(f"{kind} {name}: {'removed' if gone else 'already gone'}")
    for f in failed:
        say(f"FAILED: {f}")
    return 1 if failed else 0


def _remove_tmp_dir(path: Path) -> bool:
    """Remove a process's private temporary folder (process.spawn's private_tmp); False if gone."""
    if not path.exists():
        return False
    process.remove_tmp_dir(path)
    return True


def _remove_file(path: Path) -> bool:
    """Remove a file or symbolic link (never a folder); False if it was gone."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pd_sessions.runtime.reaper",
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
