"""Run every selected config of a sweep: plan, start, check, tear down, record.

Every config runs even when an earlier one failed. Library code: it logs and
reports progress through a callback; only the CLI prints.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_sessions import tiny_model, unfinished, user_commands
from pd_sessions.checks import registry
from pd_sessions.checks.accuracy import AccuracyOptions
from pd_sessions.checks.base import CheckResult
from pd_sessions.checks.runner import run_checks
from pd_sessions.cluster import DEFAULT_DEADLINE_S, DEFAULT_GRACE_S, Event, running_cluster
from pd_sessions.config import TINY_MODELS, ClusterConfig
from pd_sessions.errors import PdError
from pd_sessions.hosts import Inventory
from pd_sessions.plan import GPU_PASSTHROUGH_ENV, ClusterPlan, plan_cluster
from pd_sessions.ports import PortAllocator
from pd_sessions.report import RUNNING, ConfigResult, write_config_result

log = logging.getLogger(__name__)

CHECKS = registry.DEFAULTS


@dataclass(frozen=True)
class SweepOptions:
    platform: str
    results_dir: Path
    deadline_s: float = DEFAULT_DEADLINE_S
    grace_s: float = DEFAULT_GRACE_S
    python: str = sys.executable
    model_cache: Path | None = None
    allow_unpinned: bool = False
    share_gpus: bool = False
    accuracy: AccuracyOptions = field(default_factory=AccuracyOptions)
    # Checks not run, by explicit request (printed in the banner, recorded in the results).
    skip_checks: tuple[str, ...] = ()
    # The command line's overrides, described (already applied to the configs; recorded).
    overrides: tuple[str, ...] = ()
    # The user's own commands (--exec, --pytest), run after the checks: check exec[N] each.
    commands: tuple[user_commands.UserCommand, ...] = ()
    exec_timeout_s: float = user_commands.DEFAULT_TIMEOUT_S
    # The sweep's selection (TOML `checks`) and options (TOML `[check_options.X]`).
    selected_checks: tuple[str, ...] = CHECKS
    check_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def checks(self) -> tuple[str, ...]:
        return tuple(c for c in self.selected_checks if c not in self.skip_checks) + tuple(
            c.name for c in self.commands
        )


def model_path(
    config: ClusterConfig, *, create: bool, cache: Path | None = None, weights_seed: int | None = None
) -> str | None:
    """What --model gets: the generated tiny model's directory, or None (use config.model)."""
    if config.model not in TINY_MODELS:
        return None
    spec = tiny_model.spec_for(config.model, weights_seed=weights_seed)
    path = tiny_model.ensure(spec, cache) if create else tiny_model.model_dir(spec, cache)
    return str(path)


def make_plan(
    config: ClusterConfig, inv: Inventory, ports: PortAllocator, opts: SweepOptions, *, create_model: bool
) -> ClusterPlan:
    return plan_cluster(
        config,
        inv,
        ports,
        platform=opts.platform,
        python=opts.python,
        model=model_path(config, create=create_model, cache=opts.model_cache),
        decode_model=(
            model_path(
                config, create=create_model, cache=opts.model_cache, weights_seed=config.decode_weights_seed
            )
            if config.decode_weights_seed is not None
            else None
        ),
        allow_unpinned=opts.allow_unpinned,
        share_gpus=opts.share_gpus,
        overrides=opts.overrides,
        passthrough_env={k: os.environ[k] for k in GPU_PASSTHROUGH_ENV if k in os.environ},
    )


def new_result(config: ClusterConfig, opts: SweepOptions) -> ConfigResult:
    return ConfigResult(
        name=config.name,
        shape=config.shape,
        connector=config.connector,
        platform=opts.platform,
        overrides=list(opts.overrides),
    )


def run_config(
    config: ClusterConfig,
    inv: Inventory,
    opts: SweepOptions,
    progress: Callable[[str], None],
    on_event: Callable[[Event], None] | None = None,
    into: ConfigResult | None = None,
) -> ConfigResult:
    """Plan, start, check, tear down and record one config (``on_event``: see running_cluster).

    ``into``: the record to fill (else a new one). An unforeseen exception (not a PdError)
    errors this config, its traceback in ``error.log``; a stop (SIGINT, SIGTERM) marks it
    cancelled, writes its result.json, and goes on up.
    """
    res = into or new_result(config, opts)
    run_dir = opts.results_dir / config.name
    res.run_dir = str(run_dir)
    t = time.monotonic()
    ports = PortAllocator(config.host)
    try:
        try:
            plan = make_plan(config, inv, ports, opts, create_model=True)
        finally:
            res.phases["plan"] = time.monotonic() - t
        res.warnings = list(plan.warnings)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "plan.txt").write_text(plan.render() + "\n")
        checks: list[CheckResult] = []
        try:
            with running_cluster(
                plan,
                run_dir,
                ports=ports,
                deadline_s=opts.deadline_s,
                grace_s=opts.grace_s,
                progress=progress,
                timings=res.timings,
                on_event=on_event,
            ) as cluster:
                t = time.monotonic()
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
                    res.checks = list(checks)
                    for c in checks:
                        progress(f"{config.name}: {c.name} {c.verdict.upper()}: {c.message}")
                        if "traceback" in c.details:  # it crashed: see checks.base.crashed
                            with open(run_dir / "checks.log", "a") as f:
                                f.write(f"--- {c.name} crashed ---\n{c.details['traceback']}")
        finally:
            _fill_phases(res)
    except PdError as e:
        res.error = str(e)
        progress(f"{config.name}: ERROR: {str(e).splitlines()[0]}")
    except Exception as e:  # a bug, or a library failing in a way we did not foresee
        log_path = unfinished.crash_log(run_dir, "error", e)
        res.error = f"internal error: {type(e).__name__}: {e} (traceback in {log_path})"
        progress(f"{config.name}: ERROR: {res.error}")
    except BaseException as e:  # a stop: record this config as cancelled, then let it go on up
        unfinished.cancel(res, unfinished.stop_cause(e))
        write_config_result(res, run_dir / "result.json")
        raise
    finally:
        ports.release()
    res.decide(opts.checks)
    write_config_result(res, run_dir / "result.json")
    return res


def _fill_phases(res: ConfigResult) -> None:
    timings = res.timings
    if "instances_ready" in timings:
        res.phases["start"] = timings["instances_ready"]
    if "router_ready" in timings:
        res.phases["router"] = timings["router_ready"]
    if "teardown" in timings:
        res.phases["teardown"] = timings["teardown"]


def run_sweep(
    configs: Sequence[ClusterConfig],
    inv: Inventory,
    opts: SweepOptions,
    progress: Callable[[str], None],
    results: list[ConfigResult] | None = None,
    on_change: Callable[[list[ConfigResult]], None] | None = None,
) -> list[ConfigResult]:
    """Run every config; one record each, returned (and appended to ``results`` if given).

    Each record joins ``results`` as its config starts (outcome ``running``), so a caller that
    a stop interrupts still holds the finished ones and the cancelled one. ``on_change`` is
    called as each config starts and ends (to write a provisional summary).
    """
    results = [] if results is None else results
    for i, config in enumerate(configs, 1):
        progress(f"[{i}/{len(configs)}] {config.name}: {config.shape}, {config.connector}")
        res = new_result(config, opts)
        res.outcome = RUNNING
        results.append(res)
        if on_change:
            on_change(results)
        run_config(config, inv, opts, progress, into=res)
        progress(f"[{i}/{len(configs)}] {config.name}: {results[-1].outcome.upper()}")
        if on_change:
            on_change(results)
    return results
