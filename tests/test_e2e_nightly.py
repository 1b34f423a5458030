"""End to end on the CPU lane for the nightly's checks: margin-mode parity can fail (a decode with
other weights) and passes on a healthy pair; a remote-code model runs through vLLM and lm_eval
with trust_remote_code; the KV proof's success evidence comes from real NIXL metrics.
"""

from __future__ import annotations

import pytest
from helpers.cli_runs import plan_ports
from helpers.e2e_runs import SweepRun
from helpers.needs import needs
from helpers.procs import processes_using

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module", autouse=True)
def _full_env():
    needs("vllm")
    needs("mooncake.engine")
    needs("nixl._api")


def test_decode_with_other_weights_fails_margin_parity(faulty_sweep: SweepRun):
    """conftest.FAULTY_SWEEP: margin mode forced (auto would pick exact on the CPU lane), the
    decode serves other weights (seed 1); one cluster shared with the other must-fail tests."""
    assert faulty_sweep.rc == 1, faulty_sweep.text[-3000:]
    checks = faulty_sweep.checks
    p = checks["parity"]
    assert p["verdict"] == "fail", p["message"]
    assert p["details"]["mode"] == "margin" and "parity_mode = 'margin'" in p["details"]["mode_reason"]
    assert "beyond the margin" in p["message"] and "vs reference top-1" in p["message"]
    assert p["details"]["max_gap"] > p["details"]["margin"]
    assert checks["smoke"]["verdict"] == "pass"
    assert processes_using(plan_ports(faulty_sweep.run_dir)) == []


def test_remote_code_model_passes_every_check_with_margin_parity_and_nixl_evidence(nixl_sweep: SweepRun):
    """conftest.nixl_sweep: the built-in NIXL sweep serving tiny-llama-remote with
    trust_remote_code and margin parity; shared with test_e2e_cpu_lane's NIXL sweep test (which
    also asserts the edge checks)."""
    rc, checks, cli = nixl_sweep.rc, nixl_sweep.checks, nixl_sweep.cli
    assert rc == 0, cli.text[-3000:]
    assert [checks[n]["verdict"] for n in ("smoke", "parity", "kv_transfer", "accuracy")] == ["pass"] * 4
    p = checks["parity"]["details"]
    assert p["mode"] == "margin" and "parity_mode = 'margin'" in p["mode_reason"]
    assert p["tokens"] == 64 and p["max_gap"] <= p["margin"]
    kv = checks["kv_transfer"]["details"]["success"]
    assert kv["connector"] == "nixl" and kv["log_failures"] == {}
    assert (
        kv["metrics_delta"]["vllm:nixl_xfer_time_seconds_count"]
        >= checks["kv_transfer"]["details"]["router_requests"]
    )
    assert kv["metrics_delta"]["vllm:nixl_bytes_transferred_sum"] > 0 and kv["metrics_on"] == "decode"
    # lm_eval loaded the model's own tokenizer class: only possible with trust_remote_code=True
    assert checks["accuracy"]["details"]["samples"] == 24
    plan = (nixl_sweep.run_dir / "plan.txt").read_text()
    assert "--trust-remote-code" in plan and "generated locally" in plan
    assert "served as tiny-llama-remote" in plan
    assert processes_using(plan_ports(nixl_sweep.run_dir)) == []
