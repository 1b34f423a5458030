from __future__ import annotations

import dataclasses
import sys

import pytest
from helpers.builders import cfg
from helpers.needs import package_dir

from pd_sessions.core import connector_support, connectors
from pd_sessions.core.connectors.base import Refusal
from pd_sessions.core.errors import PlanError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan import plan_cluster
from pd_sessions.runtime.ports import PortAllocator


@pytest.mark.parametrize("connector", connectors.names())
@pytest.mark.parametrize("p,d", [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 8)])
def test_dividing_tp_sizes_and_xpyd_are_accepted(connector, p, d):
    connector_support.check(cfg(connector=connector, prefill_tp=p, decode_tp=d))
    connector_support.check(cfg(connector=connector, num_prefill=2, num_decode=3))


@pytest.mark.parametrize("connector", connectors.names())
def test_tp_sizes_that_do_not_divide_are_refused_naming_connector_and_pair(connector):
    with pytest.raises(PlanError) as e:
        connector_support.check(cfg(name="odd", connector=connector, prefill_tp=2, decode_tp=3))
    msg = str(e.value)
    assert f"odd: connector {connector} cannot map prefill TP2 + decode TP3" in msg
    assert "one TP size must divide the other" in msg and e.value.field == "decode_tp"


def test_a_connector_without_heterogeneous_tp_is_refused(monkeypatch):
    """The limits are the spec's data: a connector that says it cannot is refused by name."""
    nixl = connectors.get("nixl")
    swap = lambda **kw: monkeypatch.setitem(
        connectors._BY_NAME, "nixl", dataclasses.replace(nixl, limits=dataclasses.replace(nixl.limits, **kw))
    )
    swap(hetero_tp=False)
    with pytest.raises(
        PlanError,
        match="connector nixl does not support heterogeneous TP "
        r"\(prefill TP1 \+ decode TP2\)",
    ):
        connector_support.check(cfg(connector="nixl", prefill_tp=1, decode_tp=2))
    swap(many_per_role=False)
    with pytest.raises(PlanError, match=r"several instances per role \(2P1D\)"):
        connector_support.check(cfg(connector="nixl", num_prefill=2))


def test_a_connector_that_refuses_a_platform_is_refused_before_anything_is_planned(monkeypatch):
    nixl = connectors.get("nixl")
    no_cpu = lambda config, platform: (
        Refusal("connector", "not on the CPU lane") if platform == "cpu" else None
    )
    limits = dataclasses.replace(nixl.limits, refuse=no_cpu)
    monkeypatch.setitem(connectors._BY_NAME, "nixl", dataclasses.replace(nixl, limits=limits))
    with pytest.raises(PlanError, match="connector: not on the CPU lane"):
        connector_support.check(cfg(connector="nixl"), "cpu")
    connector_support.check(cfg(connector="nixl"), "cuda")
    connector_support.check(cfg(connector="nixl"))  # no platform: not asked


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


# ---------------------------------------------------------------- known limits of a vLLM release

KIMI = {"name": "kimi", "model": "tiny-kimi-linear", "hybrid": True, "moe": True, "connector": "nixl"}


@pytest.mark.parametrize(
    "kw, version, refused",
    [
        ({"prefill_tp": 2, "decode_tp": 1, "decode_dp": 2}, "0.26.0", True),  # the nightly's shape
        ({"prefill_tp": 2, "decode_tp": 1}, "0.26.0", True),
        ({"prefill_tp": 2, "decode_tp": 1}, "0.27.0", False),  # fixed upstream
        ({"prefill_tp": 2, "decode_tp": 1}, "0.32.0", False),
        ({"prefill_tp": 2, "decode_tp": 1}, "0.27.0rc1.dev5+g1234", True),  # before the release
        ({"prefill_tp": 1, "decode_tp": 1, "decode_dp": 2}, "0.26.0", False),  # ran on the H200s
        ({"prefill_tp": 1, "decode_tp": 2}, "0.26.0", False),
        ({"prefill_tp": 2, "decode_tp": 1, "connector": "mooncake"}, "0.26.0", False),
        ({"prefill_tp": 2, "decode_tp": 1}, None, False),  # unknown: vLLM will say
        ({"prefill_tp": 2, "decode_tp": 1}, "not-a-version", False),
    ],
)
def test_hybrid_mla_higher_prefill_tp_is_refused_on_vllm_before_0_27(kw, version, refused):
    c = cfg(**{**KIMI, **kw})
    problem = connector_support.vllm_problem(c, version, hybrid_mla=connector_support.is_hybrid_mla(c))
    assert bool(problem) is refused
    if refused:
        assert problem is not None
        assert f"vLLM {version}" in problem and "prefill TP2 into decode TP1" in problem
        assert "vllm-project/vllm#49297" in problem and "--set prefill_tp=1" in problem


