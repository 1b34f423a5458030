from __future__ import annotations

from pathlib import Path

import pytest
from helpers.builders import cfg

from pd_sessions.core.config import (
    ClusterConfig,
    builtin_sweep,
    load_sweep,
    make_overrides,
    parse_value,
    select,
)
from pd_sessions.core.errors import ConfigError


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("prefill_tp", 0, "prefill_tp: got 0; allowed: an integer from 1 to 8"),
        ("decode_tp", 9, "decode_tp: got 9; allowed: an integer from 1 to 8"),
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization: got 1.5; allowed: a number in (0, 1]"),
        ("gpu_memory_utilization", 0, "gpu_memory_utilization: got 0"),
        (
            "connector",
            "mooncak",
            "connector: got 'mooncak'; allowed: mooncake, nixl, nixl_push (did you mean \"mooncake\"?)",
        ),
        ("mooncake_protocol", "udp", "mooncake_protocol: got 'udp'; allowed: rdma, tcp"),
        ("num_decode", True, "num_decode: got True"),
        ("router_port", 80, "router_port: got 80; allowed: an integer from 1024 to 65535"),
        (
            "prefill_ports",
            (9000, 9001),
            "prefill_ports: got 2 ports [9000, 9001]; allowed: none (allocate) or exactly 1",
        ),
        ("dtype", "fp8", "dtype: got 'fp8'"),
        ("name", "a b", "name: got 'a b'"),
        ("extra_args", "--enforce-eager", "extra_args: got '--enforce-eager'; allowed: a list of strings"),
        (
            "kv_load_failure_policy",
            "retry",
            "kv_load_failure_policy: got 'retry'; allowed: fail, recompute",
        ),
    ],
)
def test_validation_names_field_value_and_range(field, value, needle):
    with pytest.raises(ConfigError) as e:
        cfg(**{field: value})
    assert needle in str(e.value)
    assert e.value.field == field
    assert e.value.exit_status == 2


def test_duplicate_explicit_ports_rejected():
    with pytest.raises(ConfigError, match=r"port\(s\) \[9000\] used more than once"):
        cfg(router_port=9000, decode_ports=(9000,))


def test_config_is_frozen():
    c = cfg()
    with pytest.raises(AttributeError):
        c.prefill_tp = 2  # type: ignore[misc]


def test_builtin_mooncake_sweep_is_data():
    sweep = builtin_sweep("mooncake_sweep")
    cuda = {e.config.name: e.config for e in sweep.entries("cuda")}
    assert set(cuda) == {"1x1", "2x2", "1x2", "2x1", "2p1d", "1p2d"}
    assert (cuda["1x2"].prefill_tp, cuda["1x2"].decode_tp) == (1, 2)
    assert (cuda["2p1d"].num_prefill, cuda["2p1d"].num_decode) == (2, 1)
    assert cuda["2x2"].prefill_tp == cuda["2x2"].decode_tp == 2
    assert all(c.gpu_memory_utilization == 0.6 for c in cuda.values())
    assert all(c.model == "Qwen/Qwen3-0.6B" and c.connector == "mooncake" for c in cuda.values())
    cpu = {e.config.name: e for e in sweep.entries("cpu")}
    assert all(e.config.model == "tiny-llama" for e in cpu.values())
    assert "cpu" not in cpu["2x2"].default_on and cpu["2x2"].opt_in_reason


def test_unknown_sweep_suggests():
    with pytest.raises(ConfigError, match='did you mean "mooncake_sweep"'):
        builtin_sweep("mooncake_swep")


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


def test_loader_names_file_and_unknown_field(tmp_path):
    p = write(tmp_path, 'name="s"\n[defaults]\nmodel="m"\n[[config]]\nname="a"\nprefil_tp=2\n')
    with pytest.raises(ConfigError) as e:
        load_sweep(p)
    msg = str(e.value)
    assert str(p) in msg and "[[config]] #1" in msg
    assert "prefil_tp: unknown field" in msg and 'did you mean "prefill_tp"' in msg


def test_loader_bad_value_names_file_and_config(tmp_path):
    p = write(
        tmp_path, 'name="s"\n[defaults]\nmodel="m"\n[[config]]\nname="a"\n[[config]]\nname="b"\ndecode_tp=0\n'
    )
    with pytest.raises(ConfigError, match=r"s\.toml \[\[config\]\] #2: decode_tp: got 0"):
        load_sweep(p)


@pytest.mark.parametrize(
    "toml,field,expects",
    [
        ('name="s"\n[[config]]\nname="a"\n', "model", ["a hub id", "tiny-llama", "[defaults]"]),
        ('name="s"\n[defaults]\nmodel="m"\n[[config]]\nprefill_tp=1\n', "name", ['name = "1x1"']),
        ('name="s"\n[[config]]\nconnector="nixl"\n', "name, model", ["name: a short", "model: the model"]),
    ],
)
def test_a_missing_required_field_is_named_with_what_it_expects(tmp_path, toml, field, expects):
    with pytest.raises(ConfigError) as e:
        load_sweep(write(tmp_path, toml))
    msg = str(e.value)
    assert f"[[config]] #1: {field}: missing; every config needs" in msg and e.value.exit_status == 2
    assert all(x in msg for x in expects), msg
    assert "__init__" not in msg and "positional argument" not in msg


