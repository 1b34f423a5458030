"""The simulated hosts (edge): ``--simulate-hosts N`` rehearses a multi-host run on one machine.

N network namespaces on a bridge, each a "host" with its own address from 198.18.0.0/15, its own
loopback, a disjoint share of the machine's cores and a real Ray node; the Ray head (no CPUs), the
driver and the router stay on the root side, on the bridge's address. A server bound to a host's
loopback is NOT reachable from another host: the bugs that hide behind one shared loopback
(NIXL's side channel on localhost, Mooncake advertising 127.0.0.1) show as they do across real
hosts. The names, addresses and shares are decided in core/simhost_plan.py (its docstring has the
tables); the network calls are runtime/netns.py (iproute2).

The interface (issue 26; part B's launcher and tests build on it)
------------------------------------------------------------------
``simulated_hosts(n, results_dir, *, cpus=None, gpus=(), say=...)`` is a context manager that
yields a :class:`SimulatedHosts` with every Ray node registered (or raises, having removed all it
made; a machine without the privilege is refused before anything is made, naming what is needed):

- ``ray_address``: the head's GCS address, ``198.18.S.254:PORT`` (bridge side).
- ``driver_address``: the bridge's address, where the driver, the router and readiness probes
  run; ``ray_init_kwargs()`` = ``{"address": ray_address, "_node_ip_address": driver_address}``
  for the driver's ``ray.init`` (Ray's own detection would pick this machine's main address,
  where no node of this cluster is).
- ``hosts``: one :class:`~pd_sessions.core.simhost_plan.SimHost` each, ``host1`` .. ``hostN``:
  ``name``, ``netns``, ``address``, ``ifname`` (inside the namespace), ``peer`` (on the bridge),
  ``cpus`` and ``gpus`` (its disjoint shares), ``labels`` (``{"pd-host": "host1"}``, the Ray node
  label), ``resource`` (custom resource ``pd-host-host1``, 1 unit), ``node_id`` (hex) and
  ``inventory()``: the core Inventory of that host (its cores, its GPUs, no RDMA device). A Ray
  actor placed on that node sees that inventory: ``os.sched_getaffinity(0)`` is its cores, and
  ``ray.util.get_node_ip_address()`` is its address. The head has label ``pd-host=driver``.
- ``counters(host)``: ``(rx_bytes, tx_bytes)`` of the host's interface (the KV proof).
- ``close()``: idempotent teardown: every Ray process stopped and verified gone, then the
  namespaces, links, bridge and files removed and verified gone; raises if anything is left.

In the sweep (``--simulate-hosts N``): ``with simulated_hosts(n, opts.results_dir, say=say) as
sim:`` around the configs, inside the Lifeline. In tests: the session-scoped fixture
``simulated_hosts_2`` (tests/conftest.py), two hosts for every test that asks for it.

Teardown on every exit path
---------------------------
- Normal end, an exception, Ctrl-C, SIGTERM/SIGHUP (the CLI's Stopped): ``close()``, on the
  context manager's exit.
- The harness SIGKILLed: the hosts' own reaper (runtime/reaper.py) stops every Ray process
  (``ray start --block`` and its session), then removes the links, namespaces and files, each
  recorded before it was made. Besides, each ``ray start --block`` gets SIGTERM from the kernel
  when the harness dies (parent death) and takes its node's processes with it.
- The reaper killed too: the next run's stale-run sweep. Each run writes
  ``/run/pd-sessions/simhosts/<run id>.json`` (what it made, its pid and its reaper's); a file
  whose run and reaper are both gone is cleaned, and only what it lists is removed. "Gone" is
  told by PID and start time in clock ticks (process.same_process), never by a wall-clock
  create_time: psutil's moves by a whole second with the kernel's btime, and a live run was
  once taken for a dead one and its network removed (issue 38).

Nothing sends traffic off the machine: a namespace's packets end at the bridge's address
(runtime/netns.py), the root namespace has ``unreachable 198.18.0.0/15`` while any run is up
(recorded as the first resource, dropped with the last run), every connection from here to a
rehearsal address is checked to go through its run's bridge (runtime/routeguard.py: the head's
and the nodes' probes here, the driver's join, runtime/http.py's requests), and Ray's usage
stats are off.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pd_sessions.core import simhost_plan as core
from pd_sessions.core.errors import HostSetupError, PdError, StopError
from pd_sessions.core.simhost_plan import NetPlan, SimHost
from pd_sessions.runtime import netns, process, readiness, routeguard
from pd_sessions.runtime.ports import PortAllocator
from pd_sessions.runtime.reaper import Reaper

log = logging.getLogger(__name__)

# SIGTERM -> this -> SIGKILL for the Ray nodes (with the drain off they stop in about a second).
RAY_GRACE_S = 5.0
# The head and every node registered within this (a loaded 2-core machine: about 10-30 s).
READY_TIMEOUT_S = 180.0
FILE = "file"


def facts() -> core.PrivilegeFacts:
    """What this machine offers the simulated hosts (see core.simhost_plan.missing)."""
    cap_eff = 0
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                cap_eff = int(line.split()[1], 16)

    def importable(name: str) -> bool:
        import importlib.util

        return importlib.util.find_spec(name) is not None

    return core.PrivilegeFacts(
        cap_eff=cap_eff,
        netns_support=os.path.exists("/proc/self/ns/net"),
        ip_command=shutil.which("ip") is not None,
        taskset_command=shutil.which("taskset") is not None,
        ray_module=importable("ray"),
    )


def ray_command() -> list[str]:
    """``ray`` of this interpreter's environment (the one the harness runs in)."""
    return [sys.executable, "-m", "ray.scripts.scripts"]


