"""End to end on the CPU lane: the user's own tests against real P/D clusters (vLLM CPU build,
vllm-router, the generated tiny model). Three clusters in all: one sweep running two user
commands (one passing, one failing), one cluster started by the pd_cluster fixture, one serve.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import psutil
import pytest
from conftest import FIXTURES, ROOT, heavy
from test_e2e_cpu_lane import Cli, plan_ports, processes_using

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
USER = FIXTURES / "user_tests"


@pytest.fixture(scope="module", autouse=True)
def _full_env():
    heavy("vllm")
    heavy("mooncake.engine")
    heavy("openai")


def test_sweep_runs_a_passing_and_a_failing_user_command(tmp_path):
    """--pytest (an env-style file and a pd_cluster-fixture file, attached to the sweep's cluster)
    passes; --exec with {junitxml} running a failing test fails the config with its message."""
    failing = f"{sys.executable} -m pytest {USER / 'pd_fails_on_purpose.py'} --junitxml {{junitxml}}"
    cli = Cli(
        "sweep",
        "mooncake_sweep",
        "--only",
        "1x1",
        "--skip-check",
        "accuracy",
        "--results-dir",
        str(tmp_path),
        "--pytest",
        str(USER / "pd_parity_env.py"),
        str(USER / "pd_parity_fixture.py"),
        "--exec",
        failing,
    )
    assert cli.wait(timeout=1100) == 1, cli.text[-3000:]
    run_dir = tmp_path / "1x1"
    result = json.loads((run_dir / "result.json").read_text())
    checks = {c["name"]: c for c in result["checks"]}
    assert [checks[n]["verdict"] for n in ("smoke", "parity", "kv_transfer")] == ["pass"] * 3
    assert checks["exec[0]"]["verdict"] == "pass", checks["exec[0]"]["message"]
    assert checks["exec[0]"]["details"]["junit"]["tests"] == 4
    assert checks["exec[1]"]["verdict"] == "fail" and result["outcome"] == "failed"
    assert "deliberately failing external test: router said" in checks["exec[1]"]["message"]
    assert "exit status 1" in checks["exec[1]"]["message"]
    assert "exec[1] FAILED; last 30 lines" in cli.text  # its output tailed on failure
    assert (run_dir / "exec-0.log").exists() and (run_dir / "exec-1.log").exists()
    assert json.loads((run_dir / "cluster.json").read_text())["connector"] == "mooncake"

    cases = {
        (c.get("classname"), c.get("name")): c for c in ET.parse(tmp_path / "junit.xml").iter("testcase")
    }
    assert cases[("mooncake_sweep.1x1", "exec[0]")].find("failure") is None
    assert cases[("mooncake_sweep.1x1", "exec[1]")].find("failure") is not None
    merged = {name: c for (cls, name), c in cases.items() if cls.startswith("mooncake_sweep.1x1.exec[")}
    assert {
        "test_router_matches_prefill_direct",
        "test_cluster_file_matches_the_variables",
        "test_router_matches_prefill_direct_and_kv_moved",
        "test_urls_and_environment",
        "test_router_says_what_this_test_wrongly_expects",
    } == set(merged)
    failure = merged["test_router_says_what_this_test_wrongly_expects"].find("failure")
    assert "deliberately failing external test" in failure.get("message")
    assert all(merged[n].find("failure") is None for n in merged if "wrongly" not in n)
    assert processes_using(plan_ports(run_dir)) == []


def test_pd_cluster_fixture_starts_checks_and_tears_down(tmp_path):
    """The fixture starts its own cluster (here NIXL), the file's tests pass against it, and
    nothing is left afterwards."""
    heavy("nixl._api")
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

    cli = Cli("serve", "mooncake_sweep", "--only", "1x1", "--results-dir", str(tmp_path))
    end = time.monotonic() + 900
    while not any(line.startswith("serving until Ctrl-C") for _, line in cli.lines):
        assert time.monotonic() < end and cli.proc.poll() is None, cli.text[-3000:]
        time.sleep(0.2)
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
