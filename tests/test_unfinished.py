"""What a stopped or broken sweep records: the pure decisions and the writers."""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET

import pytest
from helpers.builders import cfg

from pd_sessions.core import cliargs
from pd_sessions.core.errors import UsageError
from pd_sessions.core.results import (
    CANCELLED,
    NOT_RUN,
    PASS,
    PASSED,
    RUNNING,
    CheckResult,
    ConfigResult,
    crashed,
)
from pd_sessions.report import unfinished


def res(name: str, outcome: str, **kw) -> ConfigResult:
    return ConfigResult(name=name, shape="1x1", connector="mooncake", platform="cpu", outcome=outcome, **kw)


class Stopped(BaseException):
    pass


@pytest.mark.parametrize(
    "exc,cause",
    [
        (KeyboardInterrupt(), "interrupted (SIGINT)"),
        (Stopped("stopped by SIGTERM"), "stopped by SIGTERM"),
        (Stopped(), "Stopped"),
    ],
)
def test_stop_cause(exc, cause):
    assert unfinished.stop_cause(exc) == cause


@pytest.mark.parametrize(
    "phases,said",
    [
        ({"plan": 0.1, "start": 3.0, "router": 1.0, "checks": 2.0, "teardown": 1.0}, "while checks ran"),
        ({"plan": 0.1, "teardown": 1.0}, "while the cluster was starting"),
        ({}, "while it was being planned"),
    ],
)
def test_interrupted_while(phases, said):
    assert unfinished.interrupted_while(res("a", RUNNING, phases=phases)) == said


def test_complete_marks_the_running_one_cancelled_and_the_rest_not_run():
    done = res("a", PASSED)
    running = res(
        "b", RUNNING, phases={"plan": 0.5, "checks": 1.0}, checks=[CheckResult("smoke", PASS, "ok")]
    )
    out = unfinished.complete(
        [cfg("a"), cfg("b"), cfg("c")], [done, running], platform="cpu", cause="stopped by SIGTERM"
    )
    assert [(r.name, r.outcome) for r in out] == [("a", PASSED), ("b", CANCELLED), ("c", NOT_RUN)]
    assert out[1].error == (
        "cancelled: stopped by SIGTERM while checks ran, 1.5 s in; checks finished before that: smoke"
    )
    assert out[1].checks == running.checks
    assert out[2].error == "not run: the sweep stopped before this config started (stopped by SIGTERM)"
    assert running.outcome == RUNNING, "complete() must not change the records it is given"


def test_positive_seconds():
    assert cliargs.positive_seconds("2.5") == 2.5
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(argparse.ArgumentTypeError, match="give a number of seconds above 0"):
            cliargs.positive_seconds(bad)


def test_check_writable(tmp_path):
    unfinished.check_writable(tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match=r"--results-dir: cannot write to .*file/sub \(Not a directory\)"):
        unfinished.check_writable(tmp_path / "file" / "sub")


def test_provisional_summary_says_the_sweep_did_not_finish(tmp_path):
    meta = {
        "overrides": ["model = 'tiny-llama'"],
        "environment": {"modules": {"vllm": {"version": "0.32.0"}}},
    }
    write = unfinished.Provisional(
        [cfg("a"), cfg("b")], tmp_path, suite="s", platform="cpu", checks=("smoke",), skipped=(), meta=meta
    )
    write([res("a", RUNNING)])
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["provisional"] and doc["passed"] is False
    # what the final summary records is there already: a killed sweep still says what it ran on
    assert doc["overrides"] == meta["overrides"] and doc["environment"] == meta["environment"]
    a, b = doc["configs"]
    assert a["outcome"] == CANCELLED and "killed with SIGKILL?" in a["error"]
    assert b["outcome"] == NOT_RUN and "killed with SIGKILL?" in b["error"]
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert suite.get("errors") == "1" and suite.get("skipped") == "1"
    assert "CANCELLED" in (tmp_path / "summary.txt").read_text()


def test_a_crashed_check_keeps_its_traceback():
    try:
        int("many")
    except ValueError as e:
        r = crashed("smoke", e)
    assert not r.passed
    assert r.message == (
        "crashed: ValueError: invalid literal for int() with base 10: 'many' (traceback in checks.log)"
    )
    assert r.details["traceback"].startswith("Traceback (most recent call last)")
