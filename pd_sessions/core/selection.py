"""What a ``sweep`` or ``serve`` run selects, checked before anything starts or is installed.

One function, :func:`select_run`, for both ways in: the CLI calls it with the host it detects,
and the noxfile calls it with the same detected inventory before it installs anything, so a
session's posargs are refused exactly as the CLI would refuse them (and the two cannot drift).
Pure over the parsed command line (a namespace of :mod:`pd_sessions.core.cliargs`' common
options) and the inventory it is given; it reads only the sweep files (and asks whether a
path-like model exists).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass

from pd_sessions.core import check_registry, connectors
from pd_sessions.core.config import (
    OVERRIDE_SOURCE,
    ClusterConfig,
    Overrides,
    Sweep,
    SweepEntry,
    load,
    make_overrides,
    select,
)
from pd_sessions.core.errors import ConfigError, PlanError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.preflight import host_refusal, missing_model_path, preflight


@dataclass(frozen=True)
class Selection:
    """The configs a run starts, with the command line's overrides applied."""

    sweep: Sweep
    platform: str  # "cpu" or "cuda", as preflight resolved it
    inv: Inventory  # the inventory to plan with (GPUs assumed on a --dry-run without them)
    note: str | None  # preflight's note (a dry run planning with assumed GPUs), else None
    configs: tuple[ClusterConfig, ...]  # the selected configs, overrides applied
    left_out: tuple[SweepEntry, ...]  # the rest of the sweep on this platform, overrides applied
    only: tuple[str, ...]  # the names --only gave (comma lists split)
    over: Overrides  # the command line's overrides
    warnings: tuple[str, ...]  # what --dry-run plans in spite of (refused without --dry-run)
    # The checks to run, in running order: --set checks=[...], else the sweep's for this
    # platform; then --check's.
    checks: tuple[str, ...] = ()


def only_names(items: Iterable[str]) -> tuple[str, ...]:
    """``--only a,b --only c`` -> ("a", "b", "c"); empty names are dropped."""
    return tuple(name for item in items for name in item.split(",") if name)


def checks(base: Iterable[str], added: Iterable[str]) -> tuple[str, ...]:
    """``base`` (the sweep's checks on this platform, or --set checks=[...]) plus ``added``
    (--check: names, comma lists, "faults" for every fault scenario, "wire" for every wire
    fault), validated like the TOML's ``checks`` (ConfigError naming an unknown one), in running order."""
    extra = [
        n
        for name in only_names(added)
        for n in {"faults": check_registry.FAULTS, "wire": check_registry.WIRE}.get(name, (name,))
    ]
    return check_registry.resolve(list(dict.fromkeys([*base, *extra])), field_name="--check")


def overrides(args: argparse.Namespace) -> Overrides:
    """The command line's per-run overrides (checked; applied per config later)."""
    return make_overrides(
        sets=args.set_fields,
        model=args.model,
        revision=args.revision,
        extra_args=args.extra_arg,
        # the connectors' own fields, set by their flags (an empty value: not set)
        named={o.field: getattr(args, o.field, None) or None for o in connectors.options()},
    )


def select_run(sweep_name: str, args: argparse.Namespace, inv: Inventory) -> Selection:
    """Load the sweep, check the overrides, preflight it on ``inv``, select its configs and
    refuse what this host cannot run (a connector's host refusal: Mooncake over RDMA without the
    device).

    Decision table (every refusal raises a PdError naming the field; nothing has started):
        an override that is not a config field / a bad value   -> ConfigError
        an unknown sweep, or a bad sweep file                   -> ConfigError
        the sweep cannot run on this platform or host           -> ConfigError / PlanError
        --check names an unknown check                          -> ConfigError("--check")
        --only names no config                                  -> ConfigError
        a host refusal, no --dry-run                            -> PlanError(its field)
        a host refusal, --dry-run                               -> a warning in the Selection
        a path-like model that does not exist, no --dry-run     -> ConfigError("--model" when the
                                                                   command line set it, else "model")
        the same, --dry-run                                     -> a warning in the Selection
        otherwise                                               -> the Selection
    """
    over = overrides(args)
    sweep = load(sweep_name)
    if over.check_options:
        sweep = dataclasses.replace(sweep, check_options=over.apply_check_options(sweep.check_options))
    platform, planned_inv, note = preflight(
        sweep, args.platform, inv, dry_run=args.dry_run, share_gpus=args.share_gpus
    )
    base = over.checks if over.checks is not None else sweep.checks_on(platform)
    selected = checks(base, getattr(args, "check", []))
    only = only_names(args.only)
    entries, left_out = select(
        sweep.entries(platform), platform, only=only, include_opt_in=args.include_opt_in
    )
    configs = tuple(over.apply(e.config) for e in entries)
    refusal = host_refusal(configs, platform, planned_inv)
    if refusal and not args.dry_run:
        raise PlanError(refusal.field, refusal.message)
    missing = model_problem(configs, over, sweep.source)
    if missing and not args.dry_run:
        raise missing
    return Selection(
        sweep=sweep,
        platform=platform,
        inv=planned_inv,
        note=note,
        configs=configs,
        left_out=tuple(dataclasses.replace(e, config=over.apply(e.config)) for e in left_out),
        only=only,
        over=over,
        warnings=tuple(str(w) for w in (refusal.message if refusal else None, missing) if w),
        checks=selected,
    )


def model_problem(configs: Iterable[ClusterConfig], over: Overrides, source: str) -> ConfigError | None:
    """The error for a path-like model that does not exist (core.preflight.missing_model_path),
    naming ``--model`` when the command line set the model, else the sweep file's ``model``."""
    found = missing_model_path(
        tuple(configs),
        exists=lambda p: os.path.exists(os.path.expanduser(p)),
        is_dir=os.path.isdir,
    )
    if found is None:
        return None
    if any(k == "model" for k, _ in over.fields):
        return ConfigError("--model", found[1], source=OVERRIDE_SOURCE)
    return ConfigError("model", found[1], source=source)
