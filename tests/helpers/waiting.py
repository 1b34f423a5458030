"""Waiting for something to happen, with a bound that names what was awaited."""

from __future__ import annotations

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
