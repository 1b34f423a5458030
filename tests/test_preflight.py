from __future__ import annotations

import pytest

from pd_sessions.core.config import ClusterConfig, builtin_sweep
from pd_sessions.core.errors import ConfigError, PlanError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.preflight import host_refusal, preflight

KIMI = builtin_sweep("kimi_linear_nightly")
NONE = Inventory(gpus=(), cpus=(0, 1))
TWO = Inventory(gpus=("0", "1"), cpus=(0, 1), gpu_source="nvidia-smi")
FOUR = Inventory(gpus=("0", "1", "2", "3"), cpus=(0, 1), gpu_source="nvidia-smi")


def test_kimi_config_is_the_upstream_shape():
    (e,) = KIMI.entries("cuda")
    c = e.config
    assert (c.connector, c.prefill_tp, c.decode_tp, c.decode_dp, c.expert_parallel) == ("nixl", 2, 1, 2, True)
    assert c.gpu_memory_utilization == 0.9 and c.max_model_len == 32768 and c.trust_remote_code
    assert c.revision is None and ("VLLM_SSM_CONV_STATE_LAYOUT", "DS") in c.extra_env
    assert c.extra_args == ("--mamba-cache-mode", "align")
    assert KIMI.platforms == ("cuda",) and KIMI.gpus_needed() == 4


@pytest.mark.parametrize("inv,seen", [(NONE, "0 visible: none"), (TWO, "2 visible: 0,1")])
def test_kimi_refuses_too_few_gpus_before_anything(inv, seen):
    with pytest.raises(PlanError) as e:
        preflight(KIMI, None, inv)
    assert "kimi_linear_nightly needs 4 GPUs" in str(e.value) and seen in str(e.value)
    assert e.value.exit_status == 2


def test_kimi_dry_run_assumes_gpus_and_says_so():
    platform, inv, note = preflight(KIMI, None, NONE, dry_run=True)
    assert platform == "cuda" and inv.gpus == ("0", "1", "2", "3") and "planning as if" in note


def test_kimi_runs_on_four():
    assert preflight(KIMI, None, FOUR) == ("cuda", FOUR, None)


def test_kimi_refuses_cpu():
    with pytest.raises(ConfigError, match="runs on cuda only"):
        preflight(KIMI, "cpu", FOUR)


def test_sweeps_with_a_cpu_lane_follow_the_host():
    s = builtin_sweep("nixl_sweep")
    assert preflight(s, None, NONE)[0] == "cpu" and preflight(s, None, FOUR)[0] == "cuda"


def test_single_gpu_verification_needs_share_flag():
    s = builtin_sweep("gpu_single_verification")
    one = Inventory(gpus=("0",), cpus=(0,), gpu_source="nvidia-smi")
    with pytest.raises(PlanError, match="needs 2 GPUs, 1 visible"):
        preflight(s, None, one)
    assert preflight(s, None, one, share_gpus=True)[0] == "cuda"
    names = {e.config.connector for e in s.entries("cuda")}
    assert names == {"mooncake", "nixl"}
    assert all(e.config.dtype == "bfloat16" and e.config.block_size == 16 for e in s.entries("cuda"))


def test_cpu_nightly_shape_plan():
    """The scaled-down nightly shape for CPU hosts: prefill TP2 + decode DP2/EP, tiny MoE."""
    from pd_sessions.core.plan import plan_cluster
    from pd_sessions.runtime.ports import PortAllocator

    (e,) = builtin_sweep("nightly_shape_cpu").entries("cpu")
    with PortAllocator() as ports:
        p = plan_cluster(
            e.config, Inventory(gpus=(), cpus=(0, 1, 2, 3)), ports, platform="cpu", python="py", model="/m"
        )
    d = p.decode[0].argv
    assert "--enable-expert-parallel" in d and d[d.index("--data-parallel-size") + 1] == "2"
    assert dict(p.decode[0].env)["VLLM_CPU_OMP_THREADS_BIND"] == "2|3"
    assert dict(p.prefill[0].env)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


# ------------------------------------------------------------ Mooncake over RDMA on this host

RDMA_CFG = ClusterConfig(name="1x1", model="m", connector="mooncake", mooncake_protocol="rdma")


@pytest.mark.parametrize(
    "platform,devices,config,needle",
    [
        (
            "cuda",
            (),
            RDMA_CFG,
            ("mooncake_protocol", "has none (/sys/class/infiniband is empty); use --mooncake-protocol tcp"),
        ),
        ("cuda", ("mlx5_0",), RDMA_CFG, None),
        ("cuda", None, RDMA_CFG, None),  # not looked at
        ("cpu", (), RDMA_CFG, None),  # the CPU lane uses tcp
        ("cuda", (), ClusterConfig(name="t", model="m", connector="mooncake", mooncake_protocol="tcp"), None),
        ("cuda", (), ClusterConfig(name="n", model="m", connector="nixl"), None),
        (
            "cuda",
            ("mlx5_0", "mlx5_1"),
            ClusterConfig(name="d", model="m", mooncake_device_name="mlx5_12"),
            ("mooncake_device_name", "names mlx5_12, not an RDMA device of this host (mlx5_0, mlx5_1)"),
        ),
    ],
)
def test_rdma_without_a_device_is_said_before_launch(platform, devices, config, needle):
    """The Mooncake spec's host refusal, asked through preflight's loop over the connectors."""
    inv = Inventory(gpus=("0",), cpus=(0,), rdma_devices=devices)
    got = host_refusal([config], platform, inv)
    if needle is None:
        assert got is None
    else:
        assert got is not None and got.field == needle[0]
        assert needle[1] in got.message and config.name in got.message
