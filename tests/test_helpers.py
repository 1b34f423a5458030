"""The shared test helpers (conftest.py, helpers.py) that decide whether a test passes: wait_until."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import wait_until


def test_wait_until_returns_what_the_predicate_returned():
    calls = []
    assert wait_until(lambda: calls.append(1) or (len(calls) >= 3 and "ready"), 5, "three calls") == "ready"
    assert len(calls) == 3


def test_wait_until_fails_at_the_timeout_naming_what_it_awaited():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"^waited 0\.2 s for the moon to rise$"):
        wait_until(lambda: False, 0.2, "the moon to rise")
    assert 0.2 <= time.monotonic() - t0 < 1.0
    with pytest.raises(AssertionError, match="for a log line: computed at the failure"):
        wait_until(lambda: None, 0.05, lambda: "a log line: computed at the failure")


def test_wait_until_fails_at_once_when_the_awaited_process_exits():
    p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    p.wait(10)
    t0 = time.monotonic()
    said = rf"gave up waiting for its banner: pid {p.pid} exited with status 3"
    with pytest.raises(AssertionError, match=said):
        wait_until(lambda: False, 30, "its banner", proc=p)
    assert time.monotonic() - t0 < 1.0