def test_every_field_without_a_default_is_in_the_required_table():
    import dataclasses

    from pd_sessions.core.config import REQUIRED

    no_default = [
        f.name
        for f in dataclasses.fields(ClusterConfig)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    assert no_default == list(REQUIRED)


def test_a_sweep_without_a_name_says_what_it_expects(tmp_path):
    with pytest.raises(ConfigError, match=r'name: missing; a sweep needs a name .* e\.g\. name = "my_sweep"'):
        load_sweep(write(tmp_path, '[defaults]\nmodel="m"\n[[config]]\nname="a"\n'))


def test_loader_requires_reason_for_opt_in(tmp_path):
    p = write(tmp_path, 'name="s"\n[defaults]\nmodel="m"\n[[config]]\nname="a"\ndefault_on=["cuda"]\n')
    with pytest.raises(ConfigError, match="opt_in_reason"):
        load_sweep(p)


def test_loader_platform_override_and_lists(tmp_path):
    p = write(
        tmp_path,
        'name="s"\n[defaults]\nmodel="m"\nextra_args=["--enforce-eager"]\n'
        '[defaults.extra_env]\nA="1"\n[platform.cpu]\nmodel="tiny-llama"\n'
        '[[config]]\nname="a"\n',
    )
    s = load_sweep(p)
    assert s.entries("cuda")[0].config.model == "m"
    assert s.entries("cpu")[0].config.model == "tiny-llama"
    assert s.entries("cpu")[0].config.extra_args == ("--enforce-eager",)
    assert s.entries("cpu")[0].config.extra_env == (("A", "1"),)


def test_select_decision_table():
    s = builtin_sweep("mooncake_sweep")
    names = lambda es: [e.config.name for e in es]
    sel, left = select(s.entries("cpu"), "cpu")
    opt_in = ["2x2", "1x2", "2x1", "2p1d", "1p2d"]
    assert names(sel) == ["1x1"] and names(left) == opt_in
    sel, left = select(s.entries("cpu"), "cpu", include_opt_in=True)
    assert names(sel) == ["1x1", *opt_in] and not left
    sel, left = select(s.entries("cuda"), "cuda")
    assert names(sel) == ["1x1", *opt_in]
    sel, left = select(s.entries("cpu"), "cpu", only=("2x2",))
    assert names(sel) == ["2x2"] and names(left) == ["1x1", *opt_in[1:]]
    with pytest.raises(ConfigError, match="no config named '3x3'"):
        select(s.entries("cpu"), "cpu", only=("3x3",))


# ------------------------------------------------------------ per-run overrides


@pytest.mark.parametrize(
    "raw,value",
    [
        ("16", 16),
        ("0.8", 0.8),
        ("true", True),
        ('["--a", "b"]', ["--a", "b"]),
        ("FLASHINFER", "FLASHINFER"),
        ('"16"', "16"),
        ('{A = "1"}', {"A": "1"}),
        ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B"),
    ],
)
def test_set_values_are_read_like_toml(raw, value):
    assert parse_value(raw) == value


def test_overrides_apply_in_order_and_are_checked_like_the_toml():
    base = ClusterConfig(name="1x1", model="m", extra_args=("--x",))
    over = make_overrides(
        sets=[
            "gpu_memory_utilization=0.8",
            "block_size=16",
            "attention_backend=FLASHINFER",
            'extra_env={A = "1"}',
        ],
        model="/models/tiny",
        revision="abc",
        extra_args=["--enforce-eager", "--max-num-seqs=4"],
    )
    c = over.apply(base)
    assert (c.model, c.revision, c.gpu_memory_utilization, c.block_size, c.attention_backend) == (
        "/models/tiny",
        "abc",
        0.8,
        16,
        "FLASHINFER",
    )
    assert c.extra_args == ("--x", "--enforce-eager", "--max-num-seqs=4") and c.extra_env == (("A", "1"),)
    assert c.name == "1x1"
    assert over.describe() == [
        "model = '/models/tiny'",
        "revision = 'abc'",
        "gpu_memory_utilization = 0.8",
        "block_size = 16",
        "attention_backend = 'FLASHINFER'",
        "extra_env = {'A': '1'}",
        "extra_args += '--enforce-eager'",
        "extra_args += '--max-num-seqs=4'",
    ]
    assert not make_overrides() and make_overrides().apply(base) is base


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"sets": ["block_siz=16"]}, 'block_siz: unknown field (did you mean "block_size"?)'),
        ({"sets": ["name=x"]}, "name: cannot be overridden; select configs with --only"),
        ({"sets": ["block_size"]}, "--set: got 'block_size'; expected FIELD=VALUE"),
        ({"sets": ["=3"]}, "expected FIELD=VALUE"),
        ({"extra_args": [""]}, "--extra-arg: got ''"),
    ],
)
def test_bad_overrides_name_the_field(kw, needle):
    with pytest.raises(ConfigError) as e:
        make_overrides(**kw)
    assert needle in str(e.value) and str(e.value).startswith("command line: ")


@pytest.mark.parametrize(
    "sets,needle",
    [
        (["block_size=abc"], "block_size: got 'abc'; allowed: an integer"),
        (["gpu_memory_utilization=1.5"], "gpu_memory_utilization: got 1.5; allowed: a number in (0, 1]"),
        (["dtype=bf16"], 'did you mean "bfloat16"'),
        (["connector=mooncak"], 'did you mean "mooncake"'),
        (['extra_args="--a"'], "extra_args: got '--a'; allowed: a list"),
    ],
)
def test_bad_override_values_fail_when_applied_like_the_toml(sets, needle):
    with pytest.raises(ConfigError) as e:
        make_overrides(sets=sets).apply(ClusterConfig(name="1x1", model="m"))
    assert needle in str(e.value) and "command line" in str(e.value)