# ---------------------------------------------------------------------------------------------
# The state files: what each run made, for the next run's stale-run sweep.


def _identity(pid: int) -> dict[str, int | None]:
    """A process as a state file records it: its PID and its start in clock ticks
    (process.start_ticks; never a wall-clock time, see process.py)."""
    return {"pid": pid, "start_ticks": process.start_ticks(pid)}


def _alive(who: dict[str, Any] | None) -> bool:
    """Is the recorded process still that process (process.same_process)? A record without
    start ticks (an older pd-sessions wrote a wall-clock create_time) counts as alive while
    anything by its PID is: an unknown owner is never declared gone."""
    if not who:
        return False
    try:
        pid = int(who["pid"])
        ticks = who.get("start_ticks")
        return process.same_process(pid, None if ticks is None else int(ticks))
    except (KeyError, TypeError, ValueError):
        return False


class _State:
    """A run's state file (JSON): what it made, in order; written before each thing is made."""

    def __init__(self, path: Path, doc: dict[str, Any]):
        self.path = path
        self.doc = doc

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1))
        tmp.replace(self.path)

    def add(self, key: str, item: Any) -> None:
        self.doc.setdefault(key, []).append(item)
        self.write()


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    """One run at a time picks its id and /24 and makes its bridge (the next one then sees it)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _runs(state_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for p in sorted(state_dir.glob("*.json")):
        try:
            out.append((p, json.loads(p.read_text())))
        except (OSError, ValueError) as e:
            log.warning("simulated hosts: cannot read %s (%s); left alone", p, e)
    return out


def _remove_recorded(doc: dict[str, Any]) -> list[str]:
    """Remove what a state file lists (processes, then links, then namespaces, then files);
    the failures."""
    failed = []
    # Only processes recorded with their start ticks are signalled (an older record's PID may
    # be another process by now).
    leaders = [
        process.Leader(x["name"], int(x["pid"]), int(x["start_ticks"]))
        for x in doc.get("processes", [])
        if x.get("start_ticks") is not None
    ]
    if leaders:
        try:
            process.stop_leaders(leaders, grace_s=RAY_GRACE_S)
        except StopError as e:
            failed.append(str(e))
    for kind, name in reversed(doc.get("resources", [])):
        try:
            if kind == FILE:
                if not failed:
                    with contextlib.suppress(FileNotFoundError):
                        Path(name).unlink()
            else:
                netns.remove(kind, name)
        except (OSError, PdError) as e:
            failed.append(f"{kind} {name}: {e}")
    return failed


def sweep_stale(state_dir: Path, say: Callable[[str], None]) -> list[str]:
    """Clean every run whose harness and reaper are both gone (a SIGKILLed run whose reaper
    died too, a machine that lost power mid-run is cleared by the reboot): only what its
    state file lists; then the guard route if no run's bridge is left. The run ids cleaned."""
    cleaned = []
    for path, doc in _runs(state_dir):
        if _alive(doc.get("owner")) or _alive(doc.get("reaper")):
            continue
        what = ", ".join(f"{k} {n}" for k, n in doc.get("resources", []))
        say(
            f"simulated hosts: run {doc.get('run_id')} (pid {doc.get('owner', {}).get('pid')}, results "
            f"{doc.get('results_dir')}) is gone and left its state: removing {what or 'nothing'}"
        )
        failed = _remove_recorded(doc)
        if failed:
            say(f"simulated hosts: could not remove all run {doc.get('run_id')} left: {'; '.join(failed)}")
            continue
        path.unlink(missing_ok=True)
        cleaned.append(str(doc.get("run_id")))
    try:  # a guard route no run holds (one whose state file was lost): gone too
        if netns.release_guard_route():
            say(f"simulated hosts: removed the route unreachable {netns.GUARD_ROUTE} no run held")
    except PdError as e:
        say(f"simulated hosts: could not remove the route unreachable {netns.GUARD_ROUTE}: {e}")
    return cleaned


