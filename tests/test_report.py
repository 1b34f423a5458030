from __future__ import annotations

import json

from pd_sessions.checks.base import CheckResult
from pd_sessions.report import ConfigResult, table, write_summary


def result(checks, error=None):
    r = ConfigResult(name="1x1", shape="s", connector="mooncake", platform="cpu", error=error,
                     phases={"plan": 1.0, "start": 60.0, "checks": 2.0})
    r.checks = [CheckResult(n, v, "m") for n, v in checks]
    return r


def test_decide_passed_failed_error():
    r = result([("smoke", "pass"), ("parity", "pass")])
    r.decide(["smoke", "parity"])
    assert r.outcome == "passed"
    r = result([("smoke", "pass"), ("parity", "fail")])
    r.decide(["smoke", "parity"])
    assert r.outcome == "failed"
    r = result([("smoke", "pass")])
    r.decide(["smoke", "parity"])
    assert r.outcome == "error" and "did not run: parity" in r.error
    r = result([], error="decode-0 exited")
    r.decide(["smoke"])
    assert r.outcome == "error"


def test_table_and_summary(tmp_path):
    r = result([("smoke", "pass")])
    r.decide(["smoke"])
    text = table([r])
    assert "1x1" in text and "PASSED" in text and "smoke:pass" in text and "63.0" in text
    path = write_summary([r], tmp_path, {"sweep": "s"})
    doc = json.loads(path.read_text())
    assert doc["passed"] is True and doc["configs"][0]["checks"][0]["name"] == "smoke"
    assert (tmp_path / "summary.txt").read_text().startswith("config")


def test_summary_of_nothing_is_not_passed(tmp_path):
    assert json.loads(write_summary([], tmp_path, {}).read_text())["passed"] is False
