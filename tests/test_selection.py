"""core.selection: the one selection the CLI and the noxfile both make, row by row of its table."""

from __future__ import annotations

import pytest

from pd_sessions.core import preflight
from pd_sessions.core.cliargs import sweep_parser
from pd_sessions.core.errors import ConfigError, PlanError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.selection import only_names, overrides, select_run

CPUS = Inventory(gpus=(), cpus=(0, 1), gpu_source="test")
NO_RDMA = Inventory(gpus=("0", "1"), cpus=(0, 1), gpu_source="test", rdma_devices=())


def args(*argv: str):
    return sweep_parser(positional=False).parse_args(list(argv))


def test_only_names_split_commas_and_drop_empties():
    assert only_names(["a,b", "c", ",", ""]) == ("a", "b", "c")


def test_overrides_take_every_named_option(monkeypatch):
    over = overrides(args("--model", "m", "--mooncake-protocol", "tcp", "--mooncake-device-name", "mlx5_0"))
    assert over.describe() == [
        "model = 'm'",
        "mooncake_protocol = 'tcp'",
        "mooncake_device_name = 'mlx5_0'",
    ]
    assert overrides(args("--mooncake-device-name", "")).describe() == []  # "" = not given


def test_a_selection_applies_the_overrides_to_selected_and_left_out_configs():
    sel = select_run("mooncake_sweep", args("--set", "block_size=64", "--platform", "cpu"), CPUS)
    assert sel.platform == "cpu" and sel.inv == CPUS and sel.note is None and sel.warnings == ()
    assert [c.name for c in sel.configs] == ["1x1"] and sel.only == ()
    assert {c.block_size for c in sel.configs} == {64}
    assert {e.config.block_size for e in sel.left_out} == {64} and len(sel.left_out) == 5
    sel = select_run("mooncake_sweep", args("--only", "2x2,1x1", "--platform", "cpu"), CPUS)
    assert [c.name for c in sel.configs] == ["1x1", "2x2"] and sel.only == ("2x2", "1x1")


@pytest.mark.parametrize(
    "argv,error,needle",
    [
        (("--set", "blok_size=1"), ConfigError, 'did you mean "block_size"'),
        (("--only", "3x3"), ConfigError, "--only: no config named '3x3'"),
        (("--platform", "cuda"), ConfigError, "no GPU is visible"),
    ],
)
def test_refusals_name_the_field(argv, error, needle):
    with pytest.raises(error, match=needle):
        select_run("mooncake_sweep", args(*argv), CPUS)
    with pytest.raises(ConfigError, match="did you mean"):
        select_run("mooncake_swep", args(), CPUS)


def test_rdma_without_a_device_is_refused_unless_it_is_a_dry_run():
    rdma = ("--only", "1x1", "--mooncake-protocol", "rdma")
    with pytest.raises(PlanError) as e:
        select_run("mooncake_sweep", args(*rdma), NO_RDMA)
    assert e.value.field == "mooncake_protocol" and "this host has none" in str(e.value)
    sel = select_run("mooncake_sweep", args(*rdma, "--dry-run"), NO_RDMA)
    assert len(sel.warnings) == 1 and "--mooncake-protocol tcp" in sel.warnings[0]
    assert select_run("mooncake_sweep", args(*rdma, "--platform", "cpu"), NO_RDMA).warnings == ()


def test_a_dry_run_plans_a_gpu_sweep_with_assumed_gpus():
    sel = select_run("kimi_linear_nightly", args("--dry-run"), CPUS)
    assert sel.platform == "cuda" and sel.inv.gpus == ("0", "1", "2", "3") and "dry run:" in (sel.note or "")
    with pytest.raises(PlanError, match="needs 4 GPUs"):
        select_run("kimi_linear_nightly", args(), CPUS)


