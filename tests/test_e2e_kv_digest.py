"""The KV digest on real vLLM (CPU lane), asserted on the shared runs of conftest: the Mooncake
and NIXL sweeps run every default check, their fault scenarios (zero and swap among them: 32
loads each) and kv_digest last, the connectors wrapped with the observer. The digest must pair
every load with its send, find every block equal where no fault was injected, and catch every
zeroed and swapped load (issue 41: 32/32 and 32/32 on both connectors), whatever parity's
margin let through. The verdict's can-fail tests are tests/test_kv_digest.py.
"""

from __future__ import annotations

import pytest
from helpers.e2e_runs import SweepRun
from helpers.needs import needs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module", autouse=True)
def _full_env():
    needs("vllm")
    needs("mooncake.engine")
    needs("nixl._api")


@pytest.fixture(params=["mooncake_sweep", "nixl_sweep"])
def run(request) -> SweepRun:
    return request.getfixturevalue(request.param)


def test_the_digest_catches_every_zeroed_and_swapped_load_and_nothing_else(run: SweepRun):
    c = run.checks["kv_digest"]
    d = c["details"]
    assert c["verdict"] == "pass", c["message"]
    # every load the injector corrupted (the burst's 32 each; a probe the fault caught too counts)
    for mode in ("zero", "swap"):
        caught, of = map(int, d["detection"][mode].split("/"))
        assert caught == of >= 32, d["detection"]
    assert d["injected"] == d["injected_caught"] == d["requests_differ"] >= 64
    assert d["loads"] == d["paired"] > d["injected"] and not d["unpaired"]
    assert d["blocks_compared"] >= d["paired"] and d["observer_s"] > 0
    parity = {m: run.checks[f"fault_{m}"]["details"]["detected"] for m in ("zero", "swap")}
    print(
        f"kv_digest: {d['detection']} vs parity's burst {parity}/32; "
        f"observer {d['observer_s']} s; {c['message'][:160]}"
    )
