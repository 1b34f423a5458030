"""One instance rendered (core.plan.instance): its ports from the plan's ledger, env and argv;
the ledger (core.plan.ledger) and the router (core.plan.router) beside it."""

from __future__ import annotations

import json

import pytest
from helpers.builders import FakePorts, arg, cfg

from pd_sessions.core.errors import PlanError
from pd_sessions.core.plan.instance import (
    INTERNAL_PORT_BLOCK,
    InstancePorts,
    Launch,
    instance_argv,
    instance_env,
    plan_instance,
    reserve_ports,
)
from pd_sessions.core.plan.ledger import PortLedger
from pd_sessions.core.plan.placement import Slot
from pd_sessions.core.plan.router import plan_router
from pd_sessions.core.plan.settings import Lane, ModelSettings

PORTS = InstancePorts(http=8000, internal=20000, bootstrap=None, side_channel=None, dp_rpc=None)


def launch(c=None, platform="cuda", *, shared=False, gpu_env=(), dtype=None, block=None, decode_model=None):
    c = c or cfg()
    models = ModelSettings("/m", decode_model, ("--trust-remote-code",), (), ())
    return Launch(c, platform, "/py", models, Lane(dtype, block, gpu_env, (), ()), shared)


@pytest.mark.parametrize(
    "connector,dp,labels",
    [
        ("mooncake", 1, ["d-0.http", "d-0.internal", "d-0.bootstrap"]),
        ("nixl", 1, ["d-0.http", "d-0.internal", "d-0.side_channel"]),
        ("nixl_push", 1, ["d-0.http", "d-0.internal", "d-0.side_channel"]),
        (
            "nixl",
            2,
            ["d-0.http", "d-0.internal", "d-0.side_channel", "d-0.side_channel+1", "d-0.dp_rpc"],
        ),
    ],
)
def test_reserve_ports_order_and_labels(connector, dp, labels):
    ledger = PortLedger(FakePorts())
    ports = reserve_ports(Slot("d", 0, tp=1, dp=dp), connector, ledger)
    taken = [label for label in dict(ledger.taken) if not label.startswith("d-0.internal+")]
    assert taken == labels
    internal = [label for label, _ in ledger.taken if label.startswith("d-0.internal")]
    assert len(internal) == INTERNAL_PORT_BLOCK * dp
    assert (ports.bootstrap is not None) is (connector == "mooncake")
    assert (ports.side_channel is not None) is (connector != "mooncake")
    assert (ports.dp_rpc is not None) is (dp > 1)


def test_ledger_claims_explicit_ports_and_refuses_a_repeat():
    src = FakePorts()
    ledger = PortLedger(src)
    assert ledger.get("a", 18000) == 18000 and src.claimed == [18000]
    with pytest.raises(PlanError) as e:
        ledger.get("b", 18000)
    assert e.value.field == "b" and "already used by a" in str(e.value)


def test_env_table_cpu_nixl_and_the_configs_own_value_wins():
    c = cfg(connector="nixl", extra_env=(("VLLM_PORT", "1"), ("X", "2")))
    ports = InstancePorts(http=8000, internal=20000, bootstrap=None, side_channel=21000, dp_rpc=None)
    env = instance_env(Slot("prefill", 0, 1, 1, cpu_bind="0,1"), launch(c, "cpu"), ports)
    assert list(env) == [
        "VLLM_HOST_IP",
        "VLLM_PORT",
        "PYTHONUNBUFFERED",
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CPU_OMP_THREADS_BIND",
        "TORCHDYNAMO_DISABLE",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "OMP_NUM_THREADS",
        "OMP_PLACES",
        "OMP_PROC_BIND",
        "PD_SESSIONS_NIXL_PROGRESS_DELAY_US",
        "PD_SESSIONS_NIXL_KEEP_CORES",
        "X",
    ]
    assert env["VLLM_PORT"] == "1" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "21000"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and env["TORCHDYNAMO_DISABLE"] == "1"


