"""Teardown time on throwaway process trees shaped like a cluster (edge).

Three "servers" (prefill, decode, router), each a leader with one child (like
vLLM's engine core), stopped with pd_sessions' own cluster teardown. In the
``ignores_sigterm`` case the decode's child ignores SIGTERM, so the teardown must
wait out the grace period and SIGKILL it; goal: done within grace + 2 s.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from pd_sessions.bench.stats import summary
from pd_sessions.core.errors import BenchError
from pd_sessions.runtime import process
from pd_sessions.runtime.cluster import teardown

READY = "child ready"
# printed as a sum, so the marker is not already in the log's first line (the argv)
_CHILD = "import signal, time\n{ignore}print('child' + ' ready', flush=True)\ntime.sleep(3600)\n"
_LEADER = (
    "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(3600)\n"
)


def _server(name: str, log_dir: Path, ignore_term: bool) -> process.Running:
    """A leader and its child; returns once the child says it is ready (handler set)."""
    child = _CHILD.format(ignore="signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
    log = log_dir / f"{name}.log"
    r = process.spawn(name, [sys.executable, "-c", _LEADER.format(child=child)], env={}, log_path=log)
    end = time.monotonic() + 10
    while READY not in log.read_text():  # the child inherits the leader's output
        if time.monotonic() > end or r.poll() is not None:
            process.stop([r], grace_s=1)
            raise BenchError(f"teardown bench: {name}'s child did not start within 10 s (log: {log})")
        time.sleep(0.01)
    return r


def measure(kind: str, log_dir: Path, grace_s: float) -> float:
    """Seconds the cluster teardown took for one tree (``kind``: healthy | ignores_sigterm)."""
    prefill = _server("prefill-0", log_dir, False)
    decode = _server("decode-0", log_dir, kind == "ignores_sigterm")
    router = _server("router", log_dir, False)
    quiet = logging.getLogger("pd_sessions")  # the SIGKILL warnings are expected here
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        t = time.monotonic()
        teardown(router, [prefill, decode], grace_s=grace_s)
        took = time.monotonic() - t
    finally:
        quiet.setLevel(level)
    left = process.still_running([prefill, decode, router])
    if left:
        raise BenchError(f"teardown bench: still running after teardown: {', '.join(left)}")
    return took


def run(log_dir: Path, *, repeats: int, grace_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {
        "grace_s": grace_s,
        "what": (
            "3 throwaway process trees (leader + child, like an API server and its engine core) "
            "stopped by pd_sessions' cluster teardown; in ignores_sigterm the decode's child "
            "ignores SIGTERM"
        ),
    }
    for kind in ("healthy", "ignores_sigterm"):
        out[kind] = summary([measure(kind, log_dir / f"{kind}-{i}", grace_s) for i in range(repeats)])
    return out
