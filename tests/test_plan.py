from __future__ import annotations

import json

import pytest
from helpers.builders import CPU2, GPUS4, FakePorts, arg, cfg, plan

from pd_sessions.core.errors import PlanError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan import INTERNAL_PORT_BLOCK


def test_gpu_sets_are_disjoint_prefill_first():
    p = plan(cfg(prefill_tp=2, decode_tp=2))
    assert p.prefill[0].gpus == ("0", "1") and p.decode[0].gpus == ("2", "3")
    assert p.prefill[0].env_dict()["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert p.decode[0].env_dict()["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert arg(p.prefill[0], "--tensor-parallel-size") == "2"


def test_gpu_placement_honours_visible_devices():
    inv = Inventory(gpus=("4", "5", "6", "7"), cpus=(0,), gpu_source="CUDA_VISIBLE_DEVICES=4,5,6,7")
    p = plan(cfg(num_prefill=2, num_decode=2), inv)
    assert [s.gpus for s in p.instances] == [("4",), ("5",), ("6",), ("7",)]
    all_gpus = [g for s in p.instances for g in s.gpus]
    assert len(all_gpus) == len(set(all_gpus))


def test_gpu_shortage_is_an_error_before_anything():
    inv = Inventory(gpus=("0", "1"), cpus=(0,), gpu_source="CUDA_VISIBLE_DEVICES=0,1")
    with pytest.raises(PlanError) as e:
        plan(cfg(prefill_tp=2, decode_tp=2), inv)
    assert "needs 4 GPUs" in str(e.value) and "2 visible: 0,1" in str(e.value)


def test_every_port_unique_and_named():
    p = plan(cfg(num_prefill=2, num_decode=2))
    ports = [port for _, port in p.ports]
    assert len(ports) == len(set(ports))
    http = {s.port for s in p.processes}
    assert http <= set(ports) and len(http) == 5
    for s in p.instances:
        base = int(s.env_dict()["VLLM_PORT"])
        assert s.internal_ports == (base, base + INTERNAL_PORT_BLOCK - 1)
        assert int(s.env_dict()["VLLM_MOONCAKE_BOOTSTRAP_PORT"]) in ports
    router = p.router
    assert arg(router, "--prometheus-port") in {str(x) for x in ports}


def test_colliding_port_source_is_caught():
    with pytest.raises(PlanError, match=r"already used by prefill-0\.http"):
        plan(cfg(), ports=FakePorts(repeat=41000))


def test_explicit_ports_are_claimed_and_used():
    src = FakePorts()
    p = plan(cfg(router_port=18000, prefill_ports=(18001,), decode_ports=(18002,)), ports=src)
    assert (p.router.port, p.prefill[0].port, p.decode[0].port) == (18000, 18001, 18002)
    assert sorted(src.claimed) == [18000, 18001, 18002]


def test_kv_transfer_config_roles_mooncake():
    p = plan(cfg(mooncake_protocol="rdma", mooncake_device_name="mlx5_12"))
    pre = json.loads(arg(p.prefill[0], "--kv-transfer-config"))
    dec = json.loads(arg(p.decode[0], "--kv-transfer-config"))
    assert pre["kv_connector"] == dec["kv_connector"] == "MooncakeConnector"
    assert (pre["kv_role"], dec["kv_role"]) == ("kv_producer", "kv_consumer")
    assert pre["kv_connector_extra_config"] == {"mooncake_protocol": "rdma", "device_name": "mlx5_12"}


def test_gpu_lane_flags():
    p = plan(cfg(gpu_memory_utilization=0.6, extra_args=("--enforce-eager",), extra_env=(("X", "1"),)))
    s = p.prefill[0]
    assert arg(s, "--gpu-memory-utilization") == "0.6"
    assert "--dtype" not in s.argv and "--block-size" not in s.argv
    assert s.argv[-1] == "--enforce-eager"
    assert s.env_dict()["X"] == "1" and s.env_dict()["VLLM_HOST_IP"] == "127.0.0.1"
    assert arg(s, "--host") == "127.0.0.1"
    assert s.argv[:3] == ("/py", "-m", "vllm.entrypoints.openai.api_server")


def test_router_argv_pd_mode():
    p = plan(cfg(num_prefill=2))
    r = p.router.argv
    assert "--vllm-pd-disaggregation" in r
    i = r.index("--prefill")
    assert r[i + 1] == p.prefill[0].url and r[i + 2] == str(p.prefill[0].bootstrap_port)
    assert r.count("--prefill") == 2 and r.count("--decode") == 1
    assert arg(p.router, "--kv-connector") == "mooncake"
    assert arg(p.router, "--host") == "127.0.0.1" and arg(p.router, "--prometheus-host") == "127.0.0.1"


def test_cpu_lane_flags_1x1():
    p = plan(cfg(model="tiny-llama"), CPU2, platform="cpu", model="/cache/tiny")
    pre, dec = p.prefill[0], p.decode[0]
    for s in (pre, dec):
        assert arg(s, "--dtype") == "float32" and arg(s, "--block-size") == "128"
        assert "--gpu-memory-utilization" not in s.argv
        assert s.env_dict()["VLLM_CPU_KVCACHE_SPACE"] == "1" and s.env_dict()["VLLM_HOST_IP"] == "127.0.0.1"
        assert "CUDA_VISIBLE_DEVICES" not in s.env_dict()
        assert arg(s, "--model") == "/cache/tiny" and arg(s, "--served-model-name") == "tiny-llama"
        kv = json.loads(arg(s, "--kv-transfer-config"))
        assert kv["kv_connector_extra_config"]["mooncake_protocol"] == "tcp"
    assert (pre.env_dict()["VLLM_CPU_OMP_THREADS_BIND"], dec.env_dict()["VLLM_CPU_OMP_THREADS_BIND"]) == (
        "0",
        "1",
    )


def test_cpu_lane_tp2_binds_one_core_list_per_rank():
    inv = Inventory(gpus=(), cpus=(0, 1, 2, 3, 4, 5, 6, 7))
    p = plan(cfg(model="m", prefill_tp=2, decode_tp=2), inv, platform="cpu")
    assert p.prefill[0].env_dict()["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    assert p.decode[0].env_dict()["VLLM_CPU_OMP_THREADS_BIND"] == "4,5|6,7"
    assert not [w for w in p.warnings if "share" in w]


def test_cpu_lane_oversubscribed_warns():
    p = plan(cfg(model="m", prefill_tp=2, decode_tp=2), CPU2, platform="cpu")
    assert p.prefill[0].env_dict()["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert any("4 TP ranks share 2 CPU cores" in w for w in p.warnings)


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"dtype": "bfloat16"}, "dtype: got 'bfloat16' on the CPU lane; allowed: float32"),
        ({"block_size": 16}, "block_size: got 16 on the CPU lane; allowed: a multiple of 32"),
    ],
)
def test_cpu_lane_rejects_known_traps(kw, needle):
    with pytest.raises(PlanError, match=needle.replace("(", r"\(")):
        plan(cfg(model="m", **kw), CPU2, platform="cpu")


