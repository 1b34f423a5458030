"""A running P/D cluster as a context manager: start a plan, always tear it down.

    with running_cluster(plan, run_dir) as cluster:
        cluster.guard(lambda: do_checks(cluster), when="while checks ran")

Start: every instance and the router at once (each in its own session, output to
``run_dir/<name>.log``), the router behind a gate (runtime/gate.py: its imports done, it waits);
wait until every instance is ready (alive, /health 200, /v1/models lists the model), then open
the router's gate and, while it looks at its workers, warm every (prefill, decode) pair with a
request aimed at it (pd_sessions.runtime.pairs); then wait until the router is ready: /health
200 and a 1-token completion through it. (Started with the instances and no gate, vllm-router
saw them only at its next whole-second poll, 0.6-1.0 s after they were ready; started once they
were, its own imports took 0.45-0.5 s.) Once every
instance is healthy, a P/D path that keeps failing ends the wait within PD_PATH_BUDGET_S.
Every process must stay alive throughout. Teardown (on success, error, SIGINT or SIGTERM
turned into exceptions by the CLI): our own requests still open to the cluster are cut, then
the router and the instances together, under one grace: SIGTERM -> grace -> SIGKILL ->
verified gone; the router gets its SIGKILL after ROUTER_CUT_S already (see ``teardown``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from pd_sessions.core.errors import PdError, ReadinessTimeout, StopError
from pd_sessions.core.plan import ClusterPlan, ProcessSpec
from pd_sessions.runtime import gate, http, pairs, process, routeguard
from pd_sessions.runtime.launcher import LOCAL, Launcher
from pd_sessions.runtime.ports import PortAllocator
from pd_sessions.runtime.process import Running
from pd_sessions.runtime.readiness import Target, guarded, health_probe, models_probe, wait_ready

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_DEADLINE_S = 1200.0
DEFAULT_GRACE_S = 10.0
# vllm-router exits at once on SIGTERM unless it is forwarding requests: then it waits for them,
# while the instances behind it (stopping too) wait for its connections to close.
ROUTER_CUT_S = 1.0
ROUTER_PROBE_PROMPT = "Ready"
# How often the router's /health is probed once it is started: each tick the harness adds on top
# of its own start-up is on every config's critical path. (A failing completion through it is
# retried every 0.2 s: a broken P/D path is not flooded.)
ROUTER_TICK_S = 0.02


@dataclass(frozen=True)
class Event:
    """A moment in a cluster's life, for observers (the benchmark): see ``running_cluster``."""

    kind: str  # "spawned" | "ready"
    name: str  # the process: "prefill-0", "router"...
    at: float  # time.monotonic()
    health_url: str | None = None  # with "spawned"


