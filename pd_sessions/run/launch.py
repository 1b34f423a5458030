"""What ``sweep`` and ``serve`` share before they launch: the selection on this host, the
refusals that need the environment, the banner's common lines and the options they run with."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pd_sessions.core import check_registry, connector_support
from pd_sessions.core.errors import PlanError, UsageError
from pd_sessions.core.selection import Selection, select_run
from pd_sessions.env.envfacts import summary_lines
from pd_sessions.run.sweep_options import SweepOptions
from pd_sessions.runtime import machine


def checked(args: argparse.Namespace) -> Selection:
    """The run's selection on this host: the noxfile checks a session's posargs the same way."""
    return select_run(args.sweep, args, machine.detect())


def _model_config(model: str) -> dict[str, Any] | None:
    """config.json of a local model directory, else None (hub names are not looked up)."""
    path = Path(model).expanduser() / "config.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def refuse_before_launch(sel: Selection, env: dict[str, Any], *, dry_run: bool) -> list[str]:
    """What this vLLM (``env``, envfacts' document) cannot run: PlanError before anything starts.
    With --dry-run, the banner's warnings instead (the selection's own first), so that the plans
    can still be read."""
    vllm = (env.get("modules") or {}).get("vllm") or {}
    factory = _factory_source(vllm.get("location"))
    problems = [
        (field, problem)
        for c in sel.configs
        for field, problem in (
            ("connector", connector_support.vllm_lacks_connector(c, factory, vllm.get("version"))),
            (
                "prefill_tp",
                connector_support.vllm_problem(
                    c,
                    vllm.get("version"),
                    hybrid_mla=connector_support.is_hybrid_mla(c, _model_config(c.model)),
                ),
            ),
        )
    ]
    for field, problem in problems:
        if problem and not dry_run:
            raise PlanError(field, problem)
    return [f"WARNING: {p}" for p in (*sel.warnings, *(p for _, p in problems)) if p]


# Where a vLLM registers its KV connectors, relative to its package folder.
FACTORY = Path("distributed", "kv_transfer", "kv_connector", "factory.py")


def _factory_source(vllm_location: str | None) -> str | None:
    """The text of the installed vLLM's connector factory (envfacts gives its folder), else None."""
    if not vllm_location:
        return None
    try:
        return (Path(vllm_location) / FACTORY).read_text()
    except OSError:
        return None


def setup_lines(sel: Selection, env: dict[str, Any], warnings: list[str]) -> list[str]:
    """The banner lines both commands print: the environment, the preflight note, the overrides
    and the warnings a dry run plans in spite of."""
    return [
        *summary_lines(env),
        *([sel.note] if sel.note else []),
        *(f"override (command line): {line}" for line in sel.over.describe()),
        *warnings,
    ]


def run_options(
    args: argparse.Namespace, sel: Selection, *, results_name: str, **checks: Any
) -> SweepOptions:
    """The options ``sweep`` and ``serve`` run with (built here only). ``results_name``: the
    default results folder, stamped with the time; ``checks``: the sweep's check options."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.ray and args.simulate_hosts:
        raise UsageError("--ray and --simulate-hosts: give one (--simulate-hosts starts its own Ray cluster)")
    if args.allow_loopback_advertise and not (args.ray or args.simulate_hosts):
        raise UsageError(
            "--allow-loopback-advertise has no effect on one host (nothing is advertised to another "
            "host): give it with --ray ADDRESS or --simulate-hosts N, or leave it out"
        )
    opts = SweepOptions(
        platform=sel.platform,
        results_dir=(args.results_dir or Path("results") / f"{results_name}-{stamp}").resolve(),
        allow_unpinned=args.allow_unpinned_remote_code,
        share_gpus=args.share_gpus,
        overrides=tuple(sel.over.describe()),
        ray=args.ray,
        simulate_hosts=args.simulate_hosts,
        allow_loopback_advertise=args.allow_loopback_advertise,
        max_parallel=getattr(args, "max_parallel", None),  # sweep only
        **({"deadline_s": args.deadline} if args.deadline else {}),
        **({"pd_path_budget_s": args.pd_path_budget} if args.pd_path_budget else {}),
        **({"grace_s": args.grace} if args.grace is not None else {}),
        **checks,
    )
    check_registry.across_hosts_only(opts.checks, across_hosts=bool(args.ray or args.simulate_hosts))
    return opts
