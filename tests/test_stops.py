"""Every way of stopping a run, driven through nox itself: nox exits with the signal's status
(128 + N) only once nothing is left and summary.json, summary.txt, junit.xml and report.html are written
(SIGKILL to nox: it dies at once, and nothing outlives it by more than grace + 2 s); the same
for the serve session, which runs inside the same lifeline (nox SIGKILLed, or serve itself).

The project's own noxfile runs the sweep: its generic ``sweep`` session in installed-environment
mode (``nox --no-venv -s sweep -- FILE.toml ... --no-install``: this interpreter as found, nothing
installed or changed), so the session checks the environment, runs the import canary and starts
``python -m pd_sessions sweep`` exactly as a user's ``nox`` does. It runs against the fake stack
of test_faults.py (vLLM and the router replaced by a throwaway server with a grandchild "engine
core") and a fake installed environment (tests/fixtures/fake_env: a CPU-only torch and the
Mooncake connector, which the session's checks accept as they would real ones): what is under
test is the harness's own handling, where timing matters. Real vLLM: test_e2e_stops.py.

nox and the harness run in a process group of their own, as under a terminal or the
Buildkite agent; the servers, as always, in sessions of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import psutil
import pytest
from helpers import ROOT
from helpers.fake_runs import GRACE, TWO_CONFIGS, NoxRun, assert_nothing_left, fake_stack_env
from helpers.waiting import within

from pd_sessions.runtime.process import alive, session_family

pytestmark = pytest.mark.procs


def assert_cancel_recorded(run: NoxRun, cause: str) -> None:
    """The interrupted config is cancelled (by ``cause``), the other not run; all three files."""
    doc = run.summary()
    assert "provisional" not in doc, doc
    first, second = doc["configs"]
    assert first["outcome"] == "cancelled" and cause in first["error"], first
    assert "while the cluster was starting" in first["error"]
    assert second["outcome"] == "not run" and cause in second["error"], second
    assert "CANCELLED" in (run.results / "summary.txt").read_text()
    suite = ET.parse(run.results / "junit.xml").getroot().find("testsuite")
    cases = {(c.get("classname"), c.get("name")): c for c in suite}
    assert cases[("fake.1x1", "smoke")].find("error").get("type") == "Cancelled"
    assert cases[("fake.1x1b", "smoke")].find("skipped") is not None
    assert json.loads((run.results / "1x1" / "result.json").read_text())["outcome"] == "cancelled"
    page = (run.results / "report.html").read_text()  # the page too, saying the same
    assert page.count('class="config-row"') == 2 and "CANCELLED" in page and "NOT RUN" in page


def _start(tmp_path, **kw) -> tuple[NoxRun, psutil.Process, list[psutil.Process]]:
    # decode never gets healthy: the first config is still starting when it is stopped
    run = NoxRun(
        tmp_path,
        env={"FAKE_DECODE_BEHAVIOR": "never_healthy", **kw.pop("env", {})},
        args=("--deadline", "60"),
        **kw,
    )
    harness, procs = run.started()
    return run, harness, procs


def gone_when_nox_exits(run: NoxRun, procs: list[psutil.Process]) -> list[psutil.Process]:
    """What of ``procs`` (nox's session family) is still alive, read the moment nox has exited."""
    return [p for p in procs if p.pid != run.proc.pid and alive(p)]


@pytest.mark.parametrize(
    "how,status,cause,said",
    [
        ("ctrl_c", 130, "stopped by SIGINT", "stopped by SIGINT: teardown done"),
        ("term_group", 143, "stopped by SIGTERM", "nox got SIGTERM (passed it on to pid"),
        # e.g. timeout(1): nox passes it on, so the harness hears it while nox waits for it
        ("term_nox", 143, "stopped by SIGTERM", "nox got SIGTERM (passed it on to pid"),
        ("hup_group", 129, "stopped by SIGHUP", "nox got SIGHUP (passed it on to pid"),
        ("kill_nox", -signal.SIGKILL, "stopped by SIGTERM: the parent process", "the parent process (pid"),
    ],
)
@pytest.mark.usefixtures("bystander")
def test_each_way_of_stopping_leaves_nothing_and_records_the_cancel(tmp_path, how, status, cause, said):
    """nox exits with the signal's status only once everything is gone and the results are
    written (SIGKILL aside: nox dies at once; the harness hears it and stops within grace + 2 s)."""
    run, harness, procs = _start(tmp_path)
    pgid = run.proc.pid
    t0 = time.monotonic()
    {
        "ctrl_c": lambda: os.killpg(pgid, signal.SIGINT),  # the terminal's Ctrl-C
        "term_group": lambda: os.killpg(pgid, signal.SIGTERM),  # e.g. a CI agent's cancel
        "term_nox": lambda: os.kill(pgid, signal.SIGTERM),  # e.g. timeout(1): nox alone
        "kill_nox": lambda: os.kill(pgid, signal.SIGKILL),
        "hup_group": lambda: os.killpg(pgid, signal.SIGHUP),  # the terminal closed
    }[how]()
    if how == "kill_nox":
        assert run.wait(10) == status
        took = run.all_gone_within(procs, t0, GRACE + 2)
    else:
        assert run.wait(GRACE + 15) == status, run.text
        took = time.monotonic() - t0
        assert gone_when_nox_exits(run, procs) == [], run.text
    assert_cancel_recorded(run, cause)  # read the moment nox exited (SIGKILL: once all is gone)
    run.reader.join(5)
    assert said in run.text and "teardown done" in run.text, run.text
    assert_nothing_left(run.results / "1x1")
    assert not alive(harness)
    print(f"{how}: nox exited {status}, everything gone {took:.2f} s after the stop")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
@pytest.mark.usefixtures("bystander")
def test_the_serve_session_waits_for_the_teardown_then_exits_with_the_signal(tmp_path, sig):
    """``nox -s serve``: the harness ends a stop with 0 (serve's normal end); nox still exits
    128 + N, once the cluster it held up is gone."""
    run = NoxRun(tmp_path, session="serve", args=("--only", "1x1"))
    _harness, procs = serving(run)
    os.killpg(run.proc.pid, sig)
    assert run.wait(GRACE + 15) == 128 + sig, run.text
    assert gone_when_nox_exits(run, procs) == [], run.text
    run.reader.join(5)
    assert f"stopped by {sig.name}: torn down, nothing left running" in run.text, run.text
    assert f"nox got {sig.name} (passed it on to pid" in run.text, run.text
    assert_nothing_left(run.results / "1x1")


def serving(run: NoxRun) -> tuple[psutil.Process, list[psutil.Process]]:
    """Once ``nox -s serve`` serves: its harness, and everything under nox: the harness, 2
    servers + their engine cores, the router, and the lifeline's reaper (run/lifeline.py)."""
    run.wait_for("serving until Ctrl-C")
    nox = psutil.Process(run.proc.pid)
    harness = next(c for c in nox.children() if "pd_sessions" in " ".join(c.cmdline()))
    procs = session_family(nox)
    reapers = [p for p in procs if "pd_sessions.runtime.reaper" in " ".join(p.cmdline())]
    assert len(reapers) == 1 and reapers[0].ppid() == harness.pid, procs  # serve's own lifeline
    assert len(procs) >= 7, procs
    return harness, procs


@pytest.mark.usefixtures("bystander")
def test_sigkill_to_the_parent_of_serve_leaves_nothing(tmp_path):
    """``nox -s serve`` with nox SIGKILLed once the cluster serves (a CI agent's kill, an OOM
    kill): the parent watch gives the harness SIGTERM, and it tears the cluster down; every PID of
    the run is gone within grace + 2 s. (Before serve had the lifeline, the harness and all four
    servers were still up 30 s later.)"""
    run = NoxRun(tmp_path, session="serve", args=("--only", "1x1"))
    harness, procs = serving(run)
    t0 = time.monotonic()
    os.kill(run.proc.pid, signal.SIGKILL)
    assert run.wait(10) == -signal.SIGKILL
    took = run.all_gone_within(procs, t0, GRACE + 2)
    run.reader.join(5)
    assert "stopped by SIGTERM: the parent process (pid" in run.text, run.text
    assert "torn down, nothing left running" in run.text, run.text
    assert_nothing_left(run.results / "1x1")
    assert not alive(harness)
    print(f"serve, nox SIGKILLed: everything gone {took:.2f} s after")


@pytest.mark.usefixtures("bystander")
def test_sigkill_to_serve_itself_leaves_nothing(tmp_path):
    """``pd-sessions serve`` itself SIGKILLed while it serves: it can do nothing, so its servers
    hear it from the kernel (their parent-death signal) and from serve's reaper, which stops
    whatever is left and verifies every PID gone; all gone within grace + 2 s."""
    run = NoxRun(tmp_path, session="serve", args=("--only", "1x1"))
    harness, procs = serving(run)
    t0 = time.monotonic()
    harness.kill()
    took = run.all_gone_within([p for p in procs if p.pid != run.proc.pid], t0, GRACE + 2)
    assert run.wait(GRACE + 15) != 0  # nox: its command was killed
    reaper_log = (run.results / "reaper.log").read_text()
    assert f"pd-sessions pid {harness.pid} is gone while" in reaper_log, reaper_log
    assert_nothing_left(run.results / "1x1")
    print(f"serve SIGKILLed: everything gone {took:.2f} s after")


@pytest.mark.usefixtures("bystander")
def test_buildkite_cancel_healthy_teardown_fits_well_inside_its_10s_grace(tmp_path):
    """The agent's cancel: SIGTERM to the group, SIGKILL to the group 10 s later. Everything,
    results included, is done long before the SIGKILL."""
    run, _harness, procs = _start(tmp_path, grace=10.0)
    t0 = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGTERM)
    took = run.all_gone_within(procs, t0, 10.0)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.proc.pid, signal.SIGKILL)  # the agent's SIGKILL: nothing alive is left for it
    within(took, 5.0, "the teardown, of Buildkite's 10 s grace")
    assert run.wait(10) == 143
    run.reader.join(5)
    assert_cancel_recorded(run, "stopped by SIGTERM")
    assert_nothing_left(run.results / "1x1")
    print(f"buildkite cancel (fake stack): everything gone and recorded {took:.2f} s after SIGTERM")


