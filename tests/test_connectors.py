"""pd_sessions.core.connectors: the registry, and every registered spec through the same checks.

A new connector module is tested here by being listed in ``connectors.ALL``: its names, its
kv-transfer-config per role and platform, its ports, hops, evidence and failure lines, its
package's variants, its options and its sweep file. Where the installed vLLM and vllm-router can
say whether a name is real (vLLM's connector factory, vLLM's environment variables and metric
names, the router's ``--kv-connector`` choices), their sources are read: without them (``nox -s
unit``) those tests skip with the reason, in the full environment (``nox -s tests``) they must run.
Behaviour per connector is tested where it is used (planner, install, canary, KV proof, pairs).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib

import pytest
from helpers.builders import cfg
from helpers.needs import needs, package_dir

from pd_sessions.core import connectors
from pd_sessions.core.config import CONFIG_DIR, ClusterConfig, load
from pd_sessions.core.connectors import MOONCAKE, NIXL, NIXL_PUSH
from pd_sessions.core.connectors.base import KV_ROLES, LogEvidence, MetricEvidence
from pd_sessions.core.errors import ConfigError
from pd_sessions.core.inventory import Inventory

SPECS = pytest.mark.parametrize("spec", connectors.ALL, ids=lambda s: s.name)


def vllm_source(*parts: str) -> str:
    return (package_dir("vllm").joinpath(*parts)).read_text()


# ---------------------------------------------------------------- the registry


def test_names_are_unique_and_get_names_the_known_ones():
    assert len(set(connectors.names())) == len(connectors.ALL)
    assert connectors.get("nixl_push") is NIXL_PUSH and connectors.DEFAULT is MOONCAKE
    with pytest.raises(ConfigError) as e:
        connectors.get("nixl-push")
    assert e.value.field == "connector"
    assert "allowed: mooncake, nixl, nixl_push" in str(e.value) and 'did you mean "nixl_push"' in str(e.value)


def test_packages_are_shared_and_named_by_connector_or_package():
    assert [p.name for p in connectors.packages()] == ["mooncake", "nixl"]
    assert connectors.packages(["nixl_push"]) == (NIXL.package,)
    assert connectors.packages(["nixl", "nixl_push"]) == (NIXL.package,)
    assert connectors.package("mooncake") is MOONCAKE.package
    with pytest.raises(ConfigError, match="got 'lmcache'"):
        connectors.packages(["lmcache"])


def test_the_options_are_config_fields_and_sweep_flags():
    from pd_sessions.core.cliargs import sweep_parser

    fields = {f.name for f in dataclasses.fields(ClusterConfig)}
    parser = sweep_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    for option in connectors.options():
        assert option.field in fields and option.flag in flags
    ns = parser.parse_args(["mooncake_sweep", "--mooncake-protocol", "tcp"])
    assert ns.mooncake_protocol == "tcp"
    with pytest.raises(SystemExit):
        parser.parse_args(["mooncake_sweep", "--mooncake-protocol", "udp"])


def test_a_config_validates_every_connectors_options_whatever_its_connector():
    with pytest.raises(ConfigError, match="mooncake_protocol: got 'udp'; allowed: rdma, tcp"):
        cfg(connector="nixl", mooncake_protocol="udp")


# ---------------------------------------------------------------- every spec


@SPECS
def test_kv_transfer_config_per_role(spec):
    for role, kv_role in KV_ROLES.items():
        for platform in ("cpu", "cuda"):
            kv = spec.kv_transfer_config(cfg(connector=spec.name), role, platform)
            assert kv["kv_connector"] == spec.vllm_class and kv["kv_role"] == kv_role
            assert {"kv_connector", "kv_role"} <= set(kv)


def test_each_connectors_own_keys():
    mc = MOONCAKE.kv_transfer_config(
        cfg(mooncake_protocol="rdma", mooncake_device_name="mlx5_0"), "decode", "cpu"
    )
    assert mc["kv_connector_extra_config"] == {
        "mooncake_protocol": "tcp",
        "device_name": "mlx5_0",
    }  # CPU: tcp
    gpu = MOONCAKE.kv_transfer_config(cfg(mooncake_protocol="rdma"), "prefill", "cuda")
    assert gpu["kv_connector_extra_config"] == {"mooncake_protocol": "rdma", "device_name": ""}
    for spec in (NIXL, NIXL_PUSH):
        assert spec.kv_transfer_config(cfg(connector=spec.name), "decode", "cpu")["kv_buffer_device"] == "cpu"
        faulty = spec.kv_transfer_config(
            cfg(connector=spec.name, model="tiny-llama", decode_weights_seed=7), "decode", "cuda"
        )
        assert faulty["kv_buffer_device"] == "cuda"
        assert faulty["kv_connector_extra_config"] == {"enforce_handshake_compat": False}


@pytest.mark.procs
@SPECS
def test_the_vllm_class_is_registered_in_vllms_connector_factory(spec):
    factory = vllm_source("distributed", "kv_transfer", "kv_connector", "factory.py")
    assert re.search(rf'register_connector\(\s*"{spec.vllm_class}"', factory), spec.vllm_class


@pytest.mark.procs
@SPECS
def test_the_router_flag_is_one_of_vllm_routers_choices(spec):
    needs("vllm_router")
    from vllm_router.router_args import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    (action,) = [a for a in parser._actions if "--kv-connector" in a.option_strings]
    assert spec.router_flag in action.choices


@pytest.mark.procs
@SPECS
def test_port_variables_are_vllms(spec):
    envs = vllm_source("envs.py")
    names = [spec.ports.bootstrap_env, spec.ports.side_channel_env, spec.ports.side_channel_host_env]
    for name in filter(None, names):
        assert f'"{name}"' in envs, name


@SPECS
def test_port_env_names_what_the_planner_took(spec):
    env = spec.port_env("127.0.0.1", 9000, 21000)
    assert (spec.ports.bootstrap_env in env) is bool(spec.ports.bootstrap_env)
    if spec.ports.side_channel_env:
        assert (
            env[spec.ports.side_channel_env] == "21000"
            and env[spec.ports.side_channel_host_env] == "127.0.0.1"
        )
    assert spec.port_env("127.0.0.1", None, None) == {}


@SPECS
def test_hops_ask_the_prefill_for_a_remote_decode(spec):
    params = spec.hops.prefill_params("t1")
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert (spec.hops.bootstrap_query is None) is (spec.hops.engine_id is None)
    assert (spec.hops.bootstrap_query is not None) is bool(spec.ports.bootstrap_env)


def test_mooncake_hops_share_the_transfer_id_and_name_the_bootstrap():
    assert MOONCAKE.hops.prefill_params("t1") == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": "t1",
    }
    d = MOONCAKE.hops.decode_params("t1", {}, "http://127.0.0.1:9", "e")
    assert d == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "t1",
        "remote_bootstrap_addr": "http://127.0.0.1:9",
        "remote_engine_id": "e",
    }
    assert MOONCAKE.hops.engine_id is not None
    assert MOONCAKE.hops.engine_id({"0": {"engine_id": "abc"}}) == "abc"
    with pytest.raises(ValueError, match="no DP rank 0 registered yet"):
        MOONCAKE.hops.engine_id({})


@pytest.mark.parametrize("spec", [NIXL, NIXL_PUSH], ids=lambda s: s.name)
def test_nixl_decode_hops_carry_what_the_prefill_answered(spec):
    ans = {"kv_transfer_params": {"remote_engine_id": "p0", "remote_block_ids": [1], "transfer_mode": "push"}}
    assert spec.hops.decode_params("t", ans, None, None) == ans["kv_transfer_params"]
    with pytest.raises(ValueError, match="no kv_transfer_params"):
        spec.hops.decode_params("t", {}, None, None)


@pytest.mark.procs
@SPECS
def test_evidence_and_failure_lines(spec):
    for pattern in spec.failure_lines:
        re.compile(pattern)
    assert spec.failure_lines
    if isinstance(spec.evidence, MetricEvidence):
        assert spec.evidence.role in KV_ROLES and spec.evidence.count.endswith("_count")
        stats = vllm_source("distributed", "kv_transfer", "kv_connector", "v1", "nixl", "stats.py")
        for sample in spec.evidence.samples:  # the metric family each sample belongs to
            family = re.sub(r"_(count|sum|total)$", "", sample)
            assert f'"{family}"' in stats, family
    else:
        assert isinstance(spec.evidence, LogEvidence) and spec.evidence.success


def test_the_transfer_op_is_what_moves_the_kv_and_matches_the_side_that_records_it():
    # the perf check's link probe times this operation, started where the connector starts it
    assert (NIXL.transfer_op, NIXL_PUSH.transfer_op, MOONCAKE.transfer_op) == ("READ", "WRITE", "WRITE")
    for spec in connectors.ALL:
        assert spec.transfer_op in ("READ", "WRITE")
        if isinstance(spec.evidence, MetricEvidence):  # "READ transfers" on the decode that reads
            assert spec.evidence.what.startswith(f"{spec.transfer_op} ")
            assert spec.evidence.role == ("prefill" if spec.transfer_op == "WRITE" else "decode")


def test_push_is_nixls_wheels_ports_and_hops_with_its_own_evidence():
    assert NIXL_PUSH.package is NIXL.package and NIXL_PUSH.ports == NIXL.ports and NIXL_PUSH.hops is NIXL.hops
    assert NIXL_PUSH.router_flag == NIXL.router_flag  # the router learns push from the prefill's answer
    assert isinstance(NIXL.evidence, MetricEvidence) and isinstance(NIXL_PUSH.evidence, MetricEvidence)
    assert (NIXL.evidence.role, NIXL_PUSH.evidence.role) == ("decode", "prefill")
    assert set(NIXL.failure_lines) < set(NIXL_PUSH.failure_lines)


def test_push_runs_on_the_cpu_lane_with_a_longer_handshake_wait():
    """The CPU lane plans push (no refusal, docs/cpu-lane.md, "NIXL push mode") with pull mode's
    environment and shims plus the handshake's longer answer timeout; pull mode keeps vLLM's."""
    from pd_sessions.core import connector_support
    from pd_sessions.core.connectors.nixl import HANDSHAKE

    push = cfg(name="1x1", connector="nixl_push")
    assert NIXL_PUSH.limits.refuse(push, "cpu") is None
    connector_support.check(push, "cpu")
    connector_support.check(push, "cuda")
    env = dict(NIXL_PUSH.cpu_lane.env)
    assert env == {**dict(NIXL.cpu_lane.env), HANDSHAKE.env: "20"}
    assert HANDSHAKE.env not in dict(NIXL.cpu_lane.env)
    assert set(NIXL.cpu_lane.shims) < set(NIXL_PUSH.cpu_lane.shims)
    assert any("20 s" in s and HANDSHAKE.env in s for s in NIXL_PUSH.cpu_lane.shims)


@pytest.mark.procs
def test_the_handshake_shim_wraps_what_vllm_uses():
    """What the CPU lane's handshake shim relies on in vLLM's source: the handshake's query opens
    its socket through the worker module's zmq_ctx and sets a fixed 5 s answer timeout; the listener
    opens its own through the scheduler module's; push mode makes the prefill handshake with the
    decode, and a failed handshake there fails nothing (the request is left waiting)."""
    from pd_sessions.core.connectors.nixl import HANDSHAKE

    nixl_dir = ("distributed", "kv_transfer", "kv_connector", "v1", "nixl")
    worker = vllm_source(*nixl_dir, "base_worker.py")
    assert f"sock.setsockopt(zmq.RCVTIMEO, {HANDSHAKE.vllm_ms})" in worker
    assert f"with {HANDSHAKE.socket_factory}(zmq.REQ, path) as sock:" in worker
    assert HANDSHAKE.module.endswith(".base_worker") and HANDSHAKE.listener_module.endswith(".base_scheduler")
    listener = vllm_source(*nixl_dir, "base_scheduler.py")
    assert f"with {HANDSHAKE.socket_factory}(zmq.ROUTER, path) as sock:" in listener
    push = vllm_source(*nixl_dir, "push_worker.py")

    def until_return(failure: str) -> str:
        after = push[push.index(f'failure_type="{failure}"') :]
        return after[: after.index("return")]

    assert "self._failed_recv_reqs.put(rid)" in until_return("push_reg_handshake_failed")  # D fails it
    assert "put(" not in until_return("push_handshake_failed")  # P only logs: D is never told


@pytest.mark.procs
def test_push_mode_is_what_vllm_calls_push():
    """vLLM 0.32's push scheduler answers the prefill hop with transfer_mode "push", and matches
    the decode's registration to the prefill's finished blocks by the request id both hops share
    (so the pair warm-up sends one X-Request-Id on both, as vllm-router does)."""
    nixl_dir = ("distributed", "kv_transfer", "kv_connector", "v1", "nixl")
    assert '_TRANSFER_MODE: str = "push"' in vllm_source(*nixl_dir, "push_scheduler.py")
    worker = vllm_source(*nixl_dir, "push_worker.py")
    assert "get_base_request_id(reg_id) == base_id" in worker
    assert 'logger.exception("nixl-push-writer error; continuing")' in worker


@SPECS
def test_package_variants_cover_cuda_12_13_and_cpu(spec):
    p = spec.package
    assert {12, 13, None} <= set(p.variants) and p.imports and p.native_prefixes
    assert all(d == d.lower() and " " not in d for d in p.distributions)
    assert p.requirement in p.distributions
    assert p.built_for(p.variants[13]) == 13


@SPECS
def test_the_cpu_lanes_warnings_and_env(spec):
    assert isinstance(spec.cpu_lane.warnings(cfg(connector=spec.name)), tuple)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in spec.cpu_lane.env)
    assert MOONCAKE.cpu_lane.warnings(cfg(mooncake_protocol="rdma")) and not MOONCAKE.cpu_lane.warnings(
        cfg(mooncake_protocol="tcp")
    )


def test_only_mooncake_asks_the_host_for_rdma():
    none = Inventory(gpus=("0",), cpus=(0,), rdma_devices=())
    c = cfg(mooncake_protocol="rdma")
    refusal = MOONCAKE.limits.host_refusal((c,), "cuda", none)
    assert refusal is not None and refusal.field == "mooncake_protocol"
    assert NIXL.limits.host_refusal((cfg(connector="nixl"),), "cuda", none) is None


# ---------------------------------------------------------------- a sweep file per connector


@SPECS
def test_each_connector_has_its_sweep_over_it(spec):
    path = CONFIG_DIR / f"{spec.sweep}.toml"
    assert path.exists(), f"add {path.relative_to(CONFIG_DIR.parent.parent)} (the connector's sweep)"
    assert tomllib.loads(path.read_text())["name"] == spec.sweep
    sweep = load(spec.sweep)
    cpu = sweep.entries("cpu")
    assert {e.config.connector for p in sweep.platforms for e in sweep.entries(p)} == {spec.name}
    assert [e.config.name for e in cpu if "cpu" in e.default_on] == ["1x1"]  # the CPU lane's default
