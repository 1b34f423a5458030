"""Waiting for something to happen, with a bound that names what was awaited."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    what: str | Callable[[], str],
    *,
    proc: subprocess.Popen | None = None,
    tick: float = 0.02,
) -> T:
    """Call ``predicate`` every ``tick`` seconds until it returns something true, and return that.

    Fails with ``waited TIMEOUT s for WHAT`` once ``timeout`` seconds have passed, or at once
    when ``proc`` (a process the awaited thing depends on) has exited. ``what`` names what was
    awaited; a callable is called at the failure (to add, say, a log written meanwhile).
    """
    end = time.monotonic() + timeout
    while not (got := predicate()):
        rc = None if proc is None else proc.poll()
        if rc is not None or time.monotonic() >= end:
            said = what() if callable(what) else what
            if rc is not None:
                raise AssertionError(f"gave up waiting for {said}: pid {proc.pid} exited with status {rc}")
            raise AssertionError(f"waited {timeout:g} s for {said}")
        time.sleep(tick)
    return got


def wait_for_text(path: Path, text: str, timeout: float = 15.0) -> None:
    """Until ``text`` appears in the file at ``path`` (a process's log); fails at ``timeout``."""
    wait_until(lambda: path.exists() and text in path.read_text(), timeout, f"{text!r} to appear in {path}")


TIMINGS_ENV = "PD_SESSIONS_TIMINGS"


def within(took: float, bound_s: float, what: str) -> float:
    """Assert that ``what`` took less than ``bound_s`` seconds, and return ``took``. A test keeps
    such a bound only at least 5 times what the step takes (its median, measured) and far below
    what the failure it guards against takes, so that 2 busy cores cannot fail it: the table
    "Timed bounds kept in tests" in docs/cpu-lane.md. With PD_SESSIONS_TIMINGS=FILE each
    measurement is appended to FILE as a JSON line (how that table is measured again)."""
    if out := os.environ.get(TIMINGS_ENV):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        row = {"test": test, "what": what, "took_s": round(took, 3), "bound_s": bound_s}
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    assert took < bound_s, f"{what} took {took:.2f} s (bound {bound_s} s)"
    return took
