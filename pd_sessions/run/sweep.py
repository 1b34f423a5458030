"""Run every selected config of a sweep: plan, start, check, tear down, record.

Every config runs even when an earlier one failed. Library code: it logs and
reports progress through a callback; only the CLI prints.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from pd_sessions.checks.runner import run_checks
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import PdError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan import ClusterPlan
from pd_sessions.core.plan.packing import Packing, pack
from pd_sessions.core.results import RUNNING, CheckResult, ConfigResult, ProcessRecord
from pd_sessions.report import unfinished
from pd_sessions.report.writers import write_config_result
from pd_sessions.run import packed, user_commands
from pd_sessions.run.ray_hosts import loopback_said, phase_one
from pd_sessions.run.sweep_options import SweepOptions, make_plan
from pd_sessions.runtime.cluster import Event, running_cluster
from pd_sessions.runtime.launcher import LOCAL
from pd_sessions.runtime.ports import PortAllocator
from pd_sessions.runtime.raylaunch import RayHosts, RemotePorts

log = logging.getLogger(__name__)


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
    hosts: RayHosts | None = None,
    freed: Callable[[], None] | None = None,
) -> ConfigResult:
    """Plan, start, check, tear down and record one config (``on_event``: see running_cluster;
    ``hosts``: across Ray hosts, run/ray_hosts.py; ``freed``: its devices are free, cluster.teardown).

    ``into``: the record to fill (else a new one). An unforeseen exception (not a PdError)
    errors this config, its traceback in ``error.log``; a stop (SIGINT, SIGTERM) marks it
    cancelled, writes its result.json, and goes on up.
    """
    res = into or new_result(config, opts)
    run_dir = opts.results_dir / config.name
    res.run_dir = str(run_dir)
    t = time.monotonic()
    res.started_at = res.phase_starts["plan"] = time.time()
    ports = PortAllocator(config.host)
    remote: dict[str, RemotePorts] = {}
    try:
        try:
            layout = None
            if hosts is not None:
                layout, remote = phase_one(hosts, config, opts, create_model=True)
            plan = make_plan(config, inv, ports, opts, create_model=True, layout=layout, host_ports=remote)
        finally:
            res.phases["plan"] = time.monotonic() - t
        res.warnings = list(plan.warnings)
        res.model = plan.model
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "plan.txt").write_text(plan.render() + "\n")
        checks: list[CheckResult] = []
        res.phase_starts["start"] = time.time()
        try:
            with running_cluster(
                plan,
                run_dir,
                ports=ports,
                deadline_s=opts.deadline_s,
                pd_path_budget_s=opts.pd_path_budget_s,
                grace_s=opts.grace_s,
                progress=progress,
                timings=res.timings,
                on_event=_recorder(res, plan, on_event),
                launcher=hosts.launcher(run_dir, remote) if hosts else LOCAL,
                freed=freed,
            ) as cluster:
                t = time.monotonic()
                res.phase_starts["checks"] = time.time()
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
                    _record_checks(res, checks, run_dir, progress)
        finally:
            _fill_phases(res)
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
    finally:
        ports.release()
        for p in remote.values():
            p.release()
    res.decide(opts.checks)
    if res.outcome != "passed" and loopback_said(res.warnings) not in (res.error or "-"):
        progress(f"{config.name}: {res.outcome}{loopback_said(res.warnings)}")
    write_config_result(res, run_dir / "result.json")
    return res


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


def _recorder(
    res: ConfigResult, plan: ClusterPlan, on_event: Callable[[Event], None] | None
) -> Callable[[Event], None]:
    """Records in ``res.processes`` when each process of ``plan`` was spawned and how long it
    took to be ready (the timeline's bars), then passes the event on to ``on_event``."""
    res.processes = [ProcessRecord(s.name, s.role, s.host, s.log_name) for s in plan.processes]
    by_name = {p.name: p for p in res.processes}
    spawned: dict[str, float] = {}

    def record(event: Event) -> None:
        p = by_name.get(event.name)
        if p is not None and event.kind == "spawned":
            spawned[event.name] = event.at
            p.started_at = time.time() - (time.monotonic() - event.at)  # event.at is monotonic
        elif p is not None and event.kind == "ready" and event.name in spawned:
            p.ready_s = event.at - spawned[event.name]
        if on_event is not None:
            on_event(event)

    return record


def _fill_phases(res: ConfigResult) -> None:
    """The phases the cluster timed (called as its teardown ends), with their starts."""
    timings = res.timings
    start = res.phase_starts.get("start")
    if "instances_ready" in timings:
        res.phases["start"] = timings["instances_ready"]
        if start is not None:  # the router phase begins once every instance is ready
            res.phase_starts["router"] = start + timings["instances_ready"]
    if "router_ready" in timings:
        res.phases["router"] = timings["router_ready"]
    if "teardown" in timings:
        res.phases["teardown"] = timings["teardown"]
        res.phase_starts["teardown"] = time.time() - timings["teardown"]  # it has just ended


def run_sweep(
    configs: Sequence[ClusterConfig],
    inv: Inventory,
    opts: SweepOptions,
    progress: Callable[[str], None],
    results: list[ConfigResult] | None = None,
    on_change: Callable[[list[ConfigResult]], None] | None = None,
    hosts: RayHosts | None = None,
) -> list[ConfigResult]:
    """Run every config; one record each, returned in the sweep's order (and put in ``results``
    if given).

    Configs that fit on the host at once run side by side (core/plan/packing.py, run/packed.py;
    ``opts.max_parallel``); otherwise one after another, in this thread. Each record joins
    ``results`` as its config starts (outcome ``running``), so a caller that a stop interrupts
    still holds the finished ones and the cancelled ones. ``on_change`` is called as each config
    starts and ends (to write a provisional summary).
    """
    results = [] if results is None else results
    packing = sweep_packing(configs, inv, opts, across_hosts=hosts is not None)
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
        run_config(config, inv, opts, progress, into=res, hosts=hosts)
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
