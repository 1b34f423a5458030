from __future__ import annotations

import json

from pd_sessions.core.results import CheckResult, ConfigResult
from pd_sessions.report.writers import table, write_summary


def result(checks, error=None):
    r = ConfigResult(
        name="1x1",
        shape="s",
        connector="mooncake",
        platform="cpu",
        error=error,
        phases={"plan": 1.0, "start": 60.0, "checks": 2.0},
    )
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


def test_junit_one_case_per_config_and_check(tmp_path):
    from junitparser import Error, Failure, JUnitXml

    from pd_sessions.report.writers import write_junit

    run_dir = tmp_path / "2x2"
    run_dir.mkdir()
    (run_dir / "decode-0.log").write_text("line a\nKV pull failed: boom\n")
    ok = result([("smoke", "pass"), ("parity", "pass"), ("kv_transfer", "pass")])
    bad = result([("smoke", "pass"), ("parity", "pass"), ("kv_transfer", "fail")])
    bad.name, bad.run_dir = "2x2", str(run_dir)
    bad.checks[2].message = "decode received 0 prompt tokens by KV transfer"
    dead = result([], error="decode-0 exited with status -9 (SIGKILL)\n--- last lines ---\nx")
    dead.name = "4x4"
    for r in (ok, bad, dead):
        r.decide(["smoke", "parity", "kv_transfer"])
    path = write_junit(
        [ok, bad, dead],
        tmp_path / "junit.xml",
        suite="mooncake_sweep",
        expected_checks=["smoke", "parity", "kv_transfer"],
    )
    xml = JUnitXml.fromfile(str(path))
    cases = [c for suite in xml for c in suite]
    assert len(cases) == 9
    by = {(c.classname, c.name): c for c in cases}
    assert by[("mooncake_sweep.1x1", "smoke")].is_passed
    failed = by[("mooncake_sweep.2x2", "kv_transfer")]
    (f,) = [r for r in failed.result if isinstance(r, Failure)]
    assert "0 prompt tokens by KV transfer" in f.message and "KV pull failed: boom" in f.text
    (e,) = [r for r in by[("mooncake_sweep.4x4", "smoke")].result if isinstance(r, Error)]
    assert "SIGKILL" in e.message