@pytest.mark.usefixtures("bystander")
def test_buildkite_sigkill_mid_teardown_the_reaper_finishes_it(tmp_path):
    """The agent's SIGKILL lands while a child ignores SIGTERM and the harness waits out its
    grace (here 1 s after the SIGTERM, grace 3 s): the harness dies at once; the reaper
    SIGKILLs the stubborn child when the harness's grace ends, so all is gone within grace + 2 s,
    and the summary written as the config started stands."""
    grace = 3.0
    run, harness, procs = _start(tmp_path, grace=grace, env={"FAKE_PREFILL_BEHAVIOR": "ignore_term"})
    t0 = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGTERM)
    time.sleep(1.0)
    assert alive(harness), "the harness must still be waiting out its grace"
    os.killpg(run.proc.pid, signal.SIGKILL)
    took = run.all_gone_within(procs, t0, grace + 2)
    assert took >= grace - 0.2, f"the stubborn child was killed before the grace ended ({took:.2f} s)"
    reaper_log = (run.results / "reaper.log").read_text()
    assert "is gone while 3 of its processes may still run" in reaper_log, reaper_log
    assert "needed SIGKILL: prefill-0" in reaper_log, reaper_log
    doc = run.summary()
    assert doc["provisional"] and [c["outcome"] for c in doc["configs"]] == ["cancelled", "not run"]
    assert "killed with SIGKILL?" in doc["configs"][0]["error"]
    assert ET.parse(run.results / "junit.xml").getroot().find("testsuite") is not None
    assert 'id="provisional"' in (run.results / "report.html").read_text()  # the page says so
    assert_nothing_left(run.results / "1x1")
    print(f"SIGKILL mid-teardown: the reaper had everything gone {took:.2f} s after SIGTERM")


