"""The soak on real vLLM (CPU lane), asserted on the shared NIXL run of conftest (nixl_sweep): after
its default checks and its fault scenarios, SOAK_CYCLES cycles (3) of the prefill and the decode restarted in
place (checks/soak.py), parity and the KV digest after each restart, the growth per cycle of each
process's fds, threads, RSS and KV blocks bounded (the NIXL decode's sockets per prefill restart
read XFAIL through their known issue); then kv_digest over every request, the soak's included.
The verdict's can-fail tests are tests/test_soak.py."""

from __future__ import annotations

import pytest
from helpers import ci_summary
from helpers.e2e_runs import SOAK_CYCLES, SweepRun
from helpers.needs import needs

from pd_sessions.checks.soak import RESOURCES

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module", autouse=True)
def _full_env():
    needs("vllm")
    needs("nixl._api")


def test_the_restart_cycles_over_nixl_read_xfail_for_the_decodes_sockets_and_nothing_else(
    nixl_sweep: SweepRun, request
):
    """Every restart came back correct, parity and the digest passed after each, every figure was
    read; the one thing beyond its bound is the decode's fds (3-4 sockets per prefill restart: the
    known issue nixl-remove-remote-agent-keeps-endpoints), so the soak reads XFAIL and the run
    passes. Once NIXL closes them, this reads XPASS and fails, asking for the entry's retirement."""
    c = nixl_sweep.checks["soak"]
    d = c["details"]
    said = f"nixl_sweep soak {c['verdict'].upper()}: {c['message']}"
    ci_summary.add(request.config, said)
    assert c["verdict"] == "xfail", c["message"]
    assert d["known_issue"]["id"] == "nixl-remove-remote-agent-keeps-endpoints", d["known_issue"]
    assert d["broken_steps"] == [] and d["over_resources"] == ["fds"] and d["over_roles"] == ["decode"]
    assert d["mean_growth"]["decode-0"]["fds"] > d["bounds_per_cycle"]["fds"]
    for name in ("prefill-0", "router"):
        assert all(d["mean_growth"][name][r] <= d["bounds_per_cycle"][r] for r in d["mean_growth"][name])
    assert d["planned_cycles"] == SOAK_CYCLES == len(d["cycles"])
    for cycle in d["cycles"]:
        steps = cycle["steps"]
        assert [s["restarted"] for s in steps] == ["prefill-0", "decode-0"]
        assert all(s["parity"] == s["kv_digest"] == "pass" and s["pd_back_s"] >= s["ready_s"] for s in steps)
        # each process's growth while it stayed the same: the decode across the prefill's
        # restart, the prefill across the decode's, the router across both; every figure read
        assert sorted(cycle["growth"]) == ["decode-0", "prefill-0", "router"]
        assert set(cycle["growth"]["decode-0"]) == set(RESOURCES)
        assert cycle["unreadable"] == []
        # a restart is a new process on the same port: the PIDs changed, the ports did not
        first, after_prefill, after_decode = cycle["reads"]
        assert after_prefill["prefill-0"]["pid"] != first["prefill-0"]["pid"]
        assert after_decode["decode-0"]["pid"] != after_prefill["decode-0"]["pid"]
        assert after_decode["router"]["pid"] == first["router"]["pid"]
    assert set(d["mean_growth"]) == {"decode-0", "prefill-0", "router"}
    # the digest after the soak compared the soak's requests too, and passed
    assert nixl_sweep.checks["kv_digest"]["verdict"] == "pass"
    assert nixl_sweep.rc == 0, nixl_sweep.text[-3000:]