# ---------------------------------------------------------------------------------------------
# The running hosts.


class SimulatedHosts:
    """N simulated hosts with their Ray nodes, up; see the module docstring for the interface."""

    def __init__(
        self, plan: NetPlan, results_dir: Path, state: _State, reaper: Reaper, say: Callable[[str], None]
    ):
        self.plan = plan
        self.hosts: tuple[SimHost, ...] = plan.hosts
        self.results_dir = results_dir
        self.ray_address = ""
        self.head_node_id = ""
        self._state = state
        self._reaper = reaper
        self._say = say
        self._running: list[process.Running] = []
        self._resources: list[tuple[str, str]] = []
        self._closed = False

    # -- what part B uses ------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self.plan.run_id

    @property
    def driver_address(self) -> str:
        return self.plan.bridge_address

    def host(self, name: str) -> SimHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no simulated host {name!r}; there are {', '.join(h.name for h in self.hosts)}")

    def counters(self, host: SimHost | str) -> tuple[int, int]:
        """(rx_bytes, tx_bytes) of ``host``'s interface."""
        h = self.host(host) if isinstance(host, str) else host
        return netns.counters(h.peer)

    def ray_init_kwargs(self) -> dict[str, str]:
        return {"address": self.ray_address, "_node_ip_address": self.driver_address}

    @property
    def processes(self) -> list[process.Running]:
        """The Ray nodes' ``ray start --block`` processes (head first)."""
        return list(self._running)

    def describe(self) -> list[str]:
        return [
            f"{h.name}: {h.address} in {h.netns} ({h.ifname}, peer {h.peer}), cores "
            f"{','.join(map(str, h.cpus))}"
            + (f", GPUs {','.join(h.gpus)}" if h.gpus else "")
            + f", Ray node {h.node_id}"
            for h in self.hosts
        ]

    # -- making and removing ---------------------------------------------------------------

    def _record(self, kind: str, name: str) -> None:
        """Before making a thing: the reaper and the state file hear of it first."""
        self._reaper.created(kind, name)
        self._state.add("resources", [kind, name])
        self._resources.append((kind, name))

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> process.Running:
        with process.signals_deferred():
            r = process.spawn(name, argv, env=env, log_path=log_path)
            self._reaper.spawned(r)
            self._running.append(r)
            self._state.add("processes", {"name": r.name, "pid": r.pid, "start_ticks": r.start_ticks})
        return r

    def build_network(self) -> None:
        p = self.plan
        self._record(netns.ROUTE, netns.GUARD_ROUTE)  # added with the first run's bridge
        self._record(netns.LINK, p.bridge)
        netns.create_bridge(p.bridge, p.bridge_address, p.prefixlen)
        for h in self.hosts:
            self._record(netns.NETNS, h.netns)
            self._record(netns.LINK, h.peer)
            netns.add_host(
                h.netns,
                peer=h.peer,
                ifname=h.ifname,
                bridge=p.bridge,
                address=h.address,
                prefixlen=p.prefixlen,
                gateway=p.bridge_address,
            )
        if netns.forwards_out(p.bridge, self.hosts[0].address):
            raise HostSetupError(
                f"simulated hosts: the bridge {p.bridge} would forward packets off this machine "
                f"(/proc/sys/net/ipv4/conf/{p.bridge}/forwarding is not 0)"
            )

    def start_ray(self, timeout_s: float) -> None:
        p, ray = self.plan, ray_command()
        ray_dir = self.results_dir / "simhosts" / "ray"
        ray_dir.mkdir(parents=True, exist_ok=True)
        short = Path(p.short_dir)
        self._record(FILE, str(short))
        short.unlink(missing_ok=True)
        short.symlink_to(ray_dir.resolve(), target_is_directory=True)
        env = core.ray_env(os.environ)
        with PortAllocator("0.0.0.0") as ports:
            got = {name: ports.take(f"Ray head {name}") for name in core.HEAD_PORTS}
            got["min-worker-port"] = ports.take_block("Ray head worker ports", core.HEAD_WORKER_PORTS)
            argv = core.head_argv(ray, p, got, f"{short}/head")
            ports.release()
            head = self._spawn("ray-head", argv, env, ray_dir / "head.log")
        self.ray_address = f"{p.bridge_address}:{got['port']}"
        deadline = time.monotonic() + timeout_s
        self._say(f"simulated hosts: Ray head on {self.ray_address} (pid {head.pid}); waiting for it")
        readiness.wait_ready(
            [readiness.Target(head, [_tcp_probe(p.bridge_address, got["port"])])],
            deadline=deadline,
            progress=self._say,
        )
        nodes = _Nodes(self.ray_address)
        running = []
        for h in self.hosts:  # `ray start --address` waits for the head's node itself
            argv = core.node_argv(ray, p, h, got["port"], f"{short}/{h.name}")
            running.append(
                self._spawn(f"ray-{h.name}", argv, {**env, **core.node_env(h)}, ray_dir / f"{h.name}.log")
            )
        self._say(
            f"simulated hosts: {len(self.hosts)} Ray nodes starting "
            f"({', '.join(f'{h.name} {h.address}' for h in self.hosts)}); waiting for them to join"
        )
        targets = [readiness.Target(head, [nodes.probe(p.bridge_address)])]
        for r, h in zip(running, self.hosts, strict=True):
            targets.append(readiness.Target(r, [nodes.probe(h.address)]))
        readiness.wait_ready(
            targets,
            deadline=deadline,
            progress=self._say,
        )
        self.head_node_id = nodes.seen[p.bridge_address][0]
        hosts = []
        for h in self.hosts:
            node_id, labels = nodes.seen[h.address]
            if {k: labels.get(k) for k in h.labels} != dict(h.labels):
                raise HostSetupError(
                    f"simulated hosts: {h.name}'s Ray node has labels {labels}, not {h.labels}"
                )
            hosts.append(replace(h, node_id=node_id))
        self.hosts = tuple(hosts)

    def close(self) -> None:
        """Stop every Ray process, then remove the links, namespaces and files, and verify all
        gone; raise StopError/HostSetupError naming what is left. Idempotent."""
        if self._closed:
            return
        self._closed = True
        failed: list[str] = []
        with process.signals_deferred():
            if self._running:
                self._reaper.stopping(self._running, time.time() + RAY_GRACE_S)
                try:
                    process.stop(self._running, grace_s=RAY_GRACE_S)
                    self._reaper.stopped(self._running)
                except StopError as e:
                    failed.append(str(e))
            for kind, name in reversed(self._resources):
                try:
                    if kind == FILE:
                        Path(name).unlink(missing_ok=True)
                        gone = not os.path.lexists(name)
                    else:
                        netns.remove(kind, name)
                        gone = not netns.exists(kind, name)
                except (OSError, PdError) as e:
                    failed.append(f"{kind} {name}: {e}")
                    continue
                if gone:
                    self._reaper.removed(kind, name)
                else:
                    failed.append(f"{kind} {name} is still there after its removal")
            if not failed:
                self._state.path.unlink(missing_ok=True)
                self._reaper.removed(FILE, str(self._state.path))
            self._reaper.close(timeout=10)
        routeguard.forget(self.plan.subnet, self.run_id)
        if failed:
            raise HostSetupError(
                f"simulated hosts: run {self.run_id} left: {'; '.join(failed)} (state: {self._state.path})"
            )
        self._say(f"simulated hosts: run {self.run_id} removed (Ray nodes, namespaces, links)")


