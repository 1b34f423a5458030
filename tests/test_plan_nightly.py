"""Planner rules for the nightly's shape: flags that cannot take effect, hybrid block sizes,
the GPU host's environment, parity's other-weights decode."""

from __future__ import annotations

import json

import pytest
from helpers.builders import arg, cfg, plan

from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import PlanError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan import GPU_PASSTHROUGH_ENV, flag_warnings, gpu_env, hybrid_block_size

GPUS2 = Inventory(gpus=("0", "1"), cpus=tuple(range(8)), gpu_source="nvidia-smi")
HOST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def kimi(**kw):
    return ClusterConfig(
        **{
            "name": "k",
            "model": "tiny-kimi-linear",
            "connector": "nixl",
            "moe": True,
            "hybrid": True,
            "prefill_tp": 2,
            "decode_dp": 2,
            "expert_parallel": True,
            "dtype": "bfloat16",
            "block_size": 256,
            "extra_args": ("--mamba-cache-mode", "align"),
            **kw,
        }
    )


def test_mamba_cache_mode_without_prefix_caching_is_warned_in_the_plan():
    p = plan(kimi(), GPUS2, model="/m", share_gpus=True)
    (w,) = [w for w in p.warnings if "--mamba-cache-mode" in w]
    assert "cannot take effect" in w and "add --enable-prefix-caching" in w
    assert "WARNING: --mamba-cache-mode align cannot take effect" in p.render()


@pytest.mark.parametrize(
    "args, warned",
    [
        (("--mamba-cache-mode", "align"), True),
        (("--mamba-cache-mode=align",), True),
        (("--mamba-cache-mode", "align", "--enable-prefix-caching"), False),
        (("--mamba-cache-mode", "none"), False),
        ((), False),
    ],
)
def test_flag_warning_table(args, warned):
    assert bool(flag_warnings(kimi(extra_args=args))) is warned


def test_hybrid_tiny_model_marked_not_hybrid_is_warned():
    assert "hybrid = false" in flag_warnings(kimi(hybrid=False, extra_args=()))[0]


def test_hybrid_over_nixl_needs_an_explicit_block_size():
    with pytest.raises(PlanError, match=r"block_size.*hybrid.*set block_size"):
        plan(kimi(block_size=None), GPUS2, model="/m", share_gpus=True)
    assert hybrid_block_size(kimi(block_size=None, connector="mooncake")) is None
    assert hybrid_block_size(cfg("l", model="tiny-llama", connector="nixl")) is None
    with pytest.raises(PlanError):
        hybrid_block_size(cfg("h", model="some/hybrid", connector="nixl", hybrid=True))
    p = plan(kimi(), GPUS2, model="/m", share_gpus=True)
    assert all(arg(s, "--block-size") == "256" for s in p.instances)
    assert any("hybrid model over NIXL: --block-size 256 on both sides" in n for n in p.notes)


def test_host_env_reaches_every_gpu_process_and_the_plan_says_from_where():
    p = plan(kimi(), GPUS2, model="/m", share_gpus=True, passthrough_env=HOST_ENV)
    for s in p.instances:
        assert {k: dict(s.env)[k] for k in GPU_PASSTHROUGH_ENV} == HOST_ENV
    text = p.render()
    assert "note: NCCL_NVLS_ENABLE=0 (from the harness's environment, passed to every GPU process)" in text
    assert "env NVSHMEM_DISABLE_NVLS=1" in text


def test_gpu_env_table():
    env, notes = gpu_env({"NCCL_NVLS_ENABLE": "0"}, (("NVSHMEM_DISABLE_NVLS", "1"),))
    assert env == {"NCCL_NVLS_ENABLE": "0"}
    assert notes == [
        "NCCL_NVLS_ENABLE=0 (from the harness's environment, passed to every GPU process)",
        "NVSHMEM_DISABLE_NVLS=1 (from the config's extra_env)",
    ]
    assert gpu_env({}, ()) == ({}, [])


def test_cpu_lane_passes_no_gpu_env():
    c = cfg("l", model="tiny-llama", connector="nixl")
    p = plan(c, platform="cpu", model="/m", passthrough_env=HOST_ENV)
    assert not any(k in dict(s.env) for s in p.instances for k in GPU_PASSTHROUGH_ENV)


def test_decode_with_other_weights_is_planned_and_warned():
    c = cfg("l", model="tiny-llama", decode_weights_seed=7)
    p = plan(c, platform="cpu", model="/m", decode_model="/other")
    assert arg(p.prefill[0], "--model") == "/m"
    assert arg(p.decode[0], "--model") == "/other"
    assert any("fault injection" in w and "parity must fail" in w for w in p.warnings)


def test_other_weights_over_nixl_let_the_handshake_through():
    c = cfg("l", model="tiny-llama", connector="nixl", decode_weights_seed=7)
    p = plan(c, platform="cpu", model="/m", decode_model="/other")
    for s in p.instances:
        kv = json.loads(arg(s, "--kv-transfer-config"))
        assert kv["kv_connector_extra_config"] == {"enforce_handshake_compat": False}
    plain = plan(cfg("l", model="tiny-llama", connector="nixl"), platform="cpu", model="/m")
    assert "kv_connector_extra_config" not in arg(plain.prefill[0], "--kv-transfer-config")
