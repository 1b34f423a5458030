"""``pd-sessions sweep``: run (or --dry-run) a sweep of P/D clusters, configs side by side where
they fit (--max-parallel), else one after another; plan, start, check, tear down and record each.

Every config runs even when an earlier one failed. Whatever happens (a stop included), what there
is gets written: summary.json/.txt, junit.xml, report.html, the table on stdout. The run is inside
the lifeline (run/lifeline.py), so nothing outlives it.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from pd_sessions.checks.accuracy import AccuracyOptions
from pd_sessions.checks.runner import run_checks
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import PdError, UsageError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan.packing import Packing, pack
from pd_sessions.core.results import RUNNING, CheckResult, ConfigResult
from pd_sessions.core.selection import Selection
from pd_sessions.env.envfacts import facts
from pd_sessions.report import buildkite_annotation, unfinished
from pd_sessions.report.html import PAGE
from pd_sessions.report.writers import table, write_config_result
from pd_sessions.run import launch, packed, user_commands
from pd_sessions.run.dry_run import dry_run
from pd_sessions.run.lifeline import lifeline, new_result, start_config
from pd_sessions.run.ray_hosts import loopback_said
from pd_sessions.run.sweep_banner import banner, metadata
from pd_sessions.run.sweep_options import SweepOptions
from pd_sessions.runtime.cluster import Cluster, Event
from pd_sessions.runtime.console import say

log = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    """``pd-sessions sweep``: 0 when every config passed, 1 when one did not (2: refused)."""
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
        return dry_run(sel, opts, packing, say)
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
        "required_checks": sweep.required_on(sel.platform),
        "strict": args.strict,
        "check_options": sweep.check_options,
    }


def run_configs(
    sel: Selection, opts: SweepOptions, meta: dict[str, Any], *, upload: bool = False
) -> list[ConfigResult]:
    """Run every selected config; whatever happens, write what there is."""
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
    try:  # run_sweep runs inside the lifeline (run/lifeline.py)
        results = run_sweep(sel.configs, sel.inv, opts, say, results=results, on_change=provisional)
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


def run_config(
    config: ClusterConfig,
    inv: Inventory,
    opts: SweepOptions,
    progress: Callable[[str], None],
    on_event: Callable[[Event], None] | None = None,
    into: ConfigResult | None = None,
    freed: Callable[[], None] | None = None,
) -> ConfigResult:
    """Plan, start (run/lifeline.py's start_config), check, tear down and record one config
    (``on_event``: see running_cluster; ``freed``: its devices are free, cluster.teardown).

    ``into``: the record to fill (else a new one). An unforeseen exception (not a PdError)
    errors this config, its traceback in ``error.log``; a stop (SIGINT, SIGTERM) marks it
    cancelled, writes its result.json, and goes on up.
    """
    res = into or new_result(config, opts)
    run_dir = opts.results_dir / config.name
    try:
        with start_config(
            config, inv, opts, progress=progress, record=res, on_event=on_event, freed=freed
        ) as cluster:
            _check(cluster, res, opts, progress)
    except PdError as e:
        res.error = str(e) + loopback_said(res.warnings)
        progress(f"{config.name}: ERROR: {str(e).splitlines()[0]}{loopback_said(res.warnings)}")
    except Exception as e:  # a bug, or a library failing in a way we did not foresee
        log_path = unfinished.crash_log(run_dir, "error", e)
        res.error = f"internal error: {type(e).__name__}: {e} (traceback in {log_path})"
        progress(f"{config.name}: ERROR: {res.error}")
    except BaseException as e:  # a stop: record this config as cancelled, then let it go on up
        unfinished.cancel(res, unfinished.stop_cause(e))
        write_config_result(res, run_dir / "result.json")
        raise
    res.decide(opts.checks, required=opts.required_checks, strict=opts.strict)
    if res.outcome != "passed" and loopback_said(res.warnings) not in (res.error or "-"):
        progress(f"{config.name}: {res.outcome}{loopback_said(res.warnings)}")
    write_config_result(res, run_dir / "result.json")
    return res


def _check(cluster: Cluster, res: ConfigResult, opts: SweepOptions, progress: Callable[[str], None]) -> None:
    """The checks, then the user's commands, against the live ``cluster``; into ``res``."""
    t = time.monotonic()
    res.phase_starts["checks"] = time.time()
    checks: list[CheckResult] = []
    try:
        cluster.guard(
            lambda: run_checks(
                cluster,
                checks,
                opts.accuracy,
                opts.skip_checks,
                selected=opts.selected_checks,
                options=opts.check_options,
            ),
            when="while checks ran",
        )
        if opts.commands:
            user_commands.run_commands(
                cluster,
                opts.commands,
                checks,
                progress=progress,
                timeout_s=opts.exec_timeout_s,
                grace_s=opts.grace_s,
            )
    finally:
        res.phases["checks"] = time.monotonic() - t
        _record_checks(res, checks, cluster.run_dir, progress)


def _record_checks(
    res: ConfigResult, checks: list[CheckResult], run_dir: Path, progress: Callable[[str], None]
) -> None:
    """The checks that ran, into ``res`` and said; a crashed one's traceback into checks.log."""
    res.checks = list(checks)
    for c in checks:
        progress(f"{res.name}: {c.name} {c.verdict.upper()}: {c.message}")
        if "traceback" in c.details:  # it crashed: see checks.base.crashed
            with open(run_dir / "checks.log", "a") as f:
                f.write(f"--- {c.name} crashed ---\n{c.details['traceback']}")


def run_sweep(
    configs: Sequence[ClusterConfig],
    inv: Inventory,
    opts: SweepOptions,
    progress: Callable[[str], None],
    results: list[ConfigResult] | None = None,
    on_change: Callable[[list[ConfigResult]], None] | None = None,
) -> list[ConfigResult]:
    """Run every config; one record each, returned in the sweep's order (and put in ``results``
    if given).

    Configs that fit on the host at once run side by side (core/plan/packing.py, run/packed.py;
    ``opts.max_parallel``); otherwise one after another, in this thread. Each record joins
    ``results`` as its config starts (outcome ``running``), so a caller that a stop interrupts
    still holds the finished ones and the cancelled ones. ``on_change`` is called as each config
    starts and ends (to write a provisional summary). All of it inside the lifeline
    (run/lifeline.py), across the run's hosts when it has some.
    """
    results = [] if results is None else results
    with lifeline(opts, progress) as hosts:
        packing = sweep_packing(configs, inv, opts, across_hosts=hosts is not None)
        return _run_each(configs, inv, opts, progress, results, on_change, packing)


def _run_each(
    configs: Sequence[ClusterConfig],
    inv: Inventory,
    opts: SweepOptions,
    progress: Callable[[str], None],
    results: list[ConfigResult],
    on_change: Callable[[list[ConfigResult]], None] | None,
    packing: Packing,
) -> list[ConfigResult]:
    """run_sweep's configs, in ``packing``'s waves side by side, else one after another."""
    if packing.parallel:
        for line in packing.render().splitlines():
            progress(line.strip())
        return packed.run_packed(
            configs,
            packing,
            progress,
            results,
            on_change,
            start=partial(_start, opts=opts),
            run_one=lambda c, share, say, res, freed: run_config(c, share, opts, say, into=res, freed=freed),
        )
    for i, config in enumerate(configs, 1):
        res = _start(config, i, len(configs), progress, opts=opts)
        results.append(res)
        if on_change:
            on_change(results)
        run_config(config, inv, opts, progress, into=res)
        progress(f"[{i}/{len(configs)}] {config.name}: {results[-1].outcome.upper()}")
        if on_change:
            on_change(results)
    return results


def sweep_packing(
    configs: Sequence[ClusterConfig], inv: Inventory, opts: SweepOptions, *, across_hosts: bool
) -> Packing:
    """The sweep's waves (UsageError for a --max-parallel that cannot be kept)."""
    return pack(
        configs,
        inv,
        platform=opts.platform,
        max_parallel=opts.max_parallel,
        across_hosts=across_hosts or opts.ray is not None or opts.simulate_hosts > 0,
    )


def _start(
    config: ClusterConfig, i: int, n: int, progress: Callable[[str], None], *, opts: SweepOptions
) -> ConfigResult:
    """Say that config ``i`` of ``n`` starts; its record, ``running``."""
    progress(f"[{i}/{n}] {config.name}: {config.shape}, {config.connector}")
    res = new_result(config, opts)
    res.outcome = RUNNING
    return res
