"""Processes on Ray nodes (edge): ``--ray ADDRESS|auto``, one small agent per node.

Ray is an optional extra (``pip install 'pd-sessions[ray]'``): this module imports it only when a
run asks for it, and nothing on the single-host path imports this module's Ray parts.

- **Connect** (:class:`RayHosts`): the driver joins the Ray cluster a user started (``ray start
  --head`` on one host, ``ray start --address ...`` on the others; or ``--simulate-hosts``).
- **Phase 1, the facts**: one :class:`NodeAgent` actor per node (``num_cpus=0``, never detached,
  so it dies with the driver's job; ``max_concurrency`` 4, so a poll is never queued behind a
  stop), placed with a hard node affinity, reports its node's address
  (``ray.util.get_node_ip_address()``), cores, GPUs, RDMA devices, the interface carrying the
  address and its interpreter: :meth:`RayHosts.layout` turns them into the planner's HostLayout.
  Each host's ports come from its agent (:class:`RemotePorts`), held bound until the first spawn
  there; the generated tiny models are generated on each node from their seed, a local model
  path is checked on each node.
- **Launch** (:class:`RayLauncher`, runtime/launcher.py's contract): a spec for another host is
  spawned by that host's agent **in the Ray worker's own process group** (process.spawn with
  ``new_session=False``), keeping the parent-death signal. Ray kills an actor's worker by its
  process group; a tree in a session of its own (as vLLM's API server -> engine core -> workers
  would be) outlived ``ray.kill``, a SIGKILLed worker, a SIGKILLed driver and ``remove_node``,
  while the same tree in the worker's group died in each. Its environment is the node's, without
  Ray's variables (``RAY_ADDRESS``...: vLLM under an agent must not join the harness's cluster),
  plus the spec's (``CUDA_VISIBLE_DEVICES`` included: the harness sets it, not Ray). Its log goes
  to the results directory: written there when the node sees that directory (a shared file
  system, the simulated hosts), else on the node and streamed over by :class:`LogPump`.
- **Poll and stop**: ``poll()`` asks the agent (cached 0.2 s); the agent stops its processes with
  process.stop_leaders (SIGTERM, grace, SIGKILL, verified gone), every node at once and this
  host's processes (the router) meanwhile, under one grace. Descendants the agent saw are
  recorded, and after every stop each node verifies that every (pid, start time) it recorded is
  gone (a fresh agent does it when the first one was killed).
- Readiness and checks stay HTTP from the driver; nothing here sends a request to a server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from pd_sessions.core.errors import PdError, PlanError, StopError, UsageError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan import ClusterPlan, ProcessSpec
from pd_sessions.core.plan.across_hosts import HostFacts, HostLayout
from pd_sessions.runtime import machine as hostinfo
from pd_sessions.runtime import parentwatch, process, routeguard, tiny_model, wire_apply
from pd_sessions.runtime.launcher import LOCAL
from pd_sessions.runtime.ports import PortAllocator
from pd_sessions.runtime.process import Leader, Running, StopReport

log = logging.getLogger(__name__)

# The label that names a host (the simulated hosts set pd-host=hostK); else its address.
HOST_LABEL = "pd-host"
AGENT_CONCURRENCY = 4
POLL_CACHE_S = 0.2
CALL_TIMEOUT_S = 30.0
LOG_PUMP_S = 0.5
SHARED_MARKER = ".pd-sessions-shared"
# Variables of a Ray worker's environment a spawned process must not inherit.
RAY_ENV_PREFIX = "RAY_"
RAY_EXTRA = "pip install 'pd-sessions[ray]' (ray==2.60.0)"


def import_ray() -> Any:
    """The ``ray`` module, or a UsageError naming how to install it."""
    try:
        import ray
    except ImportError as e:
        raise UsageError(f"--ray needs Ray, which is not installed here ({e}): {RAY_EXTRA}") from None
    return ray


def node_env(environ: Mapping[str, str], spec_env: Mapping[str, str], package_root: str) -> dict[str, str]:
    """A spawned process's environment on a node: the node's, less Ray's own variables (so a vLLM
    started there never joins the harness's Ray cluster) and CUDA_VISIBLE_DEVICES (the plan
    sets it where it places GPUs), with ``package_root`` (where the agent's pd_sessions lies: the
    driver's, shipped by Ray) first on PYTHONPATH, so vLLM loads the driver's pd-sessions plugin;
    plus the spec's."""
    kept = {
        k: v for k, v in environ.items() if not k.startswith(RAY_ENV_PREFIX) and k != "CUDA_VISIBLE_DEVICES"
    }
    path = [package_root] + ([kept["PYTHONPATH"]] if kept.get("PYTHONPATH") else [])
    return {**kept, "PYTHONPATH": os.pathsep.join(path), **spec_env}


def driver_address(address: str) -> dict[str, str]:
    """ray.init's ``_node_ip_address`` when the head (``address``) is on one of this host's own
    addresses (a bridge, 127.0.0.1): the driver joins the node there. Ray's own detection picks
    the host's main address, where no node of that cluster may be."""
    host = address.rpartition(":")[0].strip("[]")
    return {"_node_ip_address": host} if host and interface_of(host) else {}


def interface_of(address: str) -> str | None:
    """The network interface that carries ``address`` on this host, or None."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


# ------------------------------------------------------------------ the agent (runs on each node)


class NodeAgent:
    """One per node, as a Ray actor (made with :func:`agent_class`): facts, ports, models, and the
    processes it spawned there (spawn, poll, read their logs, stop, verify gone)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, Running] = {}
        self._family: dict[int, list[Leader]] = {}  # leader pid -> descendants seen
        self._recorded: list[Leader] = []
        self._ports: PortAllocator | None = None
        self._local_logs: dict[int, Path] = {}
        # What an earlier run left on this node when its stop was cut short (its driver
        # SIGKILLed: Ray ended its processes, no one removed their private TMPDIRs).
        for path in process.remove_orphan_tmp_dirs():
            log.info("removed %s: its process, of an earlier run, is gone", path)

    def ping(self) -> bool:
        return True

    def facts(self) -> dict[str, Any]:
        import ray

        address = ray.util.get_node_ip_address()
        inv = hostinfo.detect()
        return {
            "address": address,
            "cpus": list(inv.cpus),
            "gpus": list(inv.gpus),
            "gpu_source": inv.gpu_source,
            "rdma": list(inv.rdma_devices or ()),
            "interface": interface_of(address),
            "python": sys.executable,
            "pid": os.getpid(),
        }

    # ports, held bound on this node until release()

    def _allocator(self) -> PortAllocator:
        if self._ports is None:
            import ray

            self._ports = PortAllocator(ray.util.get_node_ip_address())
        return self._ports

    def take(self, label: str) -> int:
        return self._allocator().take(label)

    def take_block(self, label: str, size: int) -> int:
        return self._allocator().take_block(label, size)

    def claim(self, label: str, port: int) -> int:
        return self._allocator().claim(label, port)

    def release(self) -> None:
        if self._ports is not None:
            self._ports.release()
            self._ports = None

    # models

    def tiny_model(self, name: str, weights_seed: int | None, cache: str | None) -> str:
        spec = tiny_model.spec_for(name, weights_seed=weights_seed)
        return str(tiny_model.ensure(spec, Path(cache) if cache else None))

    def exists(self, path: str) -> bool:
        return Path(path).expanduser().exists()

    # processes

    def spawn(self, name: str, argv: list[str], spec_env: dict[str, str], log_path: str, url: str | None,
              shared_token: str) -> dict[str, Any]:  # fmt: skip
        """Start ``argv`` in this worker's process group; its log at ``log_path`` when this node
        sees the driver's results directory (the token matches), else in a node-local folder."""
        path = Path(log_path)
        marker = path.parent / SHARED_MARKER
        shared = marker.exists() and marker.read_text() == shared_token
        if not shared:
            path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pd-sessions-{shared_token}" / path.name
        env = node_env(os.environ, spec_env, str(Path(__file__).resolve().parents[2]))
        r = process.spawn(name, argv, env=env, log_path=path, url=url, new_session=False, private_tmp=True)
        with self._lock:
            self._running[r.pid] = r
            self._recorded.append(r.leader)
            if not shared:
                self._local_logs[r.pid] = path
        tmp = str(r.tmp_dir) if r.tmp_dir else None
        return {"pid": r.pid, "start_ticks": r.start_ticks, "shared": shared, "tmp_dir": tmp}

    def poll(self, pid: int) -> int | None:
        """Its exit status, or None while it runs (and its descendants recorded meanwhile)."""
        r = self._running[pid]
        rc = r.popen.poll()
        if rc is None:
            with contextlib.suppress(psutil.Error):
                kids = psutil.Process(pid).children(recursive=True)
                seen = {x.pid for x in self._family.get(pid, [])}
                new = [Leader(r.name, k.pid, process.start_ticks(k.pid)) for k in kids if k.pid not in seen]
                with self._lock:
                    self._family.setdefault(pid, []).extend(new)
                    self._recorded.extend(new)
        return rc

    def read_log(self, pid: int, offset: int, limit: int = 1 << 20) -> bytes:
        path = self._local_logs.get(pid)
        if path is None or not path.exists():
            return b""
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(limit)

    def stop(self, pids: list[int], grace_s: float, early: dict[str, float] | None) -> dict[str, Any]:
        """process.stop_leaders over ``pids`` and the descendants seen that left their tree."""
        running = [self._running[p] for p in pids if p in self._running]
        leaders = [r.leader for r in running]
        for r in running:
            with contextlib.suppress(psutil.Error):
                tree = {k.pid for k in psutil.Process(r.pid).children(recursive=True)}
                leaders += [x for x in self._family.get(r.pid, []) if x.pid not in tree]
        try:
            rep = process.stop_leaders(leaders, grace_s=grace_s, early=early)
        except StopError as e:
            return {"error": str(e)}
        finally:
            for r in running:
                r.popen.poll()
        process.release_tmp(running)
        return {"seconds": rep.seconds, "killed": rep.killed, "pids": rep.pids, "cut": rep.cut}

    def drop_logs(self, pids: list[int]) -> None:
        """Remove the node-local logs of ``pids`` (stopped, and read to their end by the driver),
        and their folder once empty."""
        for pid in pids:
            path = self._local_logs.pop(pid, None)
            if path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()
                with contextlib.suppress(OSError):
                    path.parent.rmdir()

    def remove_tmp_dirs(self, paths: list[str]) -> None:
        """Remove the private temporary folders of processes a dead agent started here (they went
        with its worker's group; their folders stayed)."""
        for p in paths:
            process.remove_tmp_dir(Path(p))

    def verify_gone(self, leaders: list[tuple[str, int, int | None]] | None = None) -> list[str]:
        """'name pid N' for every recorded process (or every one of ``leaders``) still alive."""
        check = [Leader(*x) for x in leaders] if leaders is not None else list(self._recorded)
        return [f"{x.name} pid {x.pid}" for x in check if _alive(x)]

    def counters(self, interface: str) -> tuple[int, int]:
        """(rx_bytes, tx_bytes) of ``interface`` on this node."""
        stats = Path("/sys/class/net") / interface / "statistics"
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    def wire(self, op: str, kwargs: dict[str, Any]) -> Any:
        """A wire fault operation on this node's network (runtime/wire_apply.py's OPS); ``ifname=None``
        is the interface of this node's address."""
        if "ifname" in kwargs and kwargs["ifname"] is None:
            import ray

            kwargs = {**kwargs, "ifname": interface_of(ray.util.get_node_ip_address())}
        return wire_apply.call(op, kwargs)