@dataclass
class Cluster:
    plan: ClusterPlan
    run_dir: Path
    instances: list[Running] = field(default_factory=list)
    router: Running | None = None
    # phase name -> seconds; filled as the cluster starts and stops
    timings: dict[str, float] = field(default_factory=dict)
    # what started the processes and stops them (here, or each on its Ray node)
    launcher: Launcher = LOCAL
    # the environment the processes started with (a restart uses it again)
    base_env: dict[str, str] = field(default_factory=dict)
    # instances stopped on purpose (a fault scenario), name -> the process that was stopped
    down: dict[str, Running] = field(default_factory=dict)

    @property
    def processes(self) -> list[Running]:
        """What must stay alive: every instance not stopped on purpose, and the router."""
        return self.instances + ([self.router] if self.router else [])

    @property
    def router_url(self) -> str:
        return self.plan.router.url

    def guard(
        self,
        call: Callable[[], T],
        *,
        when: str = "while checks ran",
        timeout: float | None = None,
        heartbeat: Callable[[], None] | None = None,
    ) -> T:
        """Run ``call``; fail at once if any process of the cluster exits meanwhile."""
        return guarded(call, watch=lambda: self.processes, when=when, timeout=timeout, heartbeat=heartbeat)

    def instance(self, name: str) -> Running:
        """The running instance ``name`` (KeyError naming the ones there are)."""
        for r in self.instances:
            if r.name == name:
                return r
        raise KeyError(f"no running instance {name!r} (running: {', '.join(r.name for r in self.instances)})")

    def kill_instance(self, name: str) -> Running:
        """SIGKILL instance ``name`` on purpose (a fault scenario: a peer dying mid-transfer).

        It leaves the watched processes first, so no guard takes this death for a failure;
        then its group is SIGKILLed and every PID verified gone (process.kill; the reaper hears
        of it). It stays in ``down`` until :meth:`restart_instance`; teardown skips it."""
        r = self.instance(name)
        self.down[name] = r
        self.instances = [x for x in self.instances if x is not r]  # one assignment: guards read it
        rep = process.kill(r)
        log.info(
            "%s (pid %d) SIGKILLed on purpose: %d processes gone %.2f s after the signal",
            name,
            r.pid,
            len(rep.pids),
            rep.seconds,
        )
        return r

    def restart_instance(
        self, name: str, *, deadline_s: float, say: Callable[[str], None] | None = None
    ) -> Running:
        """Start instance ``name``, stopped by :meth:`kill_instance`, again from its planned spec:
        the same argv, environment, ports and role, its output appended to the same log. It is
        watched (and torn down) from its spawn on; the reaper hears of it as of any spawn. Waits
        until it is ready (alive, /health 200, the model listed) while every other process
        stays alive; ReadinessTimeout or ProcessExited as at start-up; StopError, starting
        nothing, while a process of the killed one is still alive."""
        if name not in self.down:
            raise KeyError(f"{name} was not stopped on purpose (stopped: {', '.join(self.down) or 'none'})")
        if left := process.still_running([self.down[name]]):
            # a SIGKILLed process that outlived kill_instance's wait still holds the ports
            raise StopError(
                f"{name} not started again: its killed processes are still alive ({', '.join(left)})"
            )
        spec = next(s for s in self.plan.instances if s.name == name)
        order = [s.name for s in self.plan.instances]
        with process.signals_deferred():
            new = self.launcher.spawn(spec, self.run_dir, self.base_env)
            self.instances = sorted([*self.instances, new], key=lambda r: order.index(r.name))
        del self.down[name]
        others = [p for p in self.processes if p is not new]
        wait_ready(
            [
                Target(
                    new, [health_probe(spec.health_url), models_probe(spec.url, self.plan.served_model_name)]
                )
            ],
            deadline=time.monotonic() + deadline_s,
            also_alive=others,
            progress=say,
        )
        return new


def spawn_spec(spec: ProcessSpec, run_dir: Path, base_env: Mapping[str, str]) -> Running:
    """Start one planned process on this host, its output going to ``run_dir/<log_name>``."""
    return LOCAL.spawn(spec, run_dir, base_env)


def _router_completion_probe(
    cluster: Cluster, deadline: float, tick: float, say: Callable[[str], None], pd_path: bool = False
) -> None:
    """Retry a 1-token completion through the router until it answers or the deadline.
    ``pd_path``: the deadline is the P/D path budget (every instance healthy), so running
    out of it raises PdPathFailed with the router's answer and the decodes' error lines."""
    plan = cluster.plan
    last = "no answer yet"
    t0 = time.monotonic()

    def heartbeat() -> None:
        say(
            f"waiting {time.monotonic() - t0:.0f} s (deadline in {deadline - time.monotonic():.0f} s) "
            f"for a 1-token completion through the router (last: {last})"
        )

    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            r = cluster.router
            assert r is not None
            if pd_path:  # every instance is healthy: the P/D path itself keeps failing
                raise pairs.PdPathFailed(
                    f"router ({plan.router.url})",
                    waited_s=time.monotonic() - t0,
                    last=last,
                    router_answer=last,
                    decode=", ".join(d.name for d in plan.decode),
                    decode_errors=[
                        f"{i.name}: {line}"
                        for i in cluster.instances
                        if i.name.startswith("decode")
                        for line in pairs.log_errors(i.log_path)
                    ],
                )
            raise ReadinessTimeout(
                "router",
                url=plan.router.url,
                waited_s=time.monotonic() - r.started_at,
                last_probe=f"1-token completion: {last}",
                log_path=r.log_path,
                log_tail=r.log_tail(),
            )
        try:
            cluster.guard(
                partial(
                    http.completion,
                    plan.router.url,
                    plan.served_model_name,
                    ROUTER_PROBE_PROMPT,
                    max_tokens=1,
                    timeout=min(remaining, 120.0),
                ),
                when="while the router was starting",
                heartbeat=heartbeat,
            )
            return
        except http.HttpError as e:
            last = str(e)
        time.sleep(tick)


