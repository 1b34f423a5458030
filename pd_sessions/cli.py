"""Command line: ``python -m pd_sessions <command>``. The only module that prints.

Exit status: 0 all passed; 1 a config failed; 2 bad config or arguments
(nothing launched); 128+N when stopped by signal N (teardown still ran).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from pd_sessions import __version__, hosts
from pd_sessions.config import Sweep, builtin_sweep, load_sweep, select
from pd_sessions.checks import registry as check_registry
from pd_sessions.checks.accuracy import AccuracyOptions
from pd_sessions.errors import ConfigError, PdError, UsageError
from pd_sessions.ports import PortAllocator
from pd_sessions.preflight import preflight
from pd_sessions.report import annotate, table, write_junit, write_summary
from pd_sessions.sweep import SweepOptions, make_plan, run_sweep

log = logging.getLogger("pd_sessions")


class Stopped(BaseException):
    """Raised in the main thread when SIGTERM arrives (SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


_T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[pd-sessions {time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def install_signal_handlers() -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        # Later signals are ignored so they cannot cut the teardown short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-sessions", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("sweep", help="run (or --dry-run) a sweep of P/D clusters")
    s.add_argument("sweep", help="a built-in sweep name (e.g. mooncake_sweep) or a .toml path")
    s.add_argument("--platform", choices=["cpu", "cuda"], default=None,
                   help="force a platform; default: cuda when a GPU is visible, else cpu")
    s.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="run only this config (repeatable, or comma-separated)")
    s.add_argument("--include-opt-in", action="store_true",
                   help="also run configs that are opt-in on this platform (e.g. 2x2 on CPU)")
    s.add_argument("--dry-run", action="store_true", help="print every plan; launch nothing")
    s.add_argument("--results-dir", type=Path, default=None,
                   help="where results and logs go (default: results/<sweep>-<time>)")
    s.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="readiness deadline per config (default 1200)")
    s.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                   help="SIGTERM grace before SIGKILL at teardown (default 10)")
    s.add_argument("--allow-unpinned-remote-code", action="store_true",
                   help="allow trust_remote_code without a pinned revision (said in the results)")
    s.add_argument("--accuracy", choices=["enforce", "warn"], default="enforce",
                   help="warn: exploratory run; an accuracy miss or missing baseline is reported, "
                        "not failed (said in the summary)")
    s.add_argument("--accuracy-rule", choices=["tolerance", "wilson"], default="tolerance")
    s.add_argument("--accuracy-limit", type=int, default=None, metavar="N",
                   help="lm_eval sample limit (refused unless it matches the baseline's)")
    s.add_argument("--allow-sample-mismatch", action="store_true")
    s.add_argument("--record-baseline", action="store_true",
                   help="measure accuracy and write it as the model's baseline")
    s.add_argument("--skip-check", action="append", default=[], choices=list(check_registry.NAMES),
                   help="do not run this check (printed in the banner, recorded in the results)")
    s.add_argument("--share-gpus", action="store_true",
                   help="let instances share GPUs when the host has fewer than the config needs "
                        "(each gets explicit KV-cache bytes); prints a warning")
    s.add_argument("--mooncake-protocol", choices=["rdma", "tcp"], default=None)
    s.add_argument("--mooncake-device-name", default=os.environ.get("MOONCAKE_DEVICE_NAME"),
                   help="RDMA HCA allow-list (default: $MOONCAKE_DEVICE_NAME)")
    s.add_argument("-v", "--verbose", action="store_true")

    t = sub.add_parser("tiny-model", help="generate (once) the tiny model and print its path")
    t.add_argument("--cache-dir", type=Path, default=None)

    sub.add_parser("inventory", help="print the detected host inventory as JSON")
    return p


def load(name: str) -> Sweep:
    """A built-in sweep by name, or a sweep .toml file."""
    path = Path(name)
    if name.endswith(".toml") or path.exists():
        return load_sweep(path)
    return builtin_sweep(name)


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {}
    if args.mooncake_protocol:
        out["mooncake_protocol"] = args.mooncake_protocol
    if args.mooncake_device_name:
        out["mooncake_device_name"] = args.mooncake_device_name
    return out


