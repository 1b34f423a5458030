"""The subcommands: the CLI's dispatch table, what sweep and serve share (run/launch.py), and the
sweep's pure parts (lane, banner, metadata: run/sweep_banner.py, its options: run/sweep.py);
nothing here starts a cluster."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import pytest

from pd_sessions import cli
from pd_sessions.core.errors import ConfigError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.selection import select_run
from pd_sessions.run import launch, sweep_banner
from pd_sessions.run import sweep as sweep_command
from pd_sessions.run.user_commands import parse_exec
from pd_sessions.runtime.cluster import DEFAULT_DEADLINE_S, DEFAULT_GRACE_S

CPUS = Inventory(gpus=(), cpus=(0, 1, 2, 3), gpu_source="nvidia-smi")
GPUS = Inventory(gpus=("0", "1"), cpus=(0, 1), gpu_source="CUDA_VISIBLE_DEVICES", rdma_devices=())
ENV = {"python": {"version": "3.11.9", "executable": "/py"}, "torch": None, "modules": {"vllm": None}}


def parse(*argv: str) -> argparse.Namespace:
    return cli._parser().parse_args(list(argv))


def test_every_subcommand_names_a_function_that_exists():
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(sub.choices) == sorted(
        [
            "sweep",
            "serve",
            "soak",
            "tiny-model",
            "inventory",
            "bench",
            "bench-report",
            "perf-baseline",
            "wheelhouse",
            "buildkite",
            "report",
            "recall",
        ]
    )
    assert sorted(cli.COMMANDS) == sorted(sub.choices)
    for name, (module, function, _call) in cli.COMMANDS.items():
        fn = getattr(importlib.import_module(module), function)
        assert callable(fn) and fn.__module__.startswith("pd_sessions."), name
        assert callable(cli._command(name))
    assert cli.COMMANDS["sweep"][:2] == ("pd_sessions.run.sweep", "run")
    assert cli.COMMANDS["serve"][:2] == ("pd_sessions.run.serve", "run")


def test_the_inventory_command_prints_what_the_machine_module_detects(capsys):
    assert cli._command("inventory")(parse("inventory")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cpus"] and doc["platform"] in ("cpu", "cuda") and "gpu_source" in doc


@pytest.mark.parametrize(
    "platform,requested,inv,line",
    [
        (
            "cpu",
            "cpu",
            CPUS,
            "CPU LANE (forced by --platform cpu): vLLM's CPU build, the generated tiny model, 4 cores",
        ),
        ("cpu", None, CPUS, "CPU LANE (no GPU visible (GPU source: nvidia-smi)): vLLM's CPU build"),
        ("cuda", None, GPUS, "CUDA: GPUs 0,1 (from CUDA_VISIBLE_DEVICES)"),
    ],
)
def test_the_lane_line(platform, requested, inv, line):
    assert sweep_banner.lane(platform, requested, inv).startswith(line)


def test_the_banner_says_everything_in_order():
    args = parse(
        *("sweep", "mooncake_sweep", "--platform", "cpu", "--set", "block_size=64"),
        *("--skip-check", "accuracy", "--accuracy", "warn", "--allow-unpinned-remote-code"),
    )
    sel = select_run("mooncake_sweep", args, CPUS)
    commands = [parse_exec("true -x", 0)]
    lines = sweep_banner.banner(args, sel, ENV, ["smoke", "exec[0]"], commands, ["WARNING: w"])
    assert lines[0].startswith("mooncake_sweep: CPU LANE (forced by --platform cpu)")
    assert lines[1:4] == [
        "environment: Python 3.11.9 at /py",
        "  torch: not installed",
        "  vllm: not installed",
    ]
    assert lines[4:] == [
        "override (command line): block_size = 64",
        "WARNING: w",
        "checks skipped by request (--skip-check): accuracy; recorded in summary.json",
        "accuracy: --accuracy=warn: misses and missing baselines are reported, not failed",
        "remote code: --allow-unpinned-remote-code given: configs with trust_remote_code and no revision "
        "run UNPINNED (recorded in the results)",
        "configs: 1x1",
        "checks: smoke, exec[0]",
        "NOT RUN fails: smoke (the sweep's required checks)",
        "after the checks, each config runs exec[0]: true -x (timeout 3600 s)",
        *(
            f"left out: {e.config.name} ({e.config.shape}): {e.opt_in_reason}; run it with --include-opt-in"
            for e in sel.left_out
        ),
    ]
    assert len(sel.left_out) == 5


def test_the_banner_with_only_says_what_only_left_out():
    args = parse("sweep", "mooncake_sweep", "--platform", "cpu", "--only", "1x1,2x2")
    sel = select_run("mooncake_sweep", args, CPUS)
    lines = sweep_banner.banner(args, sel, ENV, ["smoke"], [], [])
    assert "configs: 1x1, 2x2" in lines
    assert "left out: 1x2 (1xP(TP1) + 1xD(TP2)): not named by --only" in lines
    assert not any("skipped" in line or "accuracy" in line or "remote code" in line for line in lines)


def test_the_metadata_recorded_in_the_summary():
    args = parse("sweep", "mooncake_sweep", "--platform", "cpu", "--skip-check", "accuracy", "--model", "m")
    sel = select_run("mooncake_sweep", args, CPUS)
    meta = sweep_banner.metadata(args, sel, ENV, ["smoke", "parity"])
    assert meta["sweep"] == "mooncake_sweep" and meta["platform"] == "cpu" and meta["cpus"] == 4
    assert meta["checks"] == ["smoke", "parity"] and meta["hostname"]  # the page's columns and host
    assert (
        meta["gpus"] == [] and meta["skipped_checks"] == ["accuracy"] and meta["accuracy_mode"] == "enforce"
    )
    assert meta["overrides"] == ["model = 'm'"] and meta["environment"] is ENV
    assert meta["allow_unpinned_remote_code"] is False
    assert [e["name"] for e in meta["left_out"]] == ["2x2", "1x2", "2x1", "2p1d", "1p2d"]
    assert all(e["reason"] for e in meta["left_out"])


def test_sweep_and_serve_build_their_options_in_one_place(tmp_path):
    args = parse("sweep", "mooncake_sweep", "--platform", "cpu", "--grace", "3", "--skip-check", "accuracy")
    sel = select_run("mooncake_sweep", args, CPUS)
    checks = sweep_command.check_options(args, sel, [])
    opts = launch.run_options(args, sel, results_name=sel.sweep.name, **checks)
    assert opts.platform == "cpu" and opts.grace_s == 3.0 and opts.deadline_s == DEFAULT_DEADLINE_S
    assert opts.skip_checks == ("accuracy",) and "accuracy" not in opts.checks
    assert opts.results_dir.parent == Path("results").resolve()
    assert opts.results_dir.name.startswith("mooncake_sweep-")
    served = parse(
        "serve", "mooncake_sweep", "--only", "1x1", "--deadline", "60", "--results-dir", str(tmp_path)
    )
    sel = select_run("mooncake_sweep", served, CPUS)
    opts = launch.run_options(served, sel, results_name=f"serve-{sel.sweep.name}")
    assert opts.results_dir == tmp_path and opts.deadline_s == 60.0 and opts.grace_s == DEFAULT_GRACE_S
    assert opts.skip_checks == () and opts.commands == ()
    opts = launch.run_options(parse("serve", "mooncake_sweep"), sel, results_name="serve-mooncake_sweep")
    assert opts.results_dir.name.startswith("serve-mooncake_sweep-")


def test_a_dry_run_warns_of_what_the_selection_refuses_without_it():
    rdma = Inventory(gpus=("0", "1"), cpus=(0, 1), gpu_source="test", rdma_devices=())
    args = parse("sweep", "mooncake_sweep", "--only", "1x1", "--set", "mooncake_protocol=rdma", "--dry-run")
    sel = select_run("mooncake_sweep", args, rdma)
    warnings = launch.refuse_before_launch(sel, {"modules": {"vllm": {"version": "0.32.0"}}}, dry_run=True)
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: config 1x1: Mooncake over RDMA")
    assert warnings[0] in launch.setup_lines(sel, ENV, warnings)


def test_set_a_checks_option_reaches_the_run_and_the_recorded_overrides():
    """`--set check_options.CHECK.OPTION=VALUE` is the sweep's [check_options.CHECK] table from the
    command line: it replaces that one option (the rest keep the sweep's values), is recorded
    with the overrides, and a wrong check, option or value is an error naming it."""
    args = parse(
        "sweep", "mooncake_sweep", "--platform", "cpu", "--set", "check_options.wire_loss.rates=[2]",
        "--set", "check_options.too_long.bound_s=3",
    )  # fmt: skip
    sel = select_run("mooncake_sweep", args, CPUS)
    options = sweep_command.check_options(args, sel, [])["check_options"]
    plain = select_run("mooncake_sweep", parse("sweep", "mooncake_sweep", "--platform", "cpu"), CPUS)
    assert options["wire_loss"]["rates"] == (2,) and options["too_long"]["bound_s"] == 3
    assert options["wire_loss"] == {**plain.sweep.check_options["wire_loss"], "rates": (2,)}
    assert plain.sweep.check_options["wire_loss"]["rates"] != (2,)
    assert "check_options.wire_loss.rates = (2,)" in sel.over.describe()
    for item, named in [
        ("check_options.wire_los.rates=[2]", "check_options.wire_los: unknown check"),
        ("check_options.wire_loss.rate=[2]", "check_options.wire_loss.rate: unknown option"),
        ("check_options.wire_loss.rates=[0]", "check_options.wire_loss.rates: got [0]"),
        ("check_options.wire_loss=[2]", "expected check_options.CHECK.OPTION=VALUE"),
    ]:
        with pytest.raises(ConfigError) as e:
            select_run(
                "mooncake_sweep", parse("sweep", "mooncake_sweep", "--platform", "cpu", "--set", item), CPUS
            )
        assert named in str(e.value), (item, str(e.value))
