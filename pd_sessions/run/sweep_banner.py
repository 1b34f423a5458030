"""What the sweep says and records before it starts: the lane, the banner, the run's metadata
(summary.json). Pure: built from the selection and the command line."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Sequence
from typing import Any

from pd_sessions import __version__
from pd_sessions.core import check_registry
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.selection import Selection
from pd_sessions.run import launch, user_commands


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
    lines.append(required_line(sel, args, checks))
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


def required_line(sel: Selection, args: argparse.Namespace, checks: Sequence[str]) -> str:
    """Which checks fail their config when they could not run (NOT RUN)."""
    if args.strict:
        return "NOT RUN fails: every check (--strict)"
    required = [c for c in sel.sweep.required_on(sel.platform) if c in checks]
    # the user's own commands (exec[N]) pass or fail: they are never NOT RUN
    optional = [c for c in checks if c not in required and c in check_registry.NAMES]
    return f"NOT RUN fails: {', '.join(required) or 'no check'} (the sweep's required checks)" + (
        f"; reported, not failed: {', '.join(optional)}" if optional else ""
    )


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
        "required_checks": [c for c in sel.sweep.required_on(sel.platform) if c in checks],
        "strict": args.strict,
        "gpus": list(sel.inv.gpus),
        "cpus": len(sel.inv.cpus),
        "overrides": sel.over.describe(),
        "environment": env,
        "left_out": [{"name": e.config.name, "reason": e.opt_in_reason} for e in sel.left_out],
    }
