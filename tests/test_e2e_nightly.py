"""End to end on the CPU lane for the nightly's checks: margin-mode parity can fail (a decode with
other weights) and passes on a healthy pair; a remote-code model runs through vLLM and lm_eval
with trust_remote_code; the KV proof's success evidence comes from real NIXL metrics.
"""

from __future__ import annotations

import json

import pytest
from conftest import heavy
from test_e2e_cpu_lane import Cli, plan_ports, processes_using

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

# Margin mode is forced: on the CPU lane prefill and decode share one layout (auto would pick
# exact), and the point here is that margin mode fails a decode with other weights.
OTHER_WEIGHTS = """
name = "other_weights"
checks = ["smoke", "parity", "kv_transfer", "accuracy"]
[defaults]
model = "tiny-llama"
connector = "mooncake"
parity_mode = "margin"
decode_weights_seed = 1
[[config]]
name = "1x1"
"""

REMOTE_CODE = """
name = "remote_code"
# the edge checks are covered by the sweep e2e tests: here only what this test proves
checks = ["smoke", "parity", "kv_transfer", "accuracy"]
[defaults]
model = "tiny-llama-remote"
trust_remote_code = true
connector = "nixl"
parity_mode = "margin"
[[config]]
name = "1x1"
"""


@pytest.fixture(scope="module", autouse=True)
def _full_env():
    heavy("vllm")
    heavy("mooncake.engine")
    heavy("nixl._api")


def run(tmp_path, text, *extra):
    toml = tmp_path / "sweep.toml"
    toml.write_text(text)
    cli = Cli("sweep", str(toml), "--platform", "cpu", "--results-dir", str(tmp_path / "r"), *extra)
    rc = cli.wait(timeout=1400)
    result = json.loads((tmp_path / "r" / "1x1" / "result.json").read_text())
    assert processes_using(plan_ports(tmp_path / "r" / "1x1")) == []
    return rc, {c["name"]: c for c in result["checks"]}, cli


def test_decode_with_other_weights_fails_margin_parity(tmp_path):
    rc, checks, cli = run(tmp_path, OTHER_WEIGHTS, "--skip-check", "accuracy")
    assert rc == 1, cli.text[-3000:]
    p = checks["parity"]
    assert p["verdict"] == "fail", p["message"]
    assert p["details"]["mode"] == "margin" and "parity_mode = 'margin'" in p["details"]["mode_reason"]
    assert "beyond the margin" in p["message"] and "vs reference top-1" in p["message"]
    assert p["details"]["max_gap"] > p["details"]["margin"]
    assert checks["smoke"]["verdict"] == "pass"


def test_remote_code_model_passes_every_check_with_margin_parity_and_nixl_evidence(tmp_path):
    rc, checks, cli = run(tmp_path, REMOTE_CODE)
    assert rc == 0, cli.text[-3000:]
    assert [checks[n]["verdict"] for n in ("smoke", "parity", "kv_transfer", "accuracy")] == ["pass"] * 4
    p = checks["parity"]["details"]
    assert p["mode"] == "margin" and p["tokens"] == 64 and p["max_gap"] <= p["margin"]
    kv = checks["kv_transfer"]["details"]["success"]
    assert kv["connector"] == "nixl" and kv["log_failures"] == {}
    assert (
        kv["nixl_delta"]["vllm:nixl_xfer_time_seconds_count"]
        >= checks["kv_transfer"]["details"]["router_requests"]
    )
    assert kv["nixl_delta"]["vllm:nixl_bytes_transferred_sum"] > 0
    # lm_eval loaded the model's own tokenizer class: only possible with trust_remote_code=True
    assert checks["accuracy"]["details"]["samples"] == 24
    plan = (tmp_path / "r" / "1x1" / "plan.txt").read_text()
    assert "--trust-remote-code" in plan and "generated locally" in plan