def _tcp_probe(host: str, port: int) -> readiness.Probe:
    def probe() -> str | None:
        routeguard.check(host)  # a gone bridge fails the wait at once (RouteError)
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return None
        except OSError as e:
            return f"{host}:{port}: {e.strerror or e}"

    return probe


class _Nodes:
    """The head's view of the cluster's alive nodes (node address -> (node id hex, labels)),
    through Ray's GCS client: no driver, so the harness's own ``ray.init`` is left to the
    launcher. (``ray._raylet.GcsClient`` is what ``ray status`` uses; ray is pinned.)"""

    def __init__(self, address: str):
        self.address = address
        self.seen: dict[str, tuple[str, dict[str, str]]] = {}
        self._client: Any = None

    def refresh(self) -> str | None:
        from ray._raylet import GcsClient
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        routeguard.check(self.address.rpartition(":")[0])
        try:
            if self._client is None:
                self._client = GcsClient(address=self.address)
            infos = self._client.get_all_node_info(timeout=2, state_filter=GcsNodeInfo.GcsNodeState.ALIVE)
        except Exception as e:  # Ray's RPC errors have no common base but Exception
            return f"GCS {self.address}: {type(e).__name__}: {e}"
        self.seen = {i.node_manager_address: (i.node_id.hex(), dict(i.labels)) for i in infos.values()}
        return None

    def probe(self, node_address: str) -> readiness.Probe:
        def probe() -> str | None:
            why = self.refresh()
            if why:
                return why
            return None if node_address in self.seen else f"no alive Ray node at {node_address} yet"

        return probe