def test_hybrid_mla_is_a_known_name_or_a_kimi_linear_style_config():
    assert connector_support.is_hybrid_mla(cfg(model="moonshotai/Kimi-Linear-48B-A3B-Instruct"))
    local = {"linear_attn_config": {"kda_layers": [1]}, "kv_lora_rank": 512}
    assert connector_support.is_hybrid_mla(cfg(model="/models/k", hybrid=True), local)
    assert not connector_support.is_hybrid_mla(cfg(model="/models/k", hybrid=False), local)
    # a hybrid without MLA (GDN + ordinary attention, e.g. Qwen3-Next) reads per rank already
    assert not connector_support.is_hybrid_mla(
        cfg(model="/models/q", hybrid=True), {"linear_attn_config": {}, "num_key_value_heads": 2}
    )
    assert not connector_support.is_hybrid_mla(cfg(model="tiny-llama"))


def test_the_cli_refuses_before_launch_and_only_warns_on_a_dry_run(tmp_path):
    from types import SimpleNamespace

    from pd_sessions.run import launch

    model = tmp_path / "kimi"
    model.mkdir()
    (model / "config.json").write_text('{"linear_attn_config": {"kda_layers": [1]}, "kv_lora_rank": 512}')
    c = cfg(name="k", model=str(model), hybrid=True, moe=True, connector="nixl", prefill_tp=2, decode_dp=2)
    sel = SimpleNamespace(
        configs=[c],
        platform="cuda",
        inv=Inventory(gpus=("0", "1"), cpus=(0, 1), gpu_source="test"),
        warnings=(),
    )
    env = {"modules": {"vllm": {"version": "0.26.0"}}}
    with pytest.raises(PlanError) as e:
        launch.refuse_before_launch(sel, env, dry_run=False)  # type: ignore[arg-type]
    assert e.value.field == "prefill_tp" and "vLLM 0.26.0 cannot pull KV over NIXL" in str(e.value)
    warnings = launch.refuse_before_launch(sel, env, dry_run=True)  # type: ignore[arg-type]
    assert "WARNING: k: vLLM 0.26.0 cannot pull KV" in "\n".join(warnings)  # the banner prints them
    env = {"modules": {"vllm": {"version": "0.32.0"}}}
    launch.refuse_before_launch(sel, env, dry_run=False)  # type: ignore[arg-type]


# ---------------------------------------------------------------- a vLLM without the connector


FACTORY = """KVConnectorFactory.register_connector(
    "NixlConnector",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
    "NixlConnector",
)
"""


def test_a_vllm_whose_factory_lacks_the_connector_is_refused_naming_it_and_where_it_came():
    push = cfg(name="p", connector="nixl_push")
    problem = connector_support.vllm_lacks_connector(push, FACTORY, "0.26.0")
    assert problem is not None
    assert "p: the installed vLLM 0.26.0 does not register NixlPushConnector" in problem
    assert "vllm-project/vllm#35264" in problem
    assert connector_support.vllm_lacks_connector(cfg(connector="nixl"), FACTORY, "0.26.0") is None
    assert connector_support.vllm_lacks_connector(push, None, None) is None  # not known: vLLM will say


def test_launch_reads_the_installed_vllms_factory(tmp_path):
    """The refusal before launch reads the factory of the vLLM envfacts found; a dry run warns."""
    from types import SimpleNamespace

    from pd_sessions.run import launch

    vllm_dir = tmp_path / "vllm"
    (vllm_dir / launch.FACTORY).parent.mkdir(parents=True)
    (vllm_dir / launch.FACTORY).write_text(FACTORY)
    sel = SimpleNamespace(configs=[cfg(name="p", connector="nixl_push")], warnings=())
    env = {"modules": {"vllm": {"version": "0.26.0", "location": str(vllm_dir)}}}
    with pytest.raises(PlanError) as e:
        launch.refuse_before_launch(sel, env, dry_run=False)  # type: ignore[arg-type]
    assert e.value.field == "connector" and "does not register NixlPushConnector" in str(e.value)
    assert "WARNING: p: the installed vLLM" in "\n".join(launch.refuse_before_launch(sel, env, dry_run=True))  # type: ignore[arg-type]
    (vllm_dir / launch.FACTORY).write_text(FACTORY.replace('"NixlConnector"', '"NixlPushConnector"', 1))
    assert launch.refuse_before_launch(sel, env, dry_run=False) == []  # type: ignore[arg-type]


@pytest.mark.procs
def test_the_vllm_here_registers_every_connector():
    """The CPU lane's vLLM (its installed factory, as launch reads it) has every registered one."""
    from pd_sessions.run import launch

    source = launch._factory_source(str(package_dir("vllm")))
    assert source is not None
    for name in connectors.names():
        assert connector_support.vllm_lacks_connector(cfg(connector=name), source, "here") is None, name
