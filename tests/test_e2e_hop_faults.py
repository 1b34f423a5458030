"""pd_calls, kv_capacity and fault_hop_retry on real vLLM (CPU lane), asserted on the shared runs
of conftest (docs/hop-faults.md): on the Mooncake and NIXL sweeps one call per hop and the same KV
capacity on both instances pass, and a retrying fault proxy at the router -> decode hop makes
pd_calls fail naming every extra decode call; on the faulty sweep a decode with its KV blocks
capped fails kv_capacity, naming it and the numbers. The verdicts' can-fail tests are
tests/test_hop_faults.py."""

from __future__ import annotations

import pytest
from helpers.e2e_runs import SweepRun
from helpers.needs import needs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]


@pytest.fixture(params=["mooncake_sweep", "nixl_sweep"])
def run(request) -> SweepRun:
    needs("vllm")
    return request.getfixturevalue(request.param)


def test_one_prefill_and_one_decode_call_per_request_pass(run: SweepRun):
    c = run.checks["pd_calls"]
    assert c["verdict"] == "pass", c["message"]
    rows = c["details"]["requests"]
    assert len(rows) == 3 and all((r["prefill"], r["decode"]) == (1, 1) for r in rows), rows


def test_every_instance_holds_the_references_kv_capacity(run: SweepRun):
    c = run.checks["kv_capacity"]
    assert c["verdict"] == "pass", c["message"]
    rows = c["details"]["instances"]
    assert rows["decode-0"]["ratio"] == 1.0 and rows["prefill-0"]["tokens"] > 0, rows


def test_a_retry_at_the_decode_hop_is_caught_by_pd_calls(run: SweepRun):
    """Every request's decode call was retried by the fault proxy (its log proves each), the
    client got its answer, and pd_calls failed naming the extra decode call of every request;
    the proxy and the second router are gone, with nothing left on their ports."""
    c = run.checks["fault_hop_retry"]
    assert c["verdict"] == "pass", c["message"]
    d = c["details"]
    assert d["detected"] == "3/3" and d["retried_calls"] == 3, d
    assert d["pd_calls"]["verdict"] == "fail"
    for i in (1, 2, 3):
        assert f"request {i} made 2 decode call(s) (decode-0: 2)" in d["pd_calls"]["message"]
    assert all(r["prefill"] == 1 for r in d["requests"]), d["requests"]
    assert d["stopped"] == ["hop_fault-decode-0", "hop_fault-router"]
    print("fault_hop_retry:", c["message"], f"({c['seconds']:.1f} s)")
    print("masked (client HTTP 200):", d["masked"], "proxy:", d["proxy_lines"])


def test_a_decode_with_less_kv_fails_kv_capacity_naming_it(faulty_sweep: SweepRun, mooncake_sweep: SweepRun):
    """The faulty sweep's decode has its KV blocks capped at 64 (of 4096 the CPU lane's 1 GiB
    holds): kv_capacity fails naming decode-0 and both numbers. Every instance there also runs
    with --disable-hybrid-kv-cache-manager, vllm#42024's trigger: on this non-hybrid model its
    prefill holds as much KV as the Mooncake sweep's, which runs without it."""
    c = faulty_sweep.checks["kv_capacity"]
    assert c["verdict"] == "fail", c["message"]
    rows = c["details"]["instances"]
    assert rows["decode-0"]["tokens"] == 64 * 128, rows
    assert f"decode-0 holds {64 * 128} tokens of KV" in c["message"]
    assert f"against prefill-0's {rows['prefill-0']['tokens']:.0f}" in c["message"]
    assert "blocks capped" in c["message"]
    plain = mooncake_sweep.checks["kv_capacity"]["details"]["instances"]["prefill-0"]
    assert rows["prefill-0"]["tokens"] == plain["tokens"], (rows, plain)
    print("kv_capacity (faulty):", c["message"])
