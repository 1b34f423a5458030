"""``pd-sessions sweep``: run (or --dry-run) a sweep of P/D clusters, configs side by side where
they fit (--max-parallel), else one after another."""

from __future__ import annotations

import argparse
import importlib.util
import socket
import sys
from collections.abc import Sequence
from typing import Any

from pd_sessions import __version__
from pd_sessions.checks.accuracy import AccuracyOptions
from pd_sessions.commands import launch
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import UsageError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan.packing import Packing
from pd_sessions.core.results import ConfigResult
from pd_sessions.core.selection import Selection
from pd_sessions.env.envfacts import facts
from pd_sessions.report import buildkite_annotation, unfinished
from pd_sessions.report.html import PAGE
from pd_sessions.report.writers import table
from pd_sessions.run import user_commands
from pd_sessions.run.ray_hosts import hosts_for, phase_one
from pd_sessions.run.sweep import run_sweep, sweep_packing
from pd_sessions.run.sweep_options import SweepOptions, make_plan
from pd_sessions.runtime import process, reaper
from pd_sessions.runtime.console import say
from pd_sessions.runtime.ports import PortAllocator
from pd_sessions.runtime.raylaunch import RayHosts


def run(args: argparse.Namespace) -> int:
    commands = user_commands.from_cli(
        args.user_commands,
        python=sys.executable,
        dry_run=args.dry_run,
        have_pytest=importlib.util.find_spec("pytest") is not None,
    )
    sel = launch.checked(args)
    env = facts(import_torch=False, full=False)
    warnings = launch.refuse_before_launch(sel, env, dry_run=args.dry_run)
    checks = check_options(args, sel, commands)
    opts = launch.run_options(args, sel, results_name=sel.sweep.name, **checks)
    for line in banner(args, sel, env, opts.checks, commands, warnings):
        say(line)
    if not sel.configs:
        raise UsageError("no config selected: nothing to run")
    packing = sweep_packing(sel.configs, sel.inv, opts, across_hosts=False)  # refuses a bad --max-parallel
    if args.dry_run:
        return dry_run(sel, opts, packing)
    unfinished.check_writable(opts.results_dir)  # exit 2 before anything starts
    say(f"results and logs: {opts.results_dir}")
    results = run_configs(sel, opts, metadata(args, sel, env, opts.checks), upload=args.upload_artifacts)
    failed = [r.name for r in results if r.outcome != "passed"]
    say(
        f"{len(results) - len(failed)}/{len(results)} configs passed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


def check_options(
    args: argparse.Namespace, sel: Selection, commands: Sequence[user_commands.UserCommand]
) -> dict[str, Any]:
    """SweepOptions' check fields, as the command line and the sweep's TOML set them."""
    sweep = sel.sweep
    return {
        "accuracy": AccuracyOptions(
            mode=args.accuracy,
            rule=args.accuracy_rule,
            limit=args.accuracy_limit,
            allow_sample_mismatch=args.allow_sample_mismatch,
            record_baseline=args.record_baseline,
        ),
        "skip_checks": tuple(args.skip_check),
        "commands": tuple(commands),
        "exec_timeout_s": args.exec_timeout,
        "selected_checks": sel.checks or sweep.checks_on(sel.platform),
        "check_options": sweep.check_options,
    }


def lane(platform: str, requested: str | None, inv: Inventory) -> str:
    """The banner's first words after the sweep's name: which lane, and why.

    platform  requested  -> line
    cpu       cpu        -> CPU LANE (forced by --platform cpu): ...
    cpu       other      -> CPU LANE (no GPU visible (GPU source: SOURCE)): ...
    cuda      any        -> CUDA: GPUs 0,1 (from SOURCE)
    """
    if platform != "cpu":
        return f"CUDA: GPUs {','.join(inv.gpus)} (from {inv.gpu_source})"
    forced = requested == "cpu"
    why = "forced by --platform cpu" if forced else f"no GPU visible (GPU source: {inv.gpu_source})"
    return f"CPU LANE ({why}): vLLM's CPU build, the generated tiny model, {len(inv.cpus)} cores"


def banner(
    args: argparse.Namespace,
    sel: Selection,
    env: dict[str, Any],
    checks: Sequence[str],
    commands: Sequence[user_commands.UserCommand],
    warnings: list[str],
) -> list[str]:
    """What the sweep says before it starts: lane, environment, overrides, what is skipped or
    relaxed by request, the configs and checks, the user's commands and what is left out."""
    lines = [f"{sel.sweep.name}: {lane(sel.platform, args.platform, sel.inv)}"]
    lines += launch.setup_lines(sel, env, warnings)
    if args.skip_check:
        lines.append(
            f"checks skipped by request (--skip-check): {', '.join(args.skip_check)}; "
            "recorded in summary.json"
        )
    if args.accuracy == "warn":
        lines.append("accuracy: --accuracy=warn: misses and missing baselines are reported, not failed")
    if args.allow_unpinned_remote_code:
        lines.append(
            "remote code: --allow-unpinned-remote-code given: configs with trust_remote_code and "
            "no revision run UNPINNED (recorded in the results)"
        )
    lines.append(f"configs: {', '.join(c.name for c in sel.configs) or 'none'}")
    lines.append(f"checks: {', '.join(checks)}")
    lines += [
        f"after the checks, each config runs {c.name}: {c.given} (timeout {args.exec_timeout:g} s)"
        for c in commands
    ]
    for e in sel.left_out:
        why = e.opt_in_reason if not sel.only else "not named by --only"
        lines.append(
            f"left out: {e.config.name} ({e.config.shape}): {why}"
            + ("; run it with --include-opt-in" if not sel.only else "")
        )
    return lines


def dry_run(sel: Selection, opts: SweepOptions, packing: Packing) -> int:
    """Print the waves and every plan (on the share of the host its wave gives it), left-out
    configs too (marked, on the whole host), so that each can be reviewed."""
    share = {p.name: p.inventory for p in packing.order}
    shown = [(c, "") for c in sel.configs] + [
        (e.config, "  (left out of this run)") for e in sel.left_out if not sel.only
    ]
    print(packing.render())
    with hosts_for(opts, say) as hosts:
        for config, mark in shown:
            inv = share.get(config.name, sel.inv)
            print(plan_text(config, inv, opts, hosts).replace("\n", mark + "\n", 1))
    say(f"dry run: {len(shown)} plans, nothing was launched")
    return 0


def plan_text(config: ClusterConfig, inv: Inventory, opts: SweepOptions, hosts: RayHosts | None) -> str:
    """One config's plan as --dry-run prints it (across hosts: each host's facts gathered there,
    nothing generated, every port held only while planning)."""
    with PortAllocator(config.host) as ports:
        layout, remote = phase_one(hosts, config, opts, create_model=False) if hosts else (None, {})
        try:
            plan = make_plan(config, inv, ports, opts, create_model=False, layout=layout, host_ports=remote)
        finally:
            for p in remote.values():
                p.release()
    return plan.render()


def metadata(
    args: argparse.Namespace, sel: Selection, env: dict[str, Any], checks: Sequence[str]
) -> dict[str, Any]:
    """The run's facts, recorded in summary.json (and in the provisional summary of a stopped run)."""
    return {
        "sweep": sel.sweep.name,
        "platform": sel.platform,
        "hostname": socket.gethostname(),
        "checks": list(checks),
        "pd_sessions": __version__,
        "allow_unpinned_remote_code": args.allow_unpinned_remote_code,
        "accuracy_mode": args.accuracy,
        "skipped_checks": list(args.skip_check),
        "gpus": list(sel.inv.gpus),
        "cpus": len(sel.inv.cpus),
        "overrides": sel.over.describe(),
        "environment": env,
        "left_out": [{"name": e.config.name, "reason": e.opt_in_reason} for e in sel.left_out],
    }


def run_configs(
    sel: Selection, opts: SweepOptions, meta: dict[str, Any], *, upload: bool = False
) -> list[ConfigResult]:
    """Run every selected config under the lifeline; whatever happens, write what there is."""
    results: list[ConfigResult] = []
    provisional = unfinished.Provisional(
        sel.configs,
        opts.results_dir,
        suite=sel.sweep.name,
        platform=sel.platform,
        checks=opts.checks,
        skipped=opts.skip_checks,
        meta=meta,
    )
    try:  # the lifeline: see runtime/reaper.py and runtime/parentwatch.py (parent death, the reaper)
        with (
            reaper.Lifeline(opts.results_dir, grace_s=opts.grace_s, warn=say) as life,
            process.observed(life.reaper),
            hosts_for(opts, say) as hosts,
        ):
            results = run_sweep(
                sel.configs, sel.inv, opts, say, results=results, on_change=provisional, hosts=hosts
            )
    except BaseException as e:  # a stop: the cut-short config is cancelled, the rest not run
        cause = unfinished.stop_cause(e)
        results = unfinished.complete(sel.configs, results, platform=sel.platform, cause=cause)
        raise
    finally:
        if results:
            write_results(results, sel.sweep.name, opts, meta, upload=upload)
    return results


def write_results(
    results: list[ConfigResult], suite: str, opts: SweepOptions, meta: dict[str, Any], *, upload: bool = False
) -> None:
    """summary.json/.txt, junit.xml, report.html, the table on stdout and, under Buildkite, an
    annotation linking the page (and with ``upload``, the results directory uploaded)."""
    page = unfinished.write_all(
        results, opts.results_dir, meta, suite=suite, checks=opts.checks, skipped=opts.skip_checks
    )
    print("\n" + table(results), flush=True)
    say(f"report: {page}" if page else f"report: {PAGE} could not be written (see the warning above)")
    if buildkite_annotation.annotate(results, sweep=suite, page=page):
        say("summary added as a Buildkite annotation")
    if upload:
        say(buildkite_annotation.upload(opts.results_dir))
