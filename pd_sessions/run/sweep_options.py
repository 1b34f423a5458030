"""What a sweep (and ``serve``, the bench, the pytest fixture) runs with: the options, and the
plan of one config."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_sessions.checks.accuracy import AccuracyOptions
from pd_sessions.core import check_registry, digest_records
from pd_sessions.core.config import TINY_MODELS, ClusterConfig
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan import GPU_PASSTHROUGH_ENV, ClusterPlan, plan_cluster
from pd_sessions.core.plan.across_hosts import HostLayout
from pd_sessions.core.port_source import PortSource
from pd_sessions.run import user_commands
from pd_sessions.runtime import tiny_model
from pd_sessions.runtime.cluster import DEFAULT_DEADLINE_S, DEFAULT_GRACE_S
from pd_sessions.runtime.pairs import PD_PATH_BUDGET_S
from pd_sessions.runtime.ports import PortAllocator

CHECKS = check_registry.DEFAULTS


@dataclass(frozen=True)
class SweepOptions:
    platform: str
    results_dir: Path
    deadline_s: float = DEFAULT_DEADLINE_S
    # Once every instance is healthy, how long a P/D path may keep failing (runtime/pairs.py).
    pd_path_budget_s: float = PD_PATH_BUDGET_S
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
    # The checks whose NOT RUN fails the config (the sweep's declaration), and --strict (every one).
    required_checks: tuple[str, ...] = ()
    strict: bool = False
    check_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Across hosts: the Ray cluster to run on (an address, or "auto"); None: this host only.
    ray: str | None = None
    # Across the simulated hosts of this machine (--simulate-hosts N, runtime/simhosts.py); 0: none.
    simulate_hosts: int = 0
    # Across hosts: plan an advertised loopback address anyway (it must then fail).
    allow_loopback_advertise: bool = False
    # The most configs run at once (--max-parallel; core/plan/packing.py); None: as many as fit.
    max_parallel: int | None = None

    @property
    def checks(self) -> tuple[str, ...]:
        return tuple(c for c in self.selected_checks if c not in self.skip_checks) + tuple(
            c.name for c in self.commands
        )


def model_path(
    config: ClusterConfig, *, create: bool, cache: Path | None = None, weights_seed: int | None = None
) -> str | None:
    """What --model gets: the generated tiny model's directory, a ``~`` path expanded (vLLM would
    take "~/..." for a hub id), or None (use config.model)."""
    if config.model.startswith("~"):
        return os.path.expanduser(config.model)
    if config.model not in TINY_MODELS:
        return None
    spec = tiny_model.spec_for(config.model, weights_seed=weights_seed)
    path = tiny_model.ensure(spec, cache) if create else tiny_model.model_dir(spec, cache)
    return str(path)


def faults_control(config: ClusterConfig, opts: SweepOptions) -> str | None:
    """The control file of a config whose checks inject faults (its connectors are then wrapped
    by the fault injector), else None."""
    if not check_registry.injects_faults(opts.checks):
        return None
    return str((opts.results_dir / config.name / "faults.json").resolve())


def kv_digest_dir(config: ClusterConfig, opts: SweepOptions) -> str | None:
    """The run directory of a config whose checks include ``kv_digest`` (its instances' observers
    write their side files there), else None: the connectors stay unwrapped for it, also where the
    digest has nothing to compare (digest_records.not_covered: the check then says so)."""
    if check_registry.KV_DIGEST not in opts.checks:
        return None
    if digest_records.not_covered(config.connector, decode_kv_transfer=config.decode_kv_transfer):
        return None
    return str((opts.results_dir / config.name).resolve())


def make_plan(
    config: ClusterConfig,
    inv: Inventory,
    ports: PortAllocator,
    opts: SweepOptions,
    *,
    create_model: bool,
    layout: HostLayout | None = None,
    host_ports: Mapping[str, PortSource] | None = None,
) -> ClusterPlan:
    """The plan of ``config`` on this host, or across the hosts of ``layout`` (run/ray_hosts.py)."""
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
        layout=layout,
        host_ports=host_ports,
        faults_control=faults_control(config, opts),
        kv_digest_dir=kv_digest_dir(config, opts),
    )