@contextmanager
def running_cluster(
    plan: ClusterPlan,
    run_dir: Path,
    *,
    ports: PortAllocator | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    grace_s: float = DEFAULT_GRACE_S,
    progress: Callable[[str], None] | None = None,
    base_env: Mapping[str, str] | None = None,
    tick: float = 0.1,
    timings: dict[str, float] | None = None,
    on_event: Callable[[Event], None] | None = None,
    pd_path_budget_s: float = pairs.PD_PATH_BUDGET_S,
    launcher: Launcher = LOCAL,
    freed: Callable[[], None] | None = None,
) -> Iterator[Cluster]:
    """Start ``plan`` and yield the ready :class:`Cluster`; always tear it down.

    ``ports`` (the allocator that planned the ports) is released right before
    the processes start, so the ports stay reserved until then. ``timings``, if
    given, is filled with phase durations even when starting fails. ``on_event``
    is told when each process is spawned and when it is noticed ready (it must
    return quickly). ``launcher`` starts and stops the processes (runtime/launcher.py: here, or
    each on its Ray node). ``freed``: see :func:`teardown`.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if base_env is None else base_env)
    cluster = Cluster(
        plan=plan,
        run_dir=run_dir,
        timings={} if timings is None else timings,
        launcher=launcher,
        base_env=env,
    )
    t0 = time.monotonic()
    deadline = t0 + deadline_s
    say = progress or (lambda msg: log.info("%s", msg))
    tell = on_event or (lambda event: None)
    try:
        if ports is not None:
            ports.release()
        router = _spawn_all(cluster, env, tell, launcher)
        say(
            f"{plan.config.name}: started {len(plan.instances)} instances and the router; "
            f"waiting up to {deadline_s:.0f} s for them (logs in {run_dir})"
        )
        _wait_instances(cluster, router, deadline, say=say, tell=tell, tick=tick)
        cluster.timings["instances_ready"] = time.monotonic() - t0
        _warm_pairs_and_router(cluster, router, deadline, pd_path_budget_s, say=say, tell=tell, tick=tick)
        say(
            f"{plan.config.name}: cluster ready after {time.monotonic() - t0:.1f} s "
            f"(router {plan.router.url})"
        )
        yield cluster
    except PdError as e:
        # Said before teardown, so the failure shows the moment it is detected.
        say(f"{plan.config.name}: FAILED: {e}")
        say(f"{plan.config.name}: tearing down {len(cluster.processes)} processes")
        raise
    finally:
        t2 = time.monotonic()
        try:
            teardown(cluster.router, cluster.instances, grace_s=grace_s, launcher=launcher, freed=freed)
        finally:
            cluster.timings["teardown"] = time.monotonic() - t2


def _spawn_all(
    cluster: Cluster, env: Mapping[str, str], tell: Callable[[Event], None], launcher: Launcher
) -> Running:
    """Start every instance and the router (behind its gate) at once, each told as spawned; the
    router's Running."""
    plan = cluster.plan
    # Deferred: a cancel between a Popen and this list would leave a server untracked.
    with process.signals_deferred():
        for spec in plan.instances:
            cluster.instances.append(launcher.spawn(spec, cluster.run_dir, env))
            tell(Event("spawned", spec.name, cluster.instances[-1].started_at, spec.health_url))
        # The router imports while the instances start, then waits at its gate until they are
        # ready (_warm_pairs_and_router opens it): its first look at its workers finds them.
        held = dataclasses.replace(plan.router, argv=tuple(gate.gated(plan.router.argv)))
        router = cluster.router = launcher.spawn(held, cluster.run_dir, env)
    tell(Event("spawned", "router", router.started_at, plan.router.health_url))
    return router


def _wait_instances(
    cluster: Cluster,
    router: Running,
    deadline: float,
    *,
    say: Callable[[str], None],
    tell: Callable[[Event], None],
    tick: float,
) -> None:
    """Wait until every instance is ready (alive, /health 200, the model listed) while the router
    stays alive; record each one's time to ready (``<name>_ready``) and tell it."""
    plan = cluster.plan
    targets = [
        Target(r, [health_probe(s.health_url), models_probe(s.url, plan.served_model_name)])
        for r, s in zip(cluster.instances, plan.instances, strict=True)
    ]
    wait_ready(targets, deadline=deadline, also_alive=[router], progress=say, tick=tick)
    for t in targets:
        assert t.ready_at is not None
        cluster.timings[f"{t.running.name}_ready"] = t.ready_at - t.running.started_at
        tell(Event("ready", t.running.name, t.ready_at))