@pytest.mark.usefixtures("bystander")
def test_a_check_that_crashes_fails_that_check_and_the_sweep_goes_on(tmp_path):
    run = NoxRun(tmp_path, env={"FAKE_DECODE_BEHAVIOR": "bad_usage"})
    assert run.wait(60) == 1, run.text
    run.reader.join(5)
    doc = run.summary()
    assert [c["outcome"] for c in doc["configs"]] == ["failed", "failed"], doc
    smoke = doc["configs"][0]["checks"][0]
    assert smoke["verdict"] == "fail" and smoke["message"].startswith("crashed: ValueError"), smoke
    log = (run.results / "1x1" / "checks.log").read_text()
    assert "Traceback (most recent call last)" in log and "ValueError" in log
    failure = ET.parse(run.results / "junit.xml").getroot().find("testsuite")[0].find("failure")
    assert "crashed: ValueError" in failure.get("message") and "Traceback" in failure.text
    assert_nothing_left(run.results / "1x1b")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pd_sessions", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=fake_stack_env(),
    )


def test_an_unwritable_results_dir_is_refused_before_anything_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "sweep.toml").write_text(TWO_CONFIGS)
    r = cli(
        "sweep", str(tmp_path / "sweep.toml"), "--platform", "cpu", "--results-dir", str(blocker / "results")
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--results-dir: cannot write to {blocker / 'results'}" in r.stderr
    assert "started" not in r.stdout


@pytest.mark.parametrize(
    "flag,value",
    [("--grace", "0"), ("--grace", "-1"), ("--deadline", "0"), ("--deadline", "-5"), ("--deadline", "nan")],
)
def test_deadline_and_grace_must_be_above_zero(tmp_path, flag, value):
    r = cli("sweep", "mooncake_sweep", "--dry-run", flag, value)
    assert r.returncode == 2
    assert f"argument {flag}: got {value}; give a number of seconds above 0" in r.stderr
