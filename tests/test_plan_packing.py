"""Which configs run side by side (core.plan.packing): waves packed by GPUs or cores, never a GPU
shared between configs, one at a time where they do not fit."""

from __future__ import annotations

import pytest
from helpers.builders import CPU2, FakePorts, cfg

from pd_sessions.core.config import ClusterConfig, load, select
from pd_sessions.core.errors import UsageError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan import plan_cluster
from pd_sessions.core.plan.packing import pack

GPUS8 = Inventory(gpus=tuple("01234567"), cpus=tuple(range(32)), gpu_source="nvidia-smi")
CPU8 = Inventory(gpus=(), cpus=tuple(range(8)))


def gpu_defaults() -> list[ClusterConfig]:
    """The GPU sweep's default configs (mooncake_sweep on cuda): 2, 4, 3, 3, 3 and 3 GPUs."""
    sweep = load("mooncake_sweep")
    return [e.config for e in select(sweep.entries("cuda"), "cuda")[0]]


def waves(packing) -> list[list[str]]:
    return [[p.name for p in w] for w in packing.waves]


def test_the_gpu_sweeps_defaults_fit_an_8_gpu_host_in_three_waves_on_disjoint_gpus():
    configs = gpu_defaults()
    p = pack(configs, GPUS8, platform="cuda")
    assert waves(p) == [["1x1", "2x2"], ["1x2", "2x1"], ["2p1d", "1p2d"]]
    for wave in p.waves:
        held = [g for placed in wave for g in placed.inventory.gpus]
        assert len(held) == len(set(held))  # no GPU shared inside a wave
        assert all(len(placed.inventory.gpus) == placed.need for placed in wave)
    assert p.parallel and p.auto
    text = p.render()
    assert "3 wave(s), as many as fit at once" in text
    assert "wave 1: 1x1 (2 GPUs: 0,1), 2x2 (4 GPUs: 2,3,4,5)" in text
    # each config's plan, on its share, uses only its own GPUs
    for placed in p.order:
        plan = plan_cluster(
            configs[placed.index], placed.inventory, FakePorts(), platform="cuda", python="py"
        )
        env = [s.env_dict() for s in plan.processes if s.role != "router"]
        used = {g for e in env for g in e["CUDA_VISIBLE_DEVICES"].split(",")}
        assert used <= set(placed.inventory.gpus), (placed.name, used)


def test_max_parallel_1_is_one_config_per_wave_on_the_whole_host():
    configs = gpu_defaults()
    p = pack(configs, GPUS8, platform="cuda", max_parallel=1)
    assert waves(p) == [[c.name] for c in configs]
    assert all(placed.inventory == GPUS8 for placed in p.order)
    assert not p.parallel and "at most 1 at once (--max-parallel 1)" in p.render()


def test_max_parallel_caps_each_wave():
    configs = [cfg(f"c{i}") for i in range(4)]  # 2 GPUs each: all four would fit
    assert waves(pack(configs, GPUS8, platform="cuda")) == [["c0", "c1", "c2", "c3"]]
    assert waves(pack(configs, GPUS8, platform="cuda", max_parallel=3)) == [["c0", "c1", "c2"], ["c3"]]


def test_first_fit_keeps_the_sweeps_order_where_a_later_wave_has_room():
    configs = [cfg("big", prefill_tp=2, decode_tp=4), cfg("small"), cfg("mid", prefill_tp=2, decode_tp=2)]
    # big takes 6 of 8; small (2) joins it; mid (4) opens wave 2
    assert waves(pack(configs, GPUS8, platform="cuda")) == [["big", "small"], ["mid"]]


@pytest.mark.parametrize(
    "config,why",
    [
        (cfg("huge", num_prefill=4, num_decode=4, prefill_tp=2), "needs 12 of 8 GPUs"),
        (cfg("fixed", router_port=18000), "explicit ports"),
    ],
)
def test_a_config_that_cannot_share_the_host_runs_alone_on_all_of_it(config, why):
    p = pack([cfg("a"), config, cfg("b")], GPUS8, platform="cuda")
    assert waves(p) == [["a", "b"], [config.name]], why
    assert p.waves[1][0].inventory == GPUS8  # the planner then shares (--share-gpus) or refuses it


def test_the_cpu_lane_on_2_cores_stays_serial():
    """One core per rank: a 1x1 takes both of CI's cores, so CI's e2e configs never contend."""
    p = pack([cfg("1x1"), cfg("1x1b")], CPU2, platform="cpu")
    assert waves(p) == [["1x1"], ["1x1b"]]
    assert not p.parallel and all(placed.inventory == CPU2 for placed in p.order)


def test_cpu_configs_pack_on_disjoint_cores():
    p = pack([cfg("a"), cfg("b", decode_tp=2), cfg("c", num_prefill=2, num_decode=2)], CPU8, platform="cpu")
    assert waves(p) == [["a", "b"], ["c"]]
    a, b = p.waves[0]
    assert (a.inventory.cpus, b.inventory.cpus) == ((0, 1), (2, 3, 4))
    assert p.waves[1][0].inventory == CPU8  # alone: the whole host, as a serial sweep gives it
    assert a.holds("cpu").isdisjoint(b.holds("cpu"))


def test_across_hosts_runs_one_at_a_time_and_refuses_more():
    p = pack([cfg("a"), cfg("b")], GPUS8, platform="cuda", across_hosts=True)
    assert waves(p) == [["a"], ["b"]] and "(across hosts)" in p.render()
    with pytest.raises(UsageError, match=r"--max-parallel 2: across hosts .* leave it out or give 1"):
        pack([cfg("a")], GPUS8, platform="cuda", across_hosts=True, max_parallel=2)


def test_max_parallel_below_1_is_refused():
    with pytest.raises(UsageError, match="--max-parallel: got 0"):
        pack([cfg("a")], GPUS8, platform="cuda", max_parallel=0)