@pytest.mark.parametrize(
    "model,path_like",
    [
        ("/a/path/that/does/not/exist", True),
        ("./models/x", True),
        ("../x", True),
        ("~/models/x", True),
        ("Qwen/Qwen3-0.6B", False),
        ("tiny-llama", False),
        ("somedir", True),  # an existing relative directory (is_dir says so below)
    ],
)
def test_path_like_models(model, path_like):
    assert (preflight.path_like(model, is_dir=lambda p: p == "somedir") is not None) is path_like


def test_a_path_like_model_that_does_not_exist_is_refused_before_launch_naming_it(tmp_path):
    missing = str(tmp_path / "not" / "there")
    with pytest.raises(ConfigError) as e:
        select_run("mooncake_sweep", args("--model", missing, "--platform", "cpu"), CPUS)
    assert e.value.exit_status == 2 and e.value.field == "--model"
    assert missing in str(e.value) and "does not exist" in str(e.value) and "Qwen/Qwen3-0.6B" in str(e.value)
    sel = select_run("mooncake_sweep", args("--model", missing, "--platform", "cpu", "--dry-run"), CPUS)
    assert len(sel.warnings) == 1 and missing in sel.warnings[0]
    # an existing directory, a hub id (not looked up) and a generated model all pass
    for model in (str(tmp_path), "Qwen/Qwen3-0.6B", "tiny-llama"):
        assert select_run("mooncake_sweep", args("--model", model, "--platform", "cpu"), CPUS).warnings == ()


def test_a_missing_model_path_in_the_sweep_file_names_the_file(tmp_path):
    toml = tmp_path / "s.toml"
    toml.write_text('name = "s"\n[defaults]\nmodel = "./no/such/model"\n[[config]]\nname = "a"\n')
    with pytest.raises(ConfigError) as e:
        select_run(str(toml), args("--platform", "cpu"), CPUS)
    assert e.value.field == "model" and str(toml) in str(e.value) and "'./no/such/model'" in str(e.value)


def test_check_adds_checks_to_the_sweeps_own_in_running_order():
    from pd_sessions.core import check_registry

    digest = check_registry.KV_DIGEST  # a default on the CPU lane, and last in running order
    sel = select_run("mooncake_sweep", args("--platform", "cpu"), CPUS)
    assert (
        sel.checks
        == (*check_registry.DEFAULTS[:-1], digest, "conservation")
        == check_registry.defaults("cpu")
    )
    sel = select_run("mooncake_sweep", args("--platform", "cpu", "--check", "fault_zero,fault_drop"), CPUS)
    # conservation, a default, runs last: it judges the probes after every check before it
    assert sel.checks == (*check_registry.DEFAULTS[:-1], "fault_drop", "fault_zero", digest, "conservation")
    sel = select_run(
        "mooncake_sweep", args("--platform", "cpu", "--check", "faults", "--check", "smoke"), CPUS
    )
    assert sel.checks == (*check_registry.DEFAULTS[:-1], *check_registry.FAULTS, digest, "conservation")
    said = r"--check: unknown check 'fault_zeros' \(did you mean \"fault_zero\"\?\)"
    with pytest.raises(ConfigError, match=said):
        select_run("mooncake_sweep", args("--platform", "cpu", "--check", "fault_zeros"), CPUS)
    with pytest.raises(ConfigError, match="fault_peer_death needs fault_restart after it"):
        select_run("mooncake_sweep", args("--platform", "cpu", "--check", "fault_peer_death"), CPUS)


def test_fault_checks_wrap_the_connectors_with_a_control_file_in_the_configs_results(tmp_path):
    from pd_sessions.run.sweep_options import SweepOptions, faults_control

    sel = select_run("faults", args("--platform", "cpu"), CPUS)
    assert [c.name for c in sel.configs] == ["mooncake", "nixl"]
    assert [c.kv_load_failure_policy for c in sel.configs] == ["fail", "recompute"]
    opts = SweepOptions(platform="cpu", results_dir=tmp_path, selected_checks=sel.checks)
    assert faults_control(sel.configs[0], opts) == str(tmp_path / "mooncake" / "faults.json")
    plain = SweepOptions(platform="cpu", results_dir=tmp_path)
    assert faults_control(sel.configs[0], plain) is None
