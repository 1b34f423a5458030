"""Command line: ``pd-sessions <command>`` (or ``python -m pd_sessions <command>``), the one way in.

Commands: sweep, serve, tiny-model, inventory, bench, bench-report, wheelhouse, buildkite. The
other ``python -m pd_sessions.X`` entries are process boundaries (envfacts, canary, the lifeline
reaper, the bench's fake servers); each module's docstring says why. Only the entry points print
(this module, pd_sessions.runtime.console, and the modules a command hands its command line to).

Exit status: 0 all passed; 1 a config failed; 2 bad config or arguments
(nothing launched); 128+N when stopped by signal N (teardown still ran).
`serve` exits 0 when stopped by Ctrl-C or SIGTERM (its normal end) and 1 when a server died.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Only modules that import with the standard library alone (+ packaging) at the top, so that
# `--help` works on a bare interpreter (tests/test_bare_imports.py); the ones that need psutil
# (process, user_commands, sweep) are imported by the command that uses them.
from pd_sessions import __version__
from pd_sessions.checks.accuracy import AccuracyOptions
from pd_sessions.core.cliargs import add_common_options, add_sweep_options
from pd_sessions.core.config import ClusterConfig, Overrides, Sweep, SweepEntry, load, make_overrides, select
from pd_sessions.core.errors import PlanError, UsageError
from pd_sessions.core.inventory import Inventory, resolve_platform
from pd_sessions.core.preflight import preflight, rdma_problem
from pd_sessions.core.results import ConfigResult
from pd_sessions.env.envfacts import facts, summary_lines
from pd_sessions.report import unfinished
from pd_sessions.report.writers import annotate, table, write_junit, write_summary
from pd_sessions.runtime import hosts
from pd_sessions.runtime.console import Stopped, install_signal_handlers, run_command, say
from pd_sessions.runtime.ports import PortAllocator

log = logging.getLogger("pd_sessions")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-sessions", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)

    # The options live in cliargs (standard library only): the noxfile parses posargs with them.
    s = sub.add_parser("sweep", help="run (or --dry-run) a sweep of P/D clusters")
    s.add_argument("sweep", help="a built-in sweep name (e.g. mooncake_sweep) or a .toml path")
    add_sweep_options(s)

    v = sub.add_parser(
        "serve", help="start one config, print how to reach it, and keep it up until Ctrl-C or SIGTERM"
    )
    v.add_argument("sweep", help="a built-in sweep name (e.g. mooncake_sweep) or a .toml path")
    add_common_options(v)

    t = sub.add_parser("tiny-model", help="generate (once) the tiny model and print its path")
    t.add_argument("--cache-dir", type=Path, default=None)

    sub.add_parser("inventory", help="print the detected host inventory as JSON")

    _passthrough(
        sub,
        "bench",
        "measure the harness's overhead next to what users run today; writes bench/ "
        "(pd-sessions bench --help lists its options)",
    )
    r = sub.add_parser(
        "bench-report", help="render bench results (table, goals, chart) again from results.json"
    )
    r.add_argument("results_json", type=Path, metavar="RESULTS_JSON", help="e.g. bench/results.json")
    _passthrough(
        sub,
        "wheelhouse",
        "download every wheel a session needs, for an offline host (pd-sessions wheelhouse --help)",
    )
    sub.add_parser("buildkite", help="render .buildkite/ from the job registry in pd_sessions/ci_jobs.py")
    return p


def _passthrough(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str) -> None:
    """A subcommand whose own parser lives in its module, imported only when it runs (so that
    `pd-sessions --help` needs none of its dependencies): everything after its name is handed
    over as is. argparse takes no option here: no argument starts with the NUL prefix char."""
    s = sub.add_parser(name, help=help, add_help=False, prefix_chars="\0")
    s.add_argument("rest", nargs=argparse.REMAINDER)


def overrides(args: argparse.Namespace) -> Overrides:
    """The command line's per-run overrides (checked; applied per config later)."""
    return make_overrides(
        sets=args.set_fields,
        model=args.model,
        revision=args.revision,
        extra_args=args.extra_arg,
        named={
            "mooncake_protocol": args.mooncake_protocol,
            "mooncake_device_name": args.mooncake_device_name or None,
        },
    )