def _alive(x: Leader) -> bool:
    return process.same_process(x.pid, x.start_ticks)


def agent_class(ray: Any) -> Any:
    """NodeAgent as a Ray actor class: no CPU reserved, a few calls at once."""
    return ray.remote(num_cpus=0, max_concurrency=AGENT_CONCURRENCY)(NodeAgent)


# ------------------------------------------------------------------ the driver's side


@dataclass
class Node:
    """A Ray node as the driver knows it, and its agent once started."""

    name: str
    node_id: str
    address: str
    labels: tuple[tuple[str, str], ...]
    agent: Any = None
    facts: HostFacts | None = None


def _labels(node: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """A node's own labels (Ray's ray.io/... ones left out), sorted."""
    return tuple(sorted((k, v) for k, v in (node.get("Labels") or {}).items() if not k.startswith("ray.io/")))


def _names(nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """A name per node: its pd-host label, else its address (``#2``... when repeated)."""
    out: list[str] = []
    for n in nodes:
        base = (n.get("Labels") or {}).get(HOST_LABEL) or n["NodeManagerAddress"]
        name, k = base, 1
        while name in out:
            k += 1
            name = f"{base}#{k}"
        out.append(name)
    return out


class RayHosts:
    """The driver's view of a Ray cluster: connect, an agent per node, phase 1's facts, ports per
    host, models per host, the launcher; :meth:`close` kills the agents and disconnects."""

    def __init__(self, address: str, *, say: Callable[[str], None] | None = None):
        self.ray = import_ray()
        self.say = say or (lambda msg: log.info("%s", msg))
        routeguard.check(address.rpartition(":")[0].strip("[]"))  # a rehearsal's bridge is there
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        t0 = time.monotonic()
        try:
            self.ray.init(
                address=address,
                log_to_driver=False,
                logging_level=logging.WARNING,
                configure_logging=False,
                namespace="pd-sessions",
                # the driver's pd_sessions, shipped: the agents run the driver's code (and vLLM
                # there its plugin), whatever the nodes have installed
                runtime_env={
                    "py_modules": [str(Path(__file__).resolve().parents[1])],
                    "excludes": ["__pycache__"],
                },
                **driver_address(address),
            )
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise PlanError(
                "--ray",
                f"cannot join the Ray cluster at {address!r}: {e}; start one with `ray start --head` "
                "(and `ray start --address HEAD:PORT` on the other hosts), then give its address",
            ) from None
        finally:  # the harness's own handlers stay (a cancel must still tear down)
            for s, h in handlers.items():
                if h is not None and signal.getsignal(s) is not h:
                    signal.signal(s, h)
        self.token = secrets.token_hex(6)
        self.driver_id = self.ray.get_runtime_context().get_node_id()
        alive = [n for n in self.ray.nodes() if n.get("Alive")]
        self.nodes = [
            Node(name, n["NodeID"], n["NodeManagerAddress"], _labels(n))
            for name, n in zip(_names(alive), alive, strict=True)
        ]
        self.driver = next(n.name for n in self.nodes if n.node_id == self.driver_id)
        self.say(
            f"joined the Ray cluster at {address} in {time.monotonic() - t0:.1f} s: "
            + ", ".join(f"{n.name} ({n.address})" for n in self.nodes)
            + f"; the driver's node: {self.driver}"
        )

    def _call(self, ref: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """ray.get, a PdError raised in an agent re-raised as itself."""
        try:
            return self.ray.get(ref, timeout=timeout)
        except self.ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, PdError):
                raise e.cause from None
            raise

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def _start_agent(self, n: Node) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        strategy = NodeAffinitySchedulingStrategy(node_id=n.node_id, soft=False)
        return agent_class(self.ray).options(scheduling_strategy=strategy).remote()

    def layout(self, *, allow_loopback: bool = False) -> HostLayout:
        """Phase 1: an agent on every node but the driver's (on the driver's too when it is the
        only one), each node's facts."""
        users = [n for n in self.nodes if n.name != self.driver] or [self.node(self.driver)]
        for n in users:
            if n.agent is not None:
                try:  # an agent killed during an earlier config is started again
                    self.ray.get(n.agent.ping.remote(), timeout=CALL_TIMEOUT_S)
                except self.ray.exceptions.RayActorError:
                    n.agent = None
            if n.agent is None:
                n.agent = self._start_agent(n)
        t0 = time.monotonic()
        got = self._call([n.agent.facts.remote() for n in users if n.facts is None], timeout=120)
        for n, f in zip([n for n in users if n.facts is None], got, strict=True):
            n.facts = HostFacts(
                name=n.name,
                address=f["address"],
                inventory=Inventory(tuple(f["gpus"]), tuple(f["cpus"]), f["gpu_source"], tuple(f["rdma"])),
                interface=f["interface"],
                labels=n.labels,
                python=f["python"],
            )
        if got:
            self.say(f"facts of {len(got)} host(s) in {time.monotonic() - t0:.1f} s: " + "; ".join(
                f"{h.name} {h.address} ({len(h.inventory.cpus)} cores, {len(h.inventory.gpus)} GPUs, "
                f"interface {h.interface})" for n in users if (h := n.facts)))  # fmt: skip
        driver = self.node(self.driver)
        driver_facts = driver.facts or HostFacts(
            driver.name, driver.address, hostinfo.detect(), labels=driver.labels
        )
        hosts = tuple(n.facts or driver_facts for n in self.nodes if n.facts or n.name == self.driver)
        return HostLayout(hosts, self.driver, allow_loopback=allow_loopback)

    def with_models(
        self,
        layout: HostLayout,
        models: Sequence[tuple[str, str, int | None]],
        cache: str | None,
        local_paths: Sequence[str],
    ) -> HostLayout:
        """``layout`` with each host's model paths: the tiny models ``models`` ((the driver's path,
        name, weights seed)) generated there, and ``local_paths`` checked to exist there."""
        hosts = []
        for h in layout.hosts:
            n = self.node(h.name)
            if n.agent is None:
                hosts.append(h)
                continue
            paths = self._call(
                [n.agent.tiny_model.remote(name, seed, cache) for _, name, seed in models], 600
            )
            for path in local_paths:
                if not self._call(n.agent.exists.remote(path)):
                    raise PlanError("model", f"{path} does not exist on {h.name} ({h.address}): copy it "
                                    "there (the same path on every host), or serve a hub id")  # fmt: skip
            moved = tuple((d, p) for (d, _, _), p in zip(models, paths, strict=True) if d != p)
            hosts.append(HostFacts(h.name, h.address, h.inventory, h.interface, h.labels, h.python, moved))
        return HostLayout(tuple(hosts), layout.driver, layout.allow_loopback)

    def port_sources(self) -> dict[str, RemotePorts]:
        """A PortSource per host with an agent (the driver's host uses the local allocator)."""
        return {
            n.name: RemotePorts(self, n) for n in self.nodes if n.agent is not None and n.name != self.driver
        }

    def launcher(self, run_dir: Path, ports: Mapping[str, RemotePorts]) -> RayLauncher:
        return RayLauncher(self, run_dir, ports)

    def close(self) -> None:
        """Kill every agent (their processes were stopped and verified gone) and disconnect."""
        for n in self.nodes:
            if n.agent is not None:
                with contextlib.suppress(Exception):
                    self.ray.kill(n.agent)
                n.agent = None
        with contextlib.suppress(Exception):
            self.ray.shutdown()


@contextlib.contextmanager
def ray_hosts(address: str, *, say: Callable[[str], None] | None = None) -> Iterator[RayHosts]:
    hosts = RayHosts(address, say=say)
    try:
        yield hosts
    finally:
        hosts.close()


class RemotePorts:
    """A PortSource on a node: its agent takes the ports there and holds them until released."""

    def __init__(self, hosts: RayHosts, node: Node):
        self.hosts, self.node = hosts, node
        self.released = False

    def take(self, label: str) -> int:
        return int(self.hosts._call(self.node.agent.take.remote(label)))

    def take_block(self, label: str, size: int) -> int:
        return int(self.hosts._call(self.node.agent.take_block.remote(label, size)))

    def claim(self, label: str, port: int) -> int:
        return int(self.hosts._call(self.node.agent.claim.remote(label, port)))

    def release(self) -> None:
        if not self.released and self.node.agent is not None:
            self.released = True
            with contextlib.suppress(Exception):
                self.hosts._call(self.node.agent.release.remote())


class RemoteHandle:
    """process.Handle for a process on a node: polls go to its agent (cached POLL_CACHE_S). An
    agent that died took its process group with it: the process counts as SIGKILLed."""

    def __init__(self, hosts: RayHosts, node: Node, pid: int):
        self.hosts, self.node, self.pid = hosts, node, pid
        self.returncode: int | None = None
        self.agent_died = False
        self._at = 0.0

    def poll(self) -> int | None:
        if self.returncode is not None or time.monotonic() - self._at < POLL_CACHE_S:
            return self.returncode
        ray = self.hosts.ray
        try:
            self.returncode = ray.get(self.node.agent.poll.remote(self.pid), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            return None
        except ray.exceptions.RayActorError:
            self.agent_died = True
            self.returncode = -signal.SIGKILL
        self._at = time.monotonic()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"pid {self.pid} on {self.node.name}", timeout or 0)
            time.sleep(POLL_CACHE_S)
        return rc


@dataclass
class _Remote:
    running: Running
    handle: RemoteHandle
    shared: bool
    tmp_dir: str | None = None  # its private TMPDIR on its node (removed there when it stops)
    offset: int = 0


class LogPump:
    """Copies the logs of processes whose node cannot write the results directory, every
    LOG_PUMP_S, into it (so log tails and the checks' log evidence work the same)."""

    def __init__(self, hosts: RayHosts):
        self.hosts = hosts
        self.items: list[_Remote] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, item: _Remote) -> None:
        self.items.append(item)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pd-sessions-logpump", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(LOG_PUMP_S):
            self.pump()

    def pump(self) -> None:
        for it in list(self.items):
            with contextlib.suppress(Exception):
                data = self.hosts._call(it.handle.node.agent.read_log.remote(it.handle.pid, it.offset), 10)
                if data:
                    with open(it.running.log_path, "ab") as f:
                        f.write(data)
                    it.offset += len(data)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.pump()


@dataclass
class RayLauncher:
    """runtime/launcher.py's contract across hosts: a spec with another host's ``node`` runs
    there through its agent, everything else here (LOCAL)."""

    hosts: RayHosts
    run_dir: Path
    ports: Mapping[str, RemotePorts]
    remote: dict[int, _Remote] = field(default_factory=dict)
    # host -> its interface's counters before its first process started (link_baseline)
    baseline: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / SHARED_MARKER).write_text(self.hosts.token)
        self.pump = LogPump(self.hosts)

    def spawn(self, spec: ProcessSpec, run_dir: Path, base_env: Mapping[str, str]) -> Running:
        if spec.node is None or spec.node == self.hosts.driver:
            return LOCAL.spawn(spec, run_dir, base_env)
        node = self.hosts.node(spec.node)
        if spec.node in self.ports:
            self.ports[spec.node].release()  # held until the first spawn on that host
        if spec.node not in self.baseline:
            self.baseline.update(self._counters([spec.node]))
        log_path = run_dir / spec.log_name
        ref = node.agent.spawn.remote(
            spec.name, list(spec.argv), spec.env_dict(), str(log_path), spec.url, self.hosts.token
        )
        got = self.hosts._call(ref)
        handle = RemoteHandle(self.hosts, node, got["pid"])
        r = Running(
            spec.name, handle, log_path, time.monotonic(), spec.url, got["start_ticks"], node=spec.node
        )
        item = self.remote[id(r)] = _Remote(r, handle, got["shared"], got.get("tmp_dir"))
        if not item.shared:
            log_path.touch()
            self.pump.add(item)
        log.info("started %s on %s (%s) pid %d", spec.name, node.name, node.address, handle.pid)
        return r

    def stop(
        self,
        group: Sequence[Running],
        *,
        grace_s: float,
        early: Mapping[str, float] | None = None,
        freed: Callable[[], None] | None = None,
        after_children: Mapping[str, Callable[[], bool]] | None = None,
    ) -> StopReport:
        """Every node's processes and this host's together, under one grace; then every node
        verifies that every process it recorded is gone. StopError names survivors and hosts.
        ``freed``: called as the stop ends (across hosts configs run one at a time);
        ``after_children`` is not used (each node's agent stops its own processes gracefully)."""
        t0 = time.monotonic()
        local = [r for r in group if id(r) not in self.remote]
        by_node: dict[str, list[int]] = {}
        for r in group:
            if id(r) in self.remote:
                by_node.setdefault(self.remote[id(r)].handle.node.name, []).append(r.pid)
        with process.signals_deferred():
            refs = {
                name: self.hosts.node(name).agent.stop.remote(pids, grace_s, dict(early or {}))
                for name, pids in by_node.items()
            }
            rep = LOCAL.stop(local, grace_s=grace_s, early=early) if local else StopReport(0.0)
            errors = self._remote_reports(refs, rep, timeout=grace_s + parentwatch.KILL_WAIT_S + 30)
            self.pump.close()
            self._drop_logs(by_node)
            errors += self.verify()
        if errors:
            raise StopError("; ".join(errors))
        rep.seconds = time.monotonic() - t0
        if freed is not None:
            freed()
        return rep

    def _drop_logs(self, by_node: Mapping[str, list[int]]) -> None:
        """The stopped processes' node-local logs are read to their end: remove them there."""
        for name, pids in by_node.items():
            agent = self.hosts.node(name).agent
            if agent is not None:
                with contextlib.suppress(Exception):
                    self.hosts._call(agent.drop_logs.remote(pids), 10)

    def _remote_reports(self, refs: Mapping[str, Any], rep: StopReport, *, timeout: float) -> list[str]:
        """Merge each node's stop report into ``rep``; what failed, by host. A dead agent took
        its process group with it (verify() then checks with a fresh one)."""
        errors = []
        for name, ref in refs.items():
            try:
                got = self.hosts._call(ref, timeout=timeout)
            except self.hosts.ray.exceptions.RayActorError:
                log.warning("the agent on %s is gone (its processes went with its worker's group)", name)
                continue
            if "error" in got:
                errors.append(f"on {name}: {got['error']}")
                continue
            rep.killed += got["killed"]
            rep.pids += got["pids"]
            rep.cut += got["cut"]
        return errors

    def link_counters(self, plan: ClusterPlan) -> dict[str, tuple[int, int]] | None:
        """Each instance host's interface counters, read there by its agent."""
        return self._counters(
            sorted({s.node for s in plan.instances if s.node and s.node != self.hosts.driver})
        )

    def link_baseline(self) -> dict[str, tuple[int, int]] | None:
        return dict(self.baseline)

    def _counters(self, names: Sequence[str]) -> dict[str, tuple[int, int]]:
        out = {}
        for name in names:
            node = self.hosts.node(name)
            if node.facts is not None and node.facts.interface:
                rx, tx = self.hosts._call(node.agent.counters.remote(node.facts.interface))
                out[name] = (int(rx), int(tx))
        return out

    def on_host(self, host: str, op: str, **kwargs: Any) -> Any:
        """Wire operation ``op`` (runtime/wire_apply.py's OPS) run on ``host``, in its network."""
        return self.hosts._call(self.hosts.node(host).agent.wire.remote(op, kwargs))

    def verify(self) -> list[str]:
        """Each node that ran a process verifies that every (pid, start time) recorded there is
        gone; a node whose agent died is checked by a fresh agent with what the driver knows."""
        out = []
        for name in {it.handle.node.name for it in self.remote.values()}:
            node = self.hosts.node(name)
            try:
                left = self.hosts._call(node.agent.verify_gone.remote())
            except self.hosts.ray.exceptions.RayActorError:
                node.agent = self.hosts._start_agent(node)
                known = [
                    (it.running.name, it.running.pid, it.running.start_ticks)
                    for it in self.remote.values()
                    if it.handle.node.name == name
                ]
                left = self.hosts._call(node.agent.verify_gone.remote(known), timeout=120)
                tmp = [x.tmp_dir for x in self.remote.values() if x.handle.node.name == name and x.tmp_dir]
                if not left and tmp:
                    self.hosts._call(node.agent.remove_tmp_dirs.remote(tmp), timeout=60)
            if left:
                out.append(f"still running on {name} ({node.address}): {', '.join(left)}")
        return out