@pytest.mark.parametrize(
    "tp,dp,bind,one_process",
    [(1, 1, "1", True), (1, 1, "0,1", True), (2, 1, "0|1", False), (1, 2, "0", False)],
)
def test_a_cpu_slot_of_one_rank_runs_its_worker_in_the_engine_core_bound_as_vllm_binds_it(
    tp, dp, bind, one_process
):
    """vLLM's CPU platform would spawn a worker process for a one-rank engine (a GPU runs it in
    the engine core) unless VLLM_ENABLE_V1_MULTIPROCESSING=0; the OpenMP binding vLLM gives that
    worker is then the instance's own. With more ranks both are left to vLLM."""
    ports = InstancePorts(http=8000, internal=20000, bootstrap=9000, side_channel=None, dp_rpc=None)
    env = instance_env(Slot("decode", 0, tp, dp, cpu_bind=bind), launch(cfg(), "cpu"), ports)
    assert (env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0") is one_process
    omp = {k: env.get(k) for k in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND")}
    if one_process:
        assert omp == {
            "OMP_NUM_THREADS": str(len(bind.split(","))),
            "OMP_PLACES": f"{{{bind}}}",
            "OMP_PROC_BIND": "true",
        }
    else:
        assert omp == dict.fromkeys(omp)
    on_gpu = instance_env(Slot("decode", 0, tp, dp), launch(cfg()), ports)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in on_gpu


def test_env_gpus_get_the_passed_through_env():
    ports = InstancePorts(http=8000, internal=20000, bootstrap=9000, side_channel=None, dp_rpc=None)
    env = instance_env(Slot("decode", 0, 2, 1, gpus=("2", "3")), launch(gpu_env=(("G", "1"),)), ports)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["G"] == "1"
    assert env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "9000"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "TORCHDYNAMO_DISABLE" not in env


@pytest.mark.parametrize(
    "platform,shared,present,absent",
    [
        ("cuda", False, ["--gpu-memory-utilization"], ["--kv-cache-memory-bytes", "--enforce-eager"]),
        ("cuda", True, ["--kv-cache-memory-bytes"], ["--gpu-memory-utilization", "--enforce-eager"]),
        ("cpu", False, ["--enforce-eager"], ["--gpu-memory-utilization", "--kv-cache-memory-bytes"]),
    ],
)
def test_engine_flags_table(platform, shared, present, absent):
    argv, _ = instance_argv(Slot("prefill", 0, 1, 1), launch(platform=platform, shared=shared), PORTS)
    assert [f for f in present if f in argv] == present
    assert [f for f in absent if f in argv] == []


def test_a_model_without_weights_loads_dummy_weights_unless_the_config_says_how():
    slot = Slot("prefill", 0, 1, 1)
    argv, _ = instance_argv(slot, launch(cfg(model="dummy-llama-1b")), PORTS)
    assert arg(argv, "--load-format") == "dummy"
    own = cfg(model="dummy-llama-1b", extra_args=("--load-format=dummy",))
    assert instance_argv(slot, launch(own), PORTS)[0].count("--load-format") == 0
    assert "--load-format" not in instance_argv(slot, launch(cfg(model="tiny-llama")), PORTS)[0]


def test_argv_order_and_the_optional_flags():
    c = cfg(max_model_len=512, attention_backend="FLASH_ATTN", extra_args=("--last",))
    argv, warnings = instance_argv(
        Slot("decode", 0, 1, 1), launch(c, dtype="auto", block=64, decode_model="/other"), PORTS
    )
    assert argv[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert arg(argv, "--model") == "/other" and arg(argv, "--served-model-name") == "m"
    assert "--dtype" not in argv and arg(argv, "--block-size") == "64"
    assert arg(argv, "--max-model-len") == "512" and arg(argv, "--attention-backend") == "FLASH_ATTN"
    order = [
        "--tensor-parallel-size",
        "--trust-remote-code",
        "--kv-transfer-config",
        "--block-size",
        "--last",
    ]
    assert [argv.index(f) for f in order] == sorted(argv.index(f) for f in order)
    assert argv[-1] == "--last" and warnings == []


def test_decode_without_kv_transfer_is_warned():
    c = cfg(decode_kv_transfer=False)
    argv, warnings = instance_argv(Slot("decode", 1, 1, 1), launch(c), PORTS)
    assert "--kv-transfer-config" not in argv
    assert len(warnings) == 1 and warnings[0].startswith("decode-1 starts WITHOUT --kv-transfer-config")
    argv, warnings = instance_argv(Slot("prefill", 0, 1, 1), launch(c), PORTS)
    assert json.loads(arg(argv, "--kv-transfer-config"))["kv_role"] == "kv_producer" and warnings == []


@pytest.mark.parametrize("connector", ["mooncake", "nixl"])
def test_the_fault_injector_wraps_the_connector_keeping_its_name_and_settings(connector):
    from pd_sessions.core.plan.instance import kv_transfer_config

    plain = kv_transfer_config(cfg(connector=connector), "decode", "cpu")
    assert "kv_load_failure_policy" not in plain and "kv_connector_module_path" not in plain
    c = cfg(connector=connector, kv_load_failure_policy="recompute")
    kv = kv_transfer_config(c, "decode", "cpu", faults_control="/r/c/faults.json")
    assert kv["kv_connector"] == plain["kv_connector"] and kv["kv_role"] == "kv_consumer"
    assert kv["kv_load_failure_policy"] == "recompute"
    assert kv["kv_connector_module_path"] == "pd_sessions.vllm_side.fault_connector"
    extra = kv["kv_connector_extra_config"]
    assert extra["pd_sessions_faults"] == {"control": "/r/c/faults.json"}
    # the connector's own extra settings stay (mooncake: protocol, device)
    assert {k: v for k, v in extra.items() if k != "pd_sessions_faults"} == plain.get(
        "kv_connector_extra_config", {}
    )


def test_plan_instance_spec():
    ledger = PortLedger(FakePorts())
    got = plan_instance(Slot("prefill", 0, 1, 1, gpus=("0",), http_port=18001), launch(), ledger)
    s = got.spec
    assert (s.name, s.role, s.port, s.log_name, s.gpus) == (
        "prefill-0",
        "prefill",
        18001,
        "prefill-0.log",
        ("0",),
    )
    base = dict(ledger.taken)["prefill-0.internal"]
    assert s.internal_ports == (base, base + INTERNAL_PORT_BLOCK - 1)
    assert s.bootstrap_port == dict(ledger.taken)["prefill-0.bootstrap"]
    decode = plan_instance(Slot("decode", 0, 1, 1, gpus=("1",)), launch(), ledger).spec
    assert decode.bootstrap_port is None and "VLLM_MOONCAKE_BOOTSTRAP_PORT" in decode.env_dict()


def test_router_takes_the_last_ports():
    ledger = PortLedger(FakePorts())
    pre = plan_instance(Slot("prefill", 0, 1, 1), launch(), ledger).spec
    dec = plan_instance(Slot("decode", 0, 1, 1), launch(), ledger).spec
    r = plan_router(cfg(router_port=18000), "/py", [pre], [dec], ledger)
    assert [label for label, _ in ledger.taken[-2:]] == ["router.http", "router.prometheus"]
    assert (r.name, r.role, r.port, r.env, r.log_name) == ("router", "router", 18000, (), "router.log")
    assert arg(r.argv, "--prefill") == pre.url and arg(r.argv, "--decode") == dec.url


def test_decode_extra_args_go_to_decode_instances_only_and_last():
    c = cfg(extra_args=("--all",), decode_extra_args=("--num-gpu-blocks-override", "16"))
    decode, _ = instance_argv(Slot("decode", 0, 1, 1), launch(c), PORTS)
    prefill, _ = instance_argv(Slot("prefill", 0, 1, 1), launch(c), PORTS)
    assert decode[-3:] == ["--all", "--num-gpu-blocks-override", "16"]
    assert prefill[-1] == "--all" and "--num-gpu-blocks-override" not in prefill