def _warm_pairs_and_router(
    cluster: Cluster,
    router: Running,
    deadline: float,
    pd_path_budget_s: float,
    *,
    say: Callable[[str], None],
    tell: Callable[[Event], None],
    tick: float,
) -> None:
    """Every instance is ready: open the router's gate, warm each (prefill, decode) pair while it
    looks at its workers, then wait for it (/health 200 and a completion through it); record
    ``pairs_warm`` and ``router_ready``."""
    plan = cluster.plan
    t1 = time.monotonic()
    for s in plan.instances:  # the router connects to them: through their run's bridge, or not at all
        routeguard.check(urlsplit(s.url).hostname)
    gate.open_gate(router)
    # Every instance is healthy: from here a P/D path that keeps failing ends the wait
    # within the budget, not at the overall deadline.
    pd_deadline = min(deadline, time.monotonic() + pd_path_budget_s)
    took = pairs.warm_pairs(
        plan,
        deadline=pd_deadline,
        logs={r.name: r.log_path for r in cluster.instances},
        guard=lambda call: cluster.guard(call, when="while warming P/D pairs"),
        say=say,
    )
    cluster.timings["pairs_warm"] = time.monotonic() - t1
    say(
        f"{plan.config.name}: warmed {len(took)} P/D pair(s) with a request aimed at each "
        f"({', '.join(f'{k} {v:.1f} s' for k, v in took.items())})"
    )
    wait_ready(
        [Target(router, [health_probe(plan.router.health_url)])],
        deadline=deadline,
        also_alive=cluster.instances,
        progress=say,
        tick=min(tick, ROUTER_TICK_S),
    )
    _router_completion_probe(cluster, pd_deadline, tick=0.2, say=say, pd_path=pd_deadline < deadline)
    cluster.timings["router_ready"] = time.monotonic() - t1
    tell(Event("ready", "router", time.monotonic()))


def teardown(
    router: Running | None,
    instances: Sequence[Running],
    *,
    grace_s: float = DEFAULT_GRACE_S,
    launcher: Launcher = LOCAL,
    freed: Callable[[], None] | None = None,
) -> None:
    """Stop the router and the instances together, under one shared grace: SIGTERM to all
    (the router's first), one wait of at most ``grace_s``, SIGKILL to what is left, every PID
    verified gone (StopError names survivors).

    Together, not one group after the other: a cancel gives the whole teardown one grace
    (Buildkite SIGKILLs 10 s after its SIGTERM), and a healthy cluster is gone in the time
    its slowest process takes to exit (~1.5 s for vLLM's API server on the CPU lane).

    Requests still in flight would hold that up until the SIGKILL: vLLM's API server, once
    stopping, aborts its engine but waits for its open connections, whose requests then never
    end. So first our own connections to the cluster are cut (a check cancelled mid-request),
    and the router, if it still forwards requests ``ROUTER_CUT_S`` after its SIGTERM (ours
    were cut; these are other processes': a user's tests, ``serve``'s users), is
    SIGKILLed then: it holds no state, and its connections to the instances close with it.

    ``freed`` is called once the processes that hold devices (the instances' engine cores and
    workers) are gone, while the rest may still exit: the next config may start then
    (run/packed.py); see process.stop_leaders.

    An instance's API server whose engine core and workers are gone, and whose log holds its
    last words (:class:`ShutdownLogged`), gets SIGKILL then: what is left of its graceful exit is
    the interpreter's own shutdown (0.3-0.4 s on the CPU lane, measured), with nothing to free.
    """
    group = ([router] if router else []) + list(instances)
    if not group:
        return
    addresses = [a for a in map(_address, group) if a is not None]
    with http.held(addresses):  # a check's thread still running opens no new request meanwhile
        cut = process.cut_connections(addresses)
        if cut:
            log.info("cut %d request(s) of ours still open to the cluster", cut)
        early = {router.name: ROUTER_CUT_S} if router else None
        ended = {r.name: ShutdownLogged(r.log_path) for r in instances}
        rep = launcher.stop(group, grace_s=grace_s, early=early, freed=freed, after_children=ended)
    if rep.killed:
        log.warning("needed SIGKILL: %s", ", ".join(rep.killed))


# The last line uvicorn writes as vLLM's API server shuts down (after its engine client stopped).
SHUTDOWN_LINE = b"Application shutdown complete."


class ShutdownLogged:
    """Asked (process.stop_leaders' ``after_children``) once an API server's engine core and
    workers are gone: true once the end of its log holds uvicorn's SHUTDOWN_LINE (its own
    shutdown is logged, so its log is complete). A server that never writes it (one that ignores
    SIGTERM, another server) is left to exit by itself, or to the SIGKILL at the grace's end."""

    def __init__(self, log_path: Path):
        self.log_path = log_path

    def __call__(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                return SHUTDOWN_LINE in f.read()
        except OSError:
            return False


def _address(r: Running) -> tuple[str, int] | None:
    """(host, port) of ``r``'s HTTP server, from its URL."""
    if r.url is None:
        return None
    u = urlsplit(r.url)
    return (u.hostname, u.port) if u.hostname and u.port else None
