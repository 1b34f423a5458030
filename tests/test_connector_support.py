from __future__ import annotations

import sys

import pytest

from pd_sessions import connector_support
from pd_sessions.config import ClusterConfig
from pd_sessions.errors import PlanError
from pd_sessions.hosts import Inventory
from pd_sessions.plan import plan_cluster
from pd_sessions.ports import PortAllocator


def cfg(**kw) -> ClusterConfig:
    return ClusterConfig(**{"name": "c", "model": "m", **kw})


@pytest.mark.parametrize("connector", ["mooncake", "nixl"])
@pytest.mark.parametrize("p,d", [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 8)])
def test_dividing_tp_sizes_and_xpyd_are_accepted(connector, p, d):
    connector_support.check(cfg(connector=connector, prefill_tp=p, decode_tp=d))
    connector_support.check(cfg(connector=connector, num_prefill=2, num_decode=3))


@pytest.mark.parametrize("connector", ["mooncake", "nixl"])
def test_tp_sizes_that_do_not_divide_are_refused_naming_connector_and_pair(connector):
    with pytest.raises(PlanError) as e:
        connector_support.check(cfg(name="odd", connector=connector, prefill_tp=2, decode_tp=3))
    msg = str(e.value)
    assert f"odd: connector {connector} cannot map prefill TP2 + decode TP3" in msg
    assert "one TP size must divide the other" in msg and e.value.field == "decode_tp"


def test_a_connector_without_heterogeneous_tp_is_refused(monkeypatch):
    monkeypatch.setitem(connector_support.SUPPORT, "nixl", (False, True))
    with pytest.raises(
        PlanError,
        match="connector nixl does not support heterogeneous TP "
        r"\(prefill TP1 \+ decode TP2\)",
    ):
        connector_support.check(cfg(connector="nixl", prefill_tp=1, decode_tp=2))
    monkeypatch.setitem(connector_support.SUPPORT, "nixl", (True, False))
    with pytest.raises(PlanError, match=r"several instances per role \(2P1D\)"):
        connector_support.check(cfg(connector="nixl", num_prefill=2))


def test_the_planner_refuses_before_taking_any_port():
    class NoPorts:
        def take(self, label):
            raise AssertionError("a port was taken")

        take_block = claim = take

    with pytest.raises(PlanError, match="cannot map prefill TP3 \\+ decode TP2"):
        plan_cluster(
            cfg(prefill_tp=3, decode_tp=2),
            Inventory(gpus=(), cpus=(0, 1), gpu_source="t"),
            NoPorts(),
            platform="cpu",
            python=sys.executable,
        )


def test_xpyd_plan_gives_every_prefill_its_bootstrap_port_in_the_router_argv():
    with PortAllocator() as ports:
        plan = plan_cluster(
            cfg(num_prefill=2, num_decode=2),
            Inventory(gpus=(), cpus=(0, 1), gpu_source="t"),
            ports,
            platform="cpu",
            python=sys.executable,
        )
    argv = list(plan.router.argv)
    for p in plan.prefill:
        i = argv.index(p.url)
        assert argv[i - 1] == "--prefill" and argv[i + 1] == str(p.bootstrap_port)
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--decode"] == [d.url for d in plan.decode]