def _selection(args: argparse.Namespace) -> Selection:
    """Load, check and select: everything `sweep` and `serve` do before they differ."""
    only = tuple(o for item in args.only for o in item.split(",") if o)
    over = overrides(args)
    sweep = load(args.sweep)
    env = facts(import_torch=False, full=False)
    platform, inv, note = preflight(
        sweep, args.platform, hosts.detect(), dry_run=args.dry_run, share_gpus=args.share_gpus
    )
    entries, left_out = select(
        sweep.entries(platform), platform, only=only, include_opt_in=args.include_opt_in
    )
    configs = [over.apply(e.config) for e in entries]
    left_out = tuple(dataclasses.replace(e, config=over.apply(e.config)) for e in left_out)
    return Selection(sweep, platform, inv, note, configs, left_out, only, over, env)


@dataclass(frozen=True)
class Selection:
    """What `sweep` and `serve` share: the configs to run, with the command line's overrides."""

    sweep: Sweep
    platform: str
    inv: Inventory
    note: str | None
    configs: list[ClusterConfig]
    left_out: tuple[SweepEntry, ...]
    only: tuple[str, ...]
    over: Overrides
    env: dict[str, Any]


def _model_config(model: str) -> dict[str, Any] | None:
    """config.json of a local model directory, else None (hub names are not looked up)."""
    path = Path(model).expanduser() / "config.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _refuse_before_launch(sel: Selection, *, dry_run: bool) -> None:
    """What this host or this vLLM cannot run: PlanError before anything starts (a warning
    with --dry-run, so the plans can still be read)."""
    from pd_sessions.core import connector_support  # packaging: not needed for --help

    vllm = (sel.env.get("modules") or {}).get("vllm") or {}
    problems = [
        ("mooncake_protocol", rdma_problem(sel.configs, sel.platform, sel.inv)),
        *(
            (
                "prefill_tp",
                connector_support.vllm_problem(
                    c,
                    vllm.get("version"),
                    hybrid_mla=connector_support.is_hybrid_mla(c, _model_config(c.model)),
                ),
            )
            for c in sel.configs
        ),
    ]
    for field, problem in problems:
        if problem and not dry_run:
            raise PlanError(field, problem)
        if problem:
            say(f"WARNING: {problem}")


