"""Run every selected config of a sweep: plan, start, check, tear down, record.

Every config runs even when an earlier one failed. Library code: it logs and
reports progress through a callback; only the CLI prints.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

from pd_sessions import tiny_model
from pd_sessions.checks.accuracy import AccuracyOptions
from pd_sessions.checks import registry
from pd_sessions.checks.base import CheckResult
from pd_sessions.checks.runner import run_checks
from pd_sessions.cluster import DEFAULT_DEADLINE_S, DEFAULT_GRACE_S, Event, running_cluster
from pd_sessions.config import TINY_MODELS, ClusterConfig
from pd_sessions.errors import PdError
from pd_sessions.hosts import Inventory
from pd_sessions.plan import ClusterPlan, plan_cluster
from pd_sessions.ports import PortAllocator
from pd_sessions.report import ConfigResult, write_config_result

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
    accuracy: AccuracyOptions = AccuracyOptions()
    # Checks not run, by explicit request (printed in the banner, recorded in the results).
    skip_checks: tuple[str, ...] = ()
    # The sweep's selection (TOML `checks`) and options (TOML `[check_options.X]`).
    selected_checks: tuple[str, ...] = CHECKS
    check_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def checks(self) -> tuple[str, ...]:
        return tuple(c for c in self.selected_checks if c not in self.skip_checks)


def model_path(config: ClusterConfig, *, create: bool, cache: Path | None = None) -> str | None:
    """What --model gets: the generated tiny model's directory, or None (use config.model)."""
    if config.model not in TINY_MODELS:
        return None
    spec = tiny_model.TinySpec(architecture=config.model.removeprefix("tiny-"))
    path = tiny_model.ensure(spec, cache) if create else tiny_model.model_dir(spec, cache)
    return str(path)


def make_plan(config: ClusterConfig, inv: Inventory, ports: PortAllocator, opts: SweepOptions,
              *, create_model: bool) -> ClusterPlan:
    return plan_cluster(config, inv, ports, platform=opts.platform, python=opts.python,
                        model=model_path(config, create=create_model, cache=opts.model_cache),
                        allow_unpinned=opts.allow_unpinned, share_gpus=opts.share_gpus)


def run_config(config: ClusterConfig, inv: Inventory, opts: SweepOptions,
               progress: Callable[[str], None],
               on_event: Callable[[Event], None] | None = None) -> ConfigResult:
    """Plan, start, check, tear down and record one config (``on_event``: see running_cluster)."""
    res = ConfigResult(name=config.name, shape=config.shape, connector=config.connector,
                       platform=opts.platform)
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
            with running_cluster(plan, run_dir, ports=ports, deadline_s=opts.deadline_s,
                                 grace_s=opts.grace_s, progress=progress,
                                 timings=res.timings, on_event=on_event) as cluster:
                t = time.monotonic()
                try:
                    cluster.guard(lambda: run_checks(cluster, checks, opts.accuracy, opts.skip_checks,
                                                     selected=opts.selected_checks,
                                                     options=opts.check_options),
                                  when="while checks ran")
                finally:
                    res.phases["checks"] = time.monotonic() - t
                    res.checks = list(checks)
                    for c in checks:
                        progress(f"{config.name}: {c.name} {c.verdict.upper()}: {c.message}")
        finally:
            _fill_phases(res)
    except PdError as e:
        res.error = str(e)
        progress(f"{config.name}: ERROR: {str(e).splitlines()[0]}")
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


def run_sweep(configs: Sequence[ClusterConfig], inv: Inventory, opts: SweepOptions,
              progress: Callable[[str], None]) -> list[ConfigResult]:
    results = []
    for i, config in enumerate(configs, 1):
        progress(f"[{i}/{len(configs)}] {config.name}: {config.shape}, {config.connector}")
        results.append(run_config(config, inv, opts, progress))
        progress(f"[{i}/{len(configs)}] {config.name}: {results[-1].outcome.upper()}")
    return results
