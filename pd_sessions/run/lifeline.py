"""Plan and start one config inside the lifeline: the one way a cluster comes up, for the sweep
(run/sweep.py), ``serve`` (run/serve.py) and the ``pd_cluster`` fixture (pytest_plugin.py).

The lifeline makes sure nothing outlives a stopped run: the parent watch (runtime/parentwatch.py)
turns the death of the harness's parent (nox, a CI agent, a shell) into SIGTERM, which the harness
tears down on, and the reaper (runtime/reaper.py), outside the harness's process group, stops
whatever the harness started when the harness itself is killed outright.

- :func:`lifeline`: the parent watch, the reaper and the run's hosts (``--ray``,
  ``--simulate-hosts``: run/ray_hosts.py), entered once for a whole run. Entered again inside
  itself (a sweep's configs, in its thread or in threads of their own), it gives the one entered.
- :func:`start_config`: plan one config (plan.txt in its run dir), start it and yield it ready,
  inside the lifeline (its own, when the caller is not in one yet); always torn down. What it
  did is kept in a :class:`ConfigResult` (the plan phase's time, the warnings, the processes'
  spawn and readiness times, the cluster's phases), which the sweep records and reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan import ClusterPlan
from pd_sessions.core.results import ConfigResult, ProcessRecord
from pd_sessions.run.ray_hosts import hosts_for, phase_one
from pd_sessions.run.sweep_options import SweepOptions, make_plan
from pd_sessions.runtime import process, reaper
from pd_sessions.runtime.cluster import Cluster, Event, running_cluster
from pd_sessions.runtime.launcher import LOCAL
from pd_sessions.runtime.ports import PortAllocator
from pd_sessions.runtime.raylaunch import RayHosts, RemotePorts

# The lifeline this process is in (at most one), with the run's hosts (None: this host only).
_entered: list[RayHosts | None] = []


@contextmanager
def lifeline(opts: SweepOptions, say: Callable[[str], None]) -> Iterator[RayHosts | None]:
    """The parent watch and the reaper (``opts.results_dir``/reaper.log) for the block, and the
    run's hosts joined (see the module docstring); the one already entered, if any."""
    if _entered:
        yield _entered[-1]
        return
    with (
        reaper.Lifeline(opts.results_dir, grace_s=opts.grace_s, warn=say) as life,
        process.observed(life.reaper),
        hosts_for(opts, say) as hosts,
    ):
        _entered.append(hosts)
        try:
            yield hosts
        finally:
            _entered.pop()


def new_result(config: ClusterConfig, opts: SweepOptions) -> ConfigResult:
    return ConfigResult(
        name=config.name,
        shape=config.shape,
        connector=config.connector,
        platform=opts.platform,
        overrides=list(opts.overrides),
        injected=config.injected,
    )


@contextmanager
def start_config(
    config: ClusterConfig,
    inv: Inventory,
    opts: SweepOptions,
    *,
    progress: Callable[[str], None],
    record: ConfigResult | None = None,
    on_event: Callable[[Event], None] | None = None,
    freed: Callable[[], None] | None = None,
) -> Iterator[Cluster]:
    """``config`` planned and started inside the lifeline, yielded ready; always torn down.

    ``record``: what to keep the plan's warnings and the timings in (else a throwaway);
    ``on_event``: see running_cluster; ``freed``: its devices are free (cluster.teardown)."""
    res = record or new_result(config, opts)
    run_dir = opts.results_dir / config.name
    res.run_dir = str(run_dir)
    ports = PortAllocator(config.host)
    remote: dict[str, RemotePorts] = {}
    try:
        with lifeline(opts, progress) as hosts:
            plan = _planned(config, inv, opts, res, ports=ports, hosts=hosts, remote=remote)
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
                    yield cluster
            finally:
                _fill_phases(res)
    finally:
        ports.release()
        for p in remote.values():
            p.release()


def _planned(
    config: ClusterConfig,
    inv: Inventory,
    opts: SweepOptions,
    res: ConfigResult,
    *,
    ports: PortAllocator,
    hosts: RayHosts | None,
    remote: dict[str, RemotePorts],
) -> ClusterPlan:
    """``config``'s plan (across ``hosts``: their facts first, phase 1, and their port sources
    put in ``remote``), timed and its warnings kept in ``res``, written to plan.txt."""
    t = time.monotonic()
    res.started_at = res.phase_starts["plan"] = time.time()
    try:
        layout = None
        if hosts is not None:
            layout, got = phase_one(hosts, config, opts, create_model=True)
            remote.update(got)
        plan = make_plan(config, inv, ports, opts, create_model=True, layout=layout, host_ports=remote)
    finally:
        res.phases["plan"] = time.monotonic() - t
    res.warnings = list(plan.warnings)
    res.model = plan.model
    run_dir = opts.results_dir / config.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "plan.txt").write_text(plan.render() + "\n")
    return plan


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