def cmd_sweep(args: argparse.Namespace) -> int:
    from pd_sessions.run import user_commands
    from pd_sessions.run.options import SweepOptions, make_plan
    from pd_sessions.run.sweep import run_sweep
    from pd_sessions.runtime import process, reaper

    commands = user_commands.from_cli(
        args.user_commands,
        python=sys.executable,
        dry_run=args.dry_run,
        have_pytest=importlib.util.find_spec("pytest") is not None,
    )
    sel = _selection(args)
    sweep, platform, inv, note, configs, left_out, only, over, env = (
        sel.sweep,
        sel.platform,
        sel.inv,
        sel.note,
        sel.configs,
        sel.left_out,
        sel.only,
        sel.over,
        sel.env,
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results_dir = (args.results_dir or Path("results") / f"{sweep.name}-{stamp}").resolve()
    opts = SweepOptions(
        platform=platform,
        results_dir=results_dir,
        allow_unpinned=args.allow_unpinned_remote_code,
        share_gpus=args.share_gpus,
        accuracy=AccuracyOptions(
            mode=args.accuracy,
            rule=args.accuracy_rule,
            limit=args.accuracy_limit,
            allow_sample_mismatch=args.allow_sample_mismatch,
            record_baseline=args.record_baseline,
        ),
        skip_checks=tuple(args.skip_check),
        overrides=tuple(over.describe()),
        commands=commands,
        exec_timeout_s=args.exec_timeout,
        selected_checks=sweep.checks,
        check_options=sweep.check_options,
        **({"deadline_s": args.deadline} if args.deadline else {}),
        **({"grace_s": args.grace} if args.grace is not None else {}),
    )

    if platform == "cpu":
        why = (
            "forced by --platform cpu"
            if args.platform == "cpu"
            else f"no GPU visible (GPU source: {inv.gpu_source})"
        )
        lane = f"CPU LANE ({why}): vLLM's CPU build, the generated tiny model, {len(inv.cpus)} cores"
    else:
        lane = f"CUDA: GPUs {','.join(inv.gpus)} (from {inv.gpu_source})"
    say(f"{sweep.name}: {lane}")
    for line in summary_lines(env):
        say(line)
    if note:
        say(note)
    for line in over.describe():
        say(f"override (command line): {line}")
    _refuse_before_launch(sel, dry_run=args.dry_run)
    if args.skip_check:
        say(
            f"checks skipped by request (--skip-check): {', '.join(args.skip_check)}; "
            "recorded in summary.json"
        )
    if args.accuracy == "warn":
        say("accuracy: --accuracy=warn: misses and missing baselines are reported, not failed")
    if args.allow_unpinned_remote_code:
        say(
            "remote code: --allow-unpinned-remote-code given: configs with trust_remote_code and "
            "no revision run UNPINNED (recorded in the results)"
        )
    say(f"configs: {', '.join(c.name for c in configs) or 'none'}")
    say(f"checks: {', '.join(opts.checks)}")
    for c in commands:
        say(f"after the checks, each config runs {c.name}: {c.given} (timeout {args.exec_timeout:g} s)")
    for e in left_out:
        why = e.opt_in_reason if not only else "not named by --only"
        say(
            f"left out: {e.config.name} ({e.config.shape}): {why}"
            + ("; run it with --include-opt-in" if not only else "")
        )
    if not configs:
        raise UsageError("no config selected: nothing to run")

    if args.dry_run:
        # Left-out configs are planned too (marked), so every plan can be reviewed.
        shown = [(c, "") for c in configs] + [
            (e.config, "  (left out of this run)") for e in left_out if not only
        ]
        for shown_config, mark in shown:
            with PortAllocator(shown_config.host) as ports:
                print(
                    make_plan(shown_config, inv, ports, opts, create_model=False)
                    .render()
                    .replace("\n", mark + "\n", 1)
                )
        say(f"dry run: {len(shown)} plans, nothing was launched")
        return 0

    unfinished.check_writable(results_dir)  # exit 2 before anything starts
    say(f"results and logs: {results_dir}")
    results: list[ConfigResult] = []
    meta = {
        "sweep": sweep.name,
        "platform": platform,
        "pd_sessions": __version__,
        "allow_unpinned_remote_code": args.allow_unpinned_remote_code,
        "accuracy_mode": args.accuracy,
        "skipped_checks": list(args.skip_check),
        "gpus": list(inv.gpus),
        "cpus": len(inv.cpus),
        "overrides": over.describe(),
        "environment": env,
        "left_out": [{"name": e.config.name, "reason": e.opt_in_reason} for e in left_out],
    }
    provisional = unfinished.Provisional(
        configs,
        results_dir,
        suite=sweep.name,
        platform=platform,
        checks=opts.checks,
        skipped=opts.skip_checks,
        meta=meta,
    )
    try:  # the lifeline: see runtime/reaper.py and runtime/parentwatch.py (parent death, the reaper)
        with (
            reaper.Lifeline(results_dir, grace_s=opts.grace_s, warn=say) as life,
            process.observed(life.reaper),
        ):
            results = run_sweep(configs, inv, opts, say, results=results, on_change=provisional)
    except BaseException as e:  # a stop: the cut-short config is cancelled, the rest not run
        results = unfinished.complete(configs, results, platform=platform, cause=unfinished.stop_cause(e))
        raise
    finally:
        if results:
            write_summary(results, results_dir, meta)
            write_junit(
                results,
                results_dir / "junit.xml",
                suite=sweep.name,
                expected_checks=opts.checks,
                skipped_checks=opts.skip_checks,
            )
            print("\n" + table(results), flush=True)
            if annotate(results, sweep=sweep.name):
                say("summary added as a Buildkite annotation")
    failed = [r.name for r in results if r.outcome != "passed"]
    say(
        f"{len(results) - len(failed)}/{len(results)} configs passed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pd_sessions.run import serve
    from pd_sessions.run.options import SweepOptions, make_plan

    sel = _selection(args)
    sweep, platform, inv, note, configs, only = (
        sel.sweep,
        sel.platform,
        sel.inv,
        sel.note,
        sel.configs,
        sel.only,
    )
    if len(only) != 1 or len(configs) != 1:
        names = ", ".join(e.config.name for e in sweep.entries(platform))
        raise UsageError(f"serve starts one config: name it with --only (known in {sweep.name}: {names})")
    (config,) = configs
    opts = SweepOptions(
        platform=platform,
        allow_unpinned=args.allow_unpinned_remote_code,
        share_gpus=args.share_gpus,
        overrides=tuple(sel.over.describe()),
        results_dir=(
            args.results_dir or Path("results") / f"serve-{sweep.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        ).resolve(),
        **({"deadline_s": args.deadline} if args.deadline else {}),
        **({"grace_s": args.grace} if args.grace is not None else {}),
    )
    for line in summary_lines(sel.env):
        say(line)
    if note:
        say(note)
    for line in sel.over.describe():
        say(f"override (command line): {line}")
    _refuse_before_launch(sel, dry_run=args.dry_run)
    if args.dry_run:
        with PortAllocator(config.host) as ports:
            print(make_plan(config, inv, ports, opts, create_model=False).render())
        say("dry run: nothing was launched")
        return 0
    say(
        f"serve {sweep.name} {config.name} ({config.shape}, {config.connector}) on {platform}; "
        f"logs in {opts.results_dir / config.name}"
    )
    try:
        serve.serve(config, inv, opts, progress=say, emit=lambda line: print(line, flush=True))
    except (Stopped, KeyboardInterrupt) as e:
        say(f"{e if isinstance(e, Stopped) else 'interrupted (SIGINT)'}: torn down, nothing left running")
        return 0
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from pd_sessions.runtime import tiny_model

    print(tiny_model.ensure(cache_dir=args.cache_dir))
    return 0


def cmd_inventory(args: argparse.Namespace) -> int:
    inv = hosts.detect()
    print(
        json.dumps(
            {
                "gpus": list(inv.gpus),
                "cpus": list(inv.cpus),
                "gpu_source": inv.gpu_source,
                "platform": resolve_platform(None, inv),
            }
        )
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pd_sessions.bench import cli as bench_cli

    return bench_cli.main(args.rest)


def cmd_bench_report(args: argparse.Namespace) -> int:
    from pd_sessions.bench import report as bench_report

    if not args.results_json.is_file():
        raise UsageError(
            f"{args.results_json}: no such file; give the results.json a bench run wrote "
            "(pd-sessions bench --out DIR writes DIR/results.json; default bench/results.json)"
        )
    for path in bench_report.rerender(args.results_json).values():
        print(path)
    return 0


def cmd_wheelhouse(args: argparse.Namespace) -> int:
    from pd_sessions.env import wheelhouse

    return wheelhouse.main(args.rest)


def cmd_buildkite(args: argparse.Namespace) -> int:
    from pd_sessions.report import ci_jobs

    for rel in ci_jobs.write():
        print(f"wrote {rel}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    install_signal_handlers()
    commands = {
        "sweep": cmd_sweep,
        "serve": cmd_serve,
        "tiny-model": cmd_tiny_model,
        "inventory": cmd_inventory,
        "bench": cmd_bench,
        "bench-report": cmd_bench_report,
        "wheelhouse": cmd_wheelhouse,
        "buildkite": cmd_buildkite,
    }
    return run_command(lambda: commands[args.command](args), prog="pd-sessions")
