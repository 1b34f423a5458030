"""The shared test helpers (tests/helpers/) that decide whether a test passes: wait_until, needs."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.waiting import wait_until, within


def test_wait_until_returns_what_the_predicate_returned():
    calls = []
    assert wait_until(lambda: calls.append(1) or (len(calls) >= 3 and "ready"), 5, "three calls") == "ready"
    assert len(calls) == 3


def test_wait_until_fails_at_the_timeout_naming_what_it_awaited():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"^waited 0\.2 s for the moon to rise$"):
        wait_until(lambda: False, 0.2, "the moon to rise")
    took = time.monotonic() - t0
    assert took >= 0.2
    within(took - 0.2, 0.8, "the wait past its 0.2 s")
    with pytest.raises(AssertionError, match="for a log line: computed at the failure"):
        wait_until(lambda: None, 0.05, lambda: "a log line: computed at the failure")


@pytest.mark.procs
def test_wait_until_fails_at_once_when_the_awaited_process_exits():
    p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    p.wait(10)
    t0 = time.monotonic()
    said = rf"gave up waiting for its banner: pid {p.pid} exited with status 3"
    with pytest.raises(AssertionError, match=said):
        wait_until(lambda: False, 30, "its banner", proc=p)
    within(time.monotonic() - t0, 10.0, "giving up on an exited process (the timeout: 30 s)")


def test_needs_skips_here_and_fails_in_the_full_environment(monkeypatch):
    """The one rule for a missing piece: a skip naming it and the fix, except where `nox -s tests`
    built everything (FULL_ENV), where it is a failure."""
    from helpers import needs as rule

    assert rule.needs("json").__name__ == "json" and rule.needs() is None
    monkeypatch.setattr(rule, "FULL_ENV", False)
    with pytest.raises(
        pytest.skip.Exception, match=r"no_such_module_pd not installed .*\(run `nox -s tests`\)"
    ):
        rule.needs("json", "no_such_module_pd")
    with pytest.raises(pytest.skip.Exception, match=r"^root \(the fix\)$"):
        rule.needs(unmet="root", fix="the fix")
    monkeypatch.setattr(rule, "FULL_ENV", True)
    with pytest.raises(pytest.fail.Exception, match="the full environment lacks no_such_module_pd"):
        rule.needs("no_such_module_pd")
    with pytest.raises(pytest.fail.Exception, match="the full environment lacks no_such_package_pd"):
        rule.package_dir("no_such_package_pd")


def test_tests_import_their_helpers_never_conftest():
    """conftest.py holds fixtures and hooks, found by pytest; what tests import is in helpers/."""
    here = Path(__file__).parent
    offenders = [
        f"{f.relative_to(here)}:{i}"
        for f in sorted(here.rglob("*.py"))
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if re.match(r"\s*(from conftest import|import conftest)\b", line)
    ]
    assert offenders == []


def test_a_skip_fails_in_the_unit_tier_and_stays_a_skip_elsewhere():
    from helpers.needs import no_skip_in_unit_tier

    def report(**extra):
        r = pytest.TestReport(
            "t.py::t", ("t.py", 1, "t"), {}, "skipped", ("t.py", 1, "Skipped: no vllm"), "call"
        )
        r.__dict__.update(extra)
        return r

    r = report()
    no_skip_in_unit_tier(r, unit_tier=False)
    assert r.skipped
    no_skip_in_unit_tier(r, unit_tier=True)
    assert r.failed and "skipped in the unit tier (Skipped: no vllm)" in r.longrepr and "procs" in r.longrepr
    expected = report(wasxfail="known")
    no_skip_in_unit_tier(expected, unit_tier=True)
    assert expected.skipped
