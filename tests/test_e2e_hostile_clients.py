"""Client-made kv_transfer_params on real vLLM (CPU lane), asserted on the shared runs of conftest: the
Mooncake and NIXL sweeps run hostile_clients last, after the fault scenarios and kv_digest. Every case
is sent at every entry point (or recorded NOT RUN with its reason); through vllm-router every forged
request gets its own right answer (the router replaces the client's parameters); what breaks straight
at an instance is a known upstream bug (configs/known_issues.toml), so the check reads XFAIL while it
is broken and fails the day it changes. The verdict's can-fail tests are tests/test_hostile_clients.py.
"""

from __future__ import annotations

import pytest
from helpers import ci_summary
from helpers.e2e_runs import SweepRun
from helpers.needs import needs

from pd_sessions.checks import hostile_clients as hc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module", autouse=True)
def _full_env():
    needs("vllm")
    needs("mooncake.engine")
    needs("nixl._api")


@pytest.fixture(params=["mooncake_sweep", "nixl_sweep"])
def sweep(request) -> str:
    return request.param


@pytest.fixture
def run(request, sweep: str) -> SweepRun:
    return request.getfixturevalue(sweep)


def test_every_case_is_sent_at_every_entry_point_or_says_why_not(run: SweepRun):
    c = run.checks["hostile_clients"]
    table = c["details"]["table"]
    want = [(k, e) for e in ("router", "decode") for k in hc.DECODE_CASES] + [
        (k, "prefill") for k in hc.PREFILL_CASES
    ]
    assert [(r["case"], r["entry"]) for r in table] == want
    for r in table:
        assert r["verdict"] in ("pass", "fail", "not run")
        assert r["verdict"] != "not run" or r["problem"], r  # a case not sent says why
    sent = [r for r in table if r["verdict"] != "not run"]
    assert len(sent) >= 12, table


def test_the_router_replaces_the_clients_params(run: SweepRun):
    """vllm-router builds both hops' kv_transfer_params itself: every forged request through it is
    answered right (or refused with a 4xx), and its victims stay right."""
    d = run.checks["hostile_clients"]["details"]
    assert d["router_params"] == "replaced", d["table"]
    router = [r for r in d["table"] if r["entry"] == "router" and r["verdict"] != "not run"]
    assert router and all(r["verdict"] == "pass" for r in router), router


def test_it_passes_or_fails_only_the_way_a_known_issue_says(run: SweepRun, sweep: str, request):
    c = run.checks["hostile_clients"]
    known = c["details"].get("known_issue")
    if known:
        ci_summary.add(
            request.config, f"{sweep} hostile_clients {c['verdict'].upper()}: {known['id']} {known['link']}"
        )
    assert c["verdict"] in ("pass", "xfail"), c["message"]
    print(
        f"{sweep} hostile_clients {c['verdict']} in {c['seconds']:.1f} s; "
        f"failures {c['details']['failures']}; idle after {c['details']['idle_s']} s"
    )


def test_no_process_died(run: SweepRun):
    """Whatever the known issues say, no case the check sends kills an instance (those that do are
    not sent to a shared cluster: the connector's client_params.not_sent, each a known issue)."""
    d = run.checks["hostile_clients"]["details"]
    assert set(d["health_after"].values()) == {"ok"}, d["health_after"]
