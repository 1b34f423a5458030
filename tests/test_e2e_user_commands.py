"""End to end on the CPU lane: the user's own tests against real P/D clusters (vLLM CPU build,
vllm-router, the generated tiny model). Two clusters of their own: one started by the pd_cluster
fixture, one serve; the user commands run in sweeps shared with other e2e tests (conftest.py):
the passing ones in the healthy Mooncake sweep, the failing one in the fault-injection sweep.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET

import psutil
import pytest
from helpers import ROOT, USER
from helpers.cli_runs import Cli, plan_ports
from helpers.e2e_runs import SweepRun
from helpers.needs import needs
from helpers.procs import processes_using
from helpers.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module", autouse=True)
def _full_env():
    needs("vllm")
    needs("mooncake.engine")
    needs("openai")


def _junit_cases(run: SweepRun, classname: str) -> tuple[dict, dict]:
    """(our JUnit's cases of the config, the user's cases merged into it)."""
    cases = {
        (c.get("classname"), c.get("name")): c for c in ET.parse(run.results / "junit.xml").iter("testcase")
    }
    merged = {name: c for (cls, name), c in cases.items() if cls.startswith(f"{classname}.exec[")}
    return cases, merged


def test_sweep_runs_passing_user_commands_against_its_cluster(mooncake_sweep: SweepRun):
    """--pytest (an env-style file and a pd_cluster-fixture file, attached to the sweep's
    cluster) passes, its four tests merged into our JUnit. The run (through `nox --no-venv`) is
    shared with test_e2e_cpu_lane's Mooncake sweep test."""
    run = mooncake_sweep
    assert run.rc == 0, run.text[-3000:]
    checks = run.checks
    assert [checks[n]["verdict"] for n in ("smoke", "parity", "kv_transfer")] == ["pass"] * 3
    assert checks["exec[0]"]["verdict"] == "pass", checks["exec[0]"]["message"]
    assert checks["exec[0]"]["details"]["junit"]["tests"] == 4
    assert "exec[1]" not in checks
    assert (run.run_dir / "exec-0.log").exists()
    assert json.loads((run.run_dir / "cluster.json").read_text())["connector"] == "mooncake"
    cases, merged = _junit_cases(run, "mooncake_sweep.1x1")
    assert cases[("mooncake_sweep.1x1", "exec[0]")].find("failure") is None
    assert {
        "test_router_matches_prefill_direct",
        "test_cluster_file_matches_the_variables",
        "test_router_matches_prefill_direct_and_kv_moved",
        "test_urls_and_environment",
    } == set(merged)
    assert all(c.find("failure") is None for c in merged.values())
    assert processes_using(plan_ports(run.run_dir)) == []


def test_sweep_runs_a_failing_user_command(faulty_sweep: SweepRun):
    """--exec with {junitxml} running a failing test fails its check with the test's message,
    its output tailed and its failure merged into our JUnit. (The fake-stack tests in
    test_user_commands.py prove a failing command alone fails a sweep whose checks pass.)"""
    run = faulty_sweep
    assert run.rc == 1, run.text[-3000:]
    result = run.result
    checks = run.checks
    assert checks["exec[0]"]["verdict"] == "fail" and result["outcome"] == "failed"
    assert "deliberately failing external test: router said" in checks["exec[0]"]["message"]
    assert "exit status 1" in checks["exec[0]"]["message"]
    assert "exec[0] FAILED; last 30 lines" in run.text  # its output tailed on failure
    assert (run.run_dir / "exec-0.log").exists()
    assert json.loads((run.run_dir / "cluster.json").read_text())["connector"] == "mooncake"
    cases, merged = _junit_cases(run, "faulty.1x1")
    assert cases[("faulty.1x1", "exec[0]")].find("failure") is not None
    assert set(merged) == {"test_router_says_what_this_test_wrongly_expects"}
    failure = merged["test_router_says_what_this_test_wrongly_expects"].find("failure")
    assert "deliberately failing external test" in failure.get("message")
    assert processes_using(plan_ports(run.run_dir)) == []


def test_pd_cluster_fixture_starts_checks_and_tears_down(tmp_path):
    """The fixture starts its own cluster (here NIXL), the file's tests pass against it, and
    nothing is left afterwards."""
    needs("nixl._api")
    env = {k: v for k, v in os.environ.items() if k != "PD_SESSIONS_CLUSTER"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "pd_sessions.pytest_plugin",
            "-v",
            str(USER / "pd_parity_fixture.py"),
            "--pd-cluster",
            "nixl_sweep:1x1",
            "--pd-platform",
            "cpu",
            "--pd-results-dir",
            str(tmp_path),
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1100,
    )
    print(r.stdout[-5000:], r.stderr[-2000:])
    assert r.returncode == 0, r.stdout[-3000:]
    assert "2 passed" in r.stdout and "[pd_cluster] 1x1: cluster ready" in r.stdout
    run_dir = tmp_path / "nixl_sweep" / "1x1"
    assert (run_dir / "decode-0.log").exists() and "NixlConnector" in (run_dir / "plan.txt").read_text()
    assert processes_using(plan_ports(run_dir)) == []


def test_serve_prints_env_serves_requests_and_stops_on_sigterm(tmp_path):
    import openai

    cli = Cli("serve", "mooncake_sweep", "--only", "1x1", "--platform", "cpu", "--results-dir", str(tmp_path))
    wait_until(
        lambda: any(line.startswith("serving until Ctrl-C") for _, line in cli.lines),
        900,
        lambda: f"'serving until Ctrl-C':\n{cli.text[-3000:]}",
        proc=cli.proc,
        tick=0.2,
    )
    env = dict(re.findall(r"^export (\w+)=(\S+)$", cli.text, re.M))
    assert {"PREFILL_PORT", "DECODE_PORT", "PROXY_PORT", "TEST_MODEL", "PD_SESSIONS_CLUSTER"} <= set(env)

    def client(port: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://{env['PROXY_HOST']}:{port}/v1",
            api_key="EMPTY",
            max_retries=0,
            http_client=openai.DefaultHttpxClient(trust_env=False),
        )

    prompt = "Started by pd-sessions serve, answered through the router:"
    pd, direct = (
        client(env[p]).completions.create(
            model=env["TEST_MODEL"], prompt=prompt, max_tokens=16, temperature=0
        )
        for p in ("PROXY_PORT", "PREFILL_PORT")
    )
    assert pd.usage.completion_tokens == 16 and pd.choices[0].text == direct.choices[0].text
    assert "curl -s http://127.0.0.1:" + env["PROXY_PORT"] + "/v1/completions" in cli.text

    ports = plan_ports(tmp_path / "1x1")
    family = []
    for name in ("prefill-0", "decode-0"):
        leader = next(
            p
            for p in psutil.process_iter(["cmdline"])
            if str(ports[name]) in (argv := p.info["cmdline"] or []) and "--port" in argv
        )
        family += [leader, *leader.children(recursive=True)]
    cli.proc.send_signal(signal.SIGTERM)
    assert cli.wait(timeout=120) == 0, cli.text[-3000:]
    assert "stopped by SIGTERM: torn down" in cli.text
    assert [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert processes_using(ports) == []