@contextlib.contextmanager
def simulated_hosts(
    n: int,
    results_dir: Path,
    *,
    cpus: Sequence[int] | None = None,
    gpus: Sequence[str] = (),
    say: Callable[[str], None] = log.info,
    state_dir: Path | None = None,
    timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[SimulatedHosts]:
    """``n`` simulated hosts, up, for the block; removed whatever ends it (module docstring)."""
    sim = start(n, results_dir, cpus=cpus, gpus=gpus, say=say, state_dir=state_dir, timeout_s=timeout_s)
    try:
        yield sim
    finally:
        sim.close()


def start(
    n: int,
    results_dir: Path,
    *,
    cpus: Sequence[int] | None = None,
    gpus: Sequence[str] = (),
    say: Callable[[str], None] = log.info,
    state_dir: Path | None = None,
    timeout_s: float = READY_TIMEOUT_S,
) -> SimulatedHosts:
    """Make ``n`` simulated hosts; the caller must ``close()`` them. On any failure (a stop
    included) what was made is removed before the error propagates."""
    cores = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    core.check_count(n, cores)
    lacking = core.missing(facts())
    if lacking:
        raise core.refusal(lacking)
    t0 = time.monotonic()
    states = Path(state_dir or core.STATE_DIR)
    results_dir.mkdir(parents=True, exist_ok=True)
    with _locked(states):
        sweep_stale(states, say)
        taken = {doc.get("run_id") for _, doc in _runs(states)}
        run_id = secrets.token_hex(core.RUN_ID_LEN // 2)
        while run_id in taken or netns.link_exists(f"{core.PREFIX}{run_id}br"):
            run_id = secrets.token_hex(core.RUN_ID_LEN // 2)
        used = netns.root_addresses() + [str(doc["subnet"]) for _, doc in _runs(states) if doc.get("subnet")]
        plan = core.plan_network(n, run_id, core.pick_subnet(used), cores, gpus)
        routeguard.register(plan.subnet, run_id)
        state = _State(
            states / f"{run_id}.json",
            {
                "run_id": run_id,
                "subnet": plan.subnet,
                "results_dir": str(results_dir.resolve()),
                "owner": _identity(os.getpid()),
                "processes": [],
                "resources": [],
            },
        )
        state.write()
        rp = Reaper(results_dir / "simhosts" / "reaper.log", grace_s=RAY_GRACE_S, warn=say)
        rp.created(FILE, str(state.path))
        state.doc["reaper"] = _identity(rp.proc.pid)
        state.write()
        sim = SimulatedHosts(plan, results_dir, state, rp, say)
        try:
            say(
                f"simulated hosts: run {run_id}, {n} hosts on bridge {plan.bridge} "
                f"({plan.bridge_address}/{plan.prefixlen})"
            )
            sim.build_network()
        except BaseException:
            _close_quietly(sim)
            raise
    try:
        sim.start_ray(timeout_s)
    except BaseException:
        _close_quietly(sim)
        raise
    say(f"simulated hosts: up in {time.monotonic() - t0:.1f} s, Ray at {sim.ray_address}")
    for line in sim.describe():
        say(f"  {line}")
    return sim


def _close_quietly(sim: SimulatedHosts) -> None:
    """Teardown of a half-made run while an error propagates: its own failure is logged, the
    first error stays the one raised."""
    try:
        sim.close()
    except PdError as e:
        log.error("%s", e)