def cmd_sweep(args: argparse.Namespace) -> int:
    only = tuple(o for item in args.only for o in item.split(",") if o)
    sweep = load(args.sweep)
    platform, inv, note = preflight(sweep, args.platform, hosts.detect(), dry_run=args.dry_run,
                                    share_gpus=args.share_gpus)
    entries, left_out = select(sweep.entries(platform), platform, only=only,
                               include_opt_in=args.include_opt_in)
    over = _overrides(args)
    configs = [dataclasses.replace(e.config, **over) if over else e.config for e in entries]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results_dir = (args.results_dir or Path("results") / f"{sweep.name}-{stamp}").resolve()
    opts = SweepOptions(platform=platform, results_dir=results_dir,
                        allow_unpinned=args.allow_unpinned_remote_code, share_gpus=args.share_gpus,
                        accuracy=AccuracyOptions(mode=args.accuracy, rule=args.accuracy_rule,
                                                 limit=args.accuracy_limit,
                                                 allow_sample_mismatch=args.allow_sample_mismatch,
                                                 record_baseline=args.record_baseline),
                        skip_checks=tuple(args.skip_check),
                        selected_checks=sweep.checks, check_options=sweep.check_options,
                        **({"deadline_s": args.deadline} if args.deadline else {}),
                        **({"grace_s": args.grace} if args.grace is not None else {}))

    if platform == "cpu":
        why = ("forced by --platform cpu" if args.platform == "cpu"
               else f"no GPU visible (GPU source: {inv.gpu_source})")
        lane = (f"CPU LANE ({why}): vLLM's CPU build, the generated tiny model, "
                f"{len(inv.cpus)} cores")
    else:
        lane = f"CUDA: GPUs {','.join(inv.gpus)} (from {inv.gpu_source})"
    say(f"{sweep.name}: {lane}")
    if note:
        say(note)
    if args.skip_check:
        say(f"checks skipped by request (--skip-check): {', '.join(args.skip_check)}; "
            "recorded in summary.json")
    if args.accuracy == "warn":
        say("accuracy: --accuracy=warn: misses and missing baselines are reported, not failed")
    if args.allow_unpinned_remote_code:
        say("remote code: --allow-unpinned-remote-code given: configs with trust_remote_code and "
            "no revision run UNPINNED (recorded in the results)")
    say(f"configs: {', '.join(c.name for c in configs) or 'none'}")
    say(f"checks: {', '.join(opts.checks)}")
    for e in left_out:
        why = e.opt_in_reason if not only else "not named by --only"
        say(f"left out: {e.config.name} ({e.config.shape}): {why}"
            + ("; run it with --include-opt-in" if not only else ""))
    if not configs:
        raise UsageError("no config selected: nothing to run")

    if args.dry_run:
        # Left-out configs are planned too (marked), so every plan can be reviewed.
        shown = [(c, "") for c in configs] + [
            (e.config, "  (left out of this run)") for e in left_out if not only]
        for c, mark in shown:
            with PortAllocator(c.host) as ports:
                print(make_plan(c, inv, ports, opts, create_model=False).render().replace(
                    "\n", mark + "\n", 1))
        say(f"dry run: {len(shown)} plans, nothing was launched")
        return 0

    say(f"results and logs: {results_dir}")
    results = []
    try:
        results = run_sweep(configs, inv, opts, say)
    finally:
        meta = {"sweep": sweep.name, "platform": platform, "pd_sessions": __version__,
                "allow_unpinned_remote_code": args.allow_unpinned_remote_code,
                "accuracy_mode": args.accuracy, "skipped_checks": list(args.skip_check),
                "gpus": list(inv.gpus), "cpus": len(inv.cpus),
                "left_out": [{"name": e.config.name, "reason": e.opt_in_reason} for e in left_out]}
        if results:
            write_summary(results, results_dir, meta)
            write_junit(results, results_dir / "junit.xml", suite=sweep.name, expected_checks=opts.checks,
                        skipped_checks=opts.skip_checks)
            print("\n" + table(results), flush=True)
            if annotate(results, sweep=sweep.name):
                say("summary added as a Buildkite annotation")
    failed = [r.name for r in results if r.outcome != "passed"]
    say(f"{len(results) - len(failed)}/{len(results)} configs passed"
        + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from pd_sessions import tiny_model

    print(tiny_model.ensure(cache_dir=args.cache_dir))
    return 0


def cmd_inventory(args: argparse.Namespace) -> int:
    inv = hosts.detect()
    print(json.dumps({"gpus": list(inv.gpus), "cpus": list(inv.cpus), "gpu_source": inv.gpu_source,
                      "platform": hosts.resolve_platform(None, inv)}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_signal_handlers()
    commands = {"sweep": cmd_sweep, "tiny-model": cmd_tiny_model, "inventory": cmd_inventory}
    return run_command(lambda: commands[args.command](args), prog="pd-sessions")


def run_command(command: Callable[[], int], *, prog: str) -> int:
    """Run an entry point's command: our errors and signals become exit statuses
    (2 config/usage, 1 other errors, 128+N on signal N after teardown)."""
    try:
        return command()
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        return e.exit_status
    except PdError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_status
    except Stopped as e:
        say(f"{e}: teardown done")
        return 128 + e.signum
    except KeyboardInterrupt:
        say("interrupted (SIGINT): teardown done")
        return 128 + signal.SIGINT
