"""Buildkite (pd_sessions/report/buildkite_annotation.py) with a fake ``buildkite-agent`` on PATH: the
annotation keeps the table and links report.html as Buildkite documents artifact links; the
results directory is uploaded by the sweep only when asked (steps without artifact_paths)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from pd_sessions.core.results import CheckResult, ConfigResult
from pd_sessions.report import buildkite_annotation

FAKE_AGENT = f"""#!{sys.executable}
import json, os, sys
record = {{"argv": sys.argv[1:], "cwd": os.getcwd()}}
if sys.argv[1:2] == ["annotate"]:
    record["stdin"] = sys.stdin.read()
with open(os.environ["FAKE_AGENT_LOG"], "a") as f:
    f.write(json.dumps(record) + "\\n")
sys.exit(int(os.environ.get("FAKE_AGENT_STATUS", "0")))
"""


@pytest.fixture
def agent(tmp_path: Path, monkeypatch) -> Path:
    """A fake buildkite-agent first on PATH; the calls it got are read from the returned file."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "buildkite-agent"
    exe.write_text(FAKE_AGENT)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "agent-calls.jsonl"
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_AGENT_LOG", str(calls))
    return calls


def calls(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def result(name: str, outcome: str) -> ConfigResult:
    r = ConfigResult(name, "1xP(TP1) + 1xD(TP1)", "mooncake", "cpu", outcome=outcome)
    r.checks = [CheckResult("smoke", "pass" if outcome == "passed" else "fail", "m")]
    return r


@pytest.mark.procs
def test_annotation_keeps_the_table_and_links_the_page_as_an_artifact(agent, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    page = tmp_path / "results" / "cpu-lane" / "report.html"
    page.parent.mkdir(parents=True)
    page.write_text("<!doctype html>")
    assert buildkite_annotation.annotate(
        [result("1x1", "passed"), result("2x2", "failed")], sweep="mooncake_sweep", page=page
    )
    (call,) = calls(agent)
    assert call["argv"] == ["annotate", "--style", "error", "--context", "pd-sessions-mooncake_sweep"]
    body = call["stdin"]
    assert body.startswith("**mooncake_sweep**: FAILED")
    assert '<a href="artifact://results/cpu-lane/report.html">report.html</a>' in body
    assert "1x1" in body and "PASSED" in body and "2x2" in body and "smoke:fail" in body  # the table


@pytest.mark.procs
def test_a_passing_sweep_is_annotated_success_and_without_a_page_there_is_no_link(agent):
    assert buildkite_annotation.annotate([result("1x1", "passed")], sweep="s", page=None)
    (call,) = calls(agent)
    assert call["argv"][:3] == ["annotate", "--style", "success"]
    assert "artifact://" not in call["stdin"] and call["stdin"].startswith("**s**: passed")


def test_a_page_path_with_quotes_cannot_break_out_of_the_link():
    body = buildkite_annotation.annotation(
        [result("1x1", "passed")], sweep="<b>s</b>", page='r/"x<y>"/report.html'
    )
    assert 'href="artifact://r/&quot;x&lt;y&gt;&quot;/report.html"' in body and "<b>" not in body


@pytest.mark.procs
def test_upload_sends_the_results_directory_relative_to_the_job(agent, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = tmp_path / "results" / "nixl"
    results.mkdir(parents=True)
    said = buildkite_annotation.upload(results)
    (call,) = calls(agent)
    assert call["argv"] == ["artifact", "upload", "results/nixl/**/*"] and call["cwd"] == str(tmp_path)
    assert said == "results uploaded as Buildkite artifacts: results/nixl/**/*"
    monkeypatch.setenv("FAKE_AGENT_STATUS", "3")
    assert "exited with status 3" in buildkite_annotation.upload(results)


def test_without_the_agent_nothing_happens(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert buildkite_annotation.annotate([result("1x1", "passed")], sweep="s", page=None) is False
    assert "buildkite-agent is not on PATH" in buildkite_annotation.upload(tmp_path)