def test_tiny_model_needs_a_path():
    with pytest.raises(PlanError, match="needs the generated model's path"):
        plan(cfg(model="tiny-llama"), CPU2, platform="cpu")


def test_render_lists_every_process():
    text = plan(cfg(prefill_tp=2, decode_tp=2)).render()
    for needle in (
        "prefill-0",
        "decode-0",
        "router",
        "GPUs 0,1",
        "GPUs 2,3",
        "all ",
        "distinct",
        "CUDA_VISIBLE_DEVICES=0,1",
    ):
        assert needle in text


# ---------------------------------------------------------------- NIXL, DP/EP, remote code


def test_nixl_side_channel_ports_one_per_dp_rank():
    p = plan(cfg(connector="nixl", prefill_tp=2, decode_dp=2, expert_parallel=True, moe=True))
    pre, dec = p.prefill[0], p.decode[0]
    ports = dict(p.ports)
    assert int(pre.env_dict()["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ports["prefill-0.side_channel"]
    base = int(dec.env_dict()["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    # decode rank r listens on base + r: both are reserved in the plan
    assert ports["decode-0.side_channel"] == base and ports["decode-0.side_channel+1"] == base + 1
    assert dec.env_dict()["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" not in pre.env_dict() and pre.bootstrap_port is None
    values = [v for _, v in p.ports]
    assert len(values) == len(set(values))
    kv = json.loads(arg(dec, "--kv-transfer-config"))
    assert kv == {"kv_buffer_device": "cuda", "kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert arg(p.router, "--kv-connector") == "nixl" and p.router.argv.count("--prefill") == 1
    i = p.router.argv.index("--prefill")
    assert p.router.argv[i + 2].startswith("--")  # no bootstrap port for NIXL


def test_nixl_cpu_buffer_on_cpu_lane():
    p = plan(cfg(model="m", connector="nixl"), CPU2, platform="cpu")
    assert json.loads(arg(p.prefill[0], "--kv-transfer-config"))["kv_buffer_device"] == "cpu"


def test_nixl_progress_delay_on_the_cpu_lane_only_and_a_config_may_change_it():
    delay = "PD_SESSIONS_NIXL_PROGRESS_DELAY_US"
    p = plan(cfg(model="m", connector="nixl"), CPU2, platform="cpu")
    assert [s.env_dict()[delay] for s in (p.prefill[0], p.decode[0])] == ["1000", "1000"]
    assert delay not in p.router.env_dict()
    assert delay not in plan(cfg(model="m"), CPU2, platform="cpu").prefill[0].env_dict()  # mooncake
    assert delay not in plan(cfg(connector="nixl")).decode[0].env_dict()  # GPUs: NIXL's own setting
    own = plan(cfg(model="m", connector="nixl", extra_env=((delay, "250"),)), CPU2, platform="cpu")
    assert own.prefill[0].env_dict()[delay] == "250"


def test_decode_dp_ep_placement_and_args():
    p = plan(cfg(connector="nixl", prefill_tp=2, decode_tp=1, decode_dp=2, expert_parallel=True, moe=True))
    assert p.prefill[0].gpus == ("0", "1") and p.decode[0].gpus == ("2", "3")
    d = p.decode[0]
    assert arg(d, "--data-parallel-size") == "2" and arg(d, "--tensor-parallel-size") == "1"
    assert "--enable-expert-parallel" in d.argv and "--enable-expert-parallel" not in p.prefill[0].argv
    assert int(arg(d, "--data-parallel-rpc-port")) == dict(p.ports)["decode-0.dp_rpc"]
    assert arg(d, "--data-parallel-address") == "127.0.0.1"


def test_dp_ep_gpu_shortage():
    inv = Inventory(gpus=("0", "1", "2"), cpus=(0,), gpu_source="nvidia-smi")
    with pytest.raises(PlanError, match=r"needs 4 GPUs .* 3 visible: 0,1,2"):
        plan(cfg(prefill_tp=2, decode_dp=2, expert_parallel=True, moe=True), inv)


@pytest.mark.parametrize(
    "kw,field", [({"decode_dp": 2}, "decode_dp"), ({"expert_parallel": True}, "expert_parallel")]
)
def test_dp_ep_only_for_moe_models(kw, field):
    from pd_sessions.core.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        cfg(**kw)
    assert e.value.field == field and "mixture-of-experts" in str(e.value)


def test_remote_code_pinned():
    p = plan(cfg(trust_remote_code=True, revision="abc123"))
    a = p.prefill[0].argv
    assert "--trust-remote-code" in a and arg(p.prefill[0], "--revision") == "abc123"
    assert arg(p.prefill[0], "--tokenizer-revision") == "abc123" and not p.warnings
    assert "revision abc123" in p.render()


def test_remote_code_unpinned_refused_without_flag():
    with pytest.raises(PlanError) as e:
        plan(cfg(trust_remote_code=True))
    assert e.value.field == "revision" and "--allow-unpinned-remote-code" in str(e.value)


def test_remote_code_unpinned_allowed_and_said():
    p = plan(cfg(trust_remote_code=True), allow_unpinned=True)
    assert "--trust-remote-code" in p.decode[0].argv and "--revision" not in p.decode[0].argv
    assert any(w.startswith("UNPINNED remote code") for w in p.warnings)
    assert "revision UNPINNED" in p.render()


def test_no_remote_code_by_default():
    assert "--trust-remote-code" not in plan(cfg()).prefill[0].argv


# ---------------------------------------------------------------- shared GPUs

ONE = Inventory(gpus=("0",), cpus=(0,), gpu_source="nvidia-smi")


def test_one_gpu_without_share_is_the_shortage_error():
    with pytest.raises(PlanError, match=r"needs 2 GPUs .* 1 visible: 0.*--share-gpus"):
        plan(cfg(), ONE)


def test_share_gpus_places_both_on_gpu0_with_explicit_kv_bytes():
    p = plan(cfg(shared_kv_cache_bytes=2 * 1024**3), ONE, share_gpus=True)
    assert p.prefill[0].gpus == ("0",) and p.decode[0].gpus == ("0",)
    for s in p.instances:
        assert arg(s, "--kv-cache-memory-bytes") == str(2 * 1024**3)
        assert "--gpu-memory-utilization" not in s.argv
    assert any("--share-gpus" in w for w in p.warnings)


def test_share_gpus_keeps_disjoint_when_enough():
    p = plan(cfg(), GPUS4, share_gpus=True)
    assert p.prefill[0].gpus == ("0",) and p.decode[0].gpus == ("1",)
    assert "--gpu-memory-utilization" in p.prefill[0].argv and not p.warnings


def test_share_gpus_needs_at_least_one_gpu():
    with pytest.raises(PlanError, match="0 visible"):
        plan(cfg(), Inventory(gpus=(), cpus=(0,)), share_gpus=True)


def test_cpu_lane_runs_eager_once():
    cpu = Inventory(gpus=(), cpus=(0, 1), gpu_source="none")
    for extra in ((), ("--enforce-eager",)):
        p = plan(cfg(model="tiny-llama", extra_args=extra), inv=cpu, platform="cpu", model="/m")
        for s in p.instances:
            assert s.argv.count("--enforce-eager") == 1
    g = plan(cfg())
    assert all("--enforce-eager" not in s.argv for s in g.instances)
