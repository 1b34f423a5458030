"""``python -m pd_sessions.runtime.gate MODULE ARG...``: import MODULE, wait for SIGUSR1, then run
it as ``python -m MODULE ARG...`` would (edge).

What it is for: vllm-router. Started with the instances, it looked at its workers at once, found
them starting, and then looked again only every whole second (``--worker-startup-check-interval``
takes whole seconds): it saw them ready 0.6-1.0 s late. Started once they are ready, its first look
finds them, but its own start-up, 0.45-0.5 s of imports (``vllm_router.launch_router`` imports
fastapi for its mini load balancer), is then on the path. Through the gate the imports happen
while the instances start; the cluster opens the gate (:func:`open_gate`, SIGUSR1) once every
instance is ready, and the router's first look finds them.

The gate blocks SIGUSR1 first thing, then says so on its output (:data:`HELD`); :func:`open_gate`
waits for that line before it signals (before it, SIGUSR1's default action would end the
process), so a gate opened while the imports run is kept until the wait. Any other signal acts as
on the router itself (SIGTERM ends it while it waits). A MODULE that fails to import exits at
once with its traceback, as ``python -m`` would.

Why ``python -m``: the held module runs in this process, as ``python -m MODULE`` would run it;
only the command line in front changes.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import signal
import sys
import time
from pathlib import Path

from pd_sessions.core.errors import ReadinessTimeout
from pd_sessions.runtime.process import Running

GO = signal.SIGUSR1
# The gate's first line, once GO is blocked: from then on GO is kept until the wait.
HELD = "pd_sessions gate: holding"
# How long open_gate waits for that line (an interpreter start and pd-sessions' import).
HELD_WAIT_S = 60.0


def gated(argv: list[str] | tuple[str, ...]) -> list[str]:
    """``[python, "-m", MODULE, *args]`` behind the gate: ``[python, "-m", __name__, MODULE, *args]``."""
    if len(argv) < 3 or argv[1] != "-m":
        raise ValueError(f"not a `python -m MODULE` command: {list(argv)!r}")
    return [argv[0], "-m", __name__, *argv[2:]]


def open_gate(r: Running, *, wait_s: float = HELD_WAIT_S) -> None:
    """Let the gated process ``r`` run its module, once its log shows the gate holding (GO then
    waits for it instead of ending it). A process that exits first is left to the caller's
    liveness check; one that never says so within ``wait_s`` is a ReadinessTimeout naming it."""
    start = time.monotonic()
    while not _holding(r.log_path):
        if r.poll() is not None:
            return
        if time.monotonic() - start > wait_s:
            raise ReadinessTimeout(
                r.name,
                url=r.url or "?",
                waited_s=time.monotonic() - start,
                last_probe=f"its gate never said {HELD!r}",
                log_path=r.log_path,
                log_tail=r.log_tail(),
            )
        time.sleep(0.005)
    os.kill(r.pid, GO)


def _holding(log: Path) -> bool:
    try:
        return HELD.encode() in log.read_bytes()
    except OSError:
        return False


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m pd_sessions.runtime.gate", description=__doc__.splitlines()[0]
    )
    p.add_argument("module", help="what to run as `python -m MODULE ARG...` once SIGUSR1 comes")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its command line")
    ns = p.parse_args(argv)
    module, args = ns.module, ns.args
    signal.pthread_sigmask(signal.SIG_BLOCK, {GO})
    print(f"{HELD} {module} until its workers are ready", flush=True)
    importlib.import_module(module)  # and with it everything it imports
    del sys.modules[module]  # run afresh below, as __main__ (its imports stay loaded)
    signal.sigwait({GO})
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {GO})
    sys.argv = [module, *args]  # noqa: TID251 - what the gated module reads, as `python -m` gives it
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
