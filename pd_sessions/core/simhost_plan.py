"""The simulated hosts' pure decisions (``--simulate-hosts N``): names, addresses, core shares,
the privilege check and the Ray command lines. ``runtime.simhosts`` carries them out.

A simulated host is a network namespace on a bridge, with its own address, its own loopback, a
disjoint share of the machine's cores (and GPUs) and a real Ray node. The Ray head and the
driver (the harness, the router) stay on the root side, on the bridge's address.

Addresses: one /24 of 198.18.0.0/15 (RFC 2544's range for benchmarking, routed nowhere; while a
run is up the root namespace makes it unreachable but for the bridges' own /24s, runtime/netns.py)
per run, the first one no address of this machine is in already (:func:`subnet_of` tells an
address's /24, :func:`bridge_name` its run's bridge):

| what | address |
| --- | --- |
| the bridge (root side: Ray head, driver, router) | 198.18.S.254/24 |
| host K (K = 1..N) | 198.18.S.K/24, default route via 198.18.S.254 |

Names: every name starts with ``pds`` and carries the run's id (6 hex digits), so that two runs
at once never collide and a stale-run sweep can tell what is ours (it removes only what a run's
own state file lists). Interface names fit Linux's 15 characters:

| what | name (run id ``a1b2c3``) |
| --- | --- |
| bridge | ``pdsa1b2c3br`` |
| host K's veth end on the bridge (root side) | ``pdsa1b2c3hK`` |
| host K's veth end in its namespace | ``pdsa1b2c3nK`` |
| host K's namespace | ``pds-a1b2c3-hostK`` |
| the Ray temp dirs' short link (AF_UNIX paths are at most 107 bytes) | ``/tmp/pds-a1b2c3`` |

Core shares: the harness's cores, in order, cut into N contiguous blocks as even as can be (the
first ``len % N`` blocks one longer); fewer cores than hosts is refused. GPUs are cut the same way,
but a host may get none.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pd_sessions.core.errors import ConfigError
from pd_sessions.core.inventory import Inventory

# RFC 2544: reserved for benchmarking network devices, routed nowhere.
NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
SUBNET_PREFIX = 24
BRIDGE_HOST = 254
MAX_HOSTS = 253
# Every name we create starts with this (and carries the run id).
PREFIX = "pds"
RUN_ID_LEN = 6
IFNAMSIZ = 15  # Linux: IFNAMSIZ 16, with the terminating NUL
# One JSON state file per run, listing what it created; the next run's stale-run sweep reads
# them (runtime/simhosts.py). /run is a tmpfs, cleared at boot like the namespaces themselves.
STATE_DIR = "/run/pd-sessions/simhosts"
# Ray node label that names a simulated host (``--labels pd-host=host1``), and the custom
# resource of the same host (one unit), for placement by resource as well as by label.
HOST_LABEL = "pd-host"
DRIVER_HOST = "driver"
# Ray's object store on each node: Ray's own minimum is 75 MiB; the harness moves nothing big.
OBJECT_STORE_BYTES = 100 * 1024 * 1024
# The Ray head's worker ports (the driver's core worker takes its port from these).
HEAD_WORKER_PORTS = 32
# Ports the head needs besides its worker ports (each allocated, never Ray's defaults, so two
# runs, or a user's own Ray, never collide on the root side).
HEAD_PORTS = (
    "port",
    "node-manager-port",
    "object-manager-port",
    "ray-client-server-port",
    "dashboard-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "metrics-export-port",
    "runtime-env-agent-port",
)
# Set for every Ray process we start. RAY_ADDRESS and friends from the caller's environment
# are dropped: these nodes join the run's own head, nothing else.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # nothing leaves the machine
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # SIGTERM stops a node at once (no 30 s drain)
}
RAY_ENV_DROP = ("RAY_ADDRESS", "RAY_NAMESPACE", "RAY_JOB_CONFIG_JSON_ENV_VAR", "RAY_RUNTIME_ENV")


@dataclass(frozen=True)
class SimHost:
    """One simulated host: what it is, as the harness and part B's planner see it."""

    # "host1", "host2", ... (also its Ray label pd-host=<name> and its custom resource)
    name: str
    # network namespace (``ip netns exec <netns> ...`` runs a command on this host)
    netns: str
    # its own address, 198.18.S.K; the only address besides its loopback
    address: str
    # its interface, inside the namespace (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME on this host)
    ifname: str
    # the other end of its veth pair, on the bridge (root side)
    peer: str
    # its share of the machine's cores: the Ray node runs pinned to them (sched_getaffinity)
    cpus: tuple[int, ...]
    # its share of the machine's GPUs, as CUDA_VISIBLE_DEVICES spells them (none on the CPU lane)
    gpus: tuple[str, ...] = ()
    # its Ray node's labels (left out of the hash, so that a host can key a dict)
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    # its Ray node's id (hex), once the node has registered with the head
    node_id: str | None = None

    @property
    def resource(self) -> str:
        """The custom resource only this host's Ray node has (1 unit): ``pd-host-host1``."""
        return f"{HOST_LABEL}-{self.name}"

    def inventory(self) -> Inventory:
        """This host's inventory: its cores and GPUs, no RDMA device (a veth has none)."""
        return Inventory(
            gpus=self.gpus,
            cpus=self.cpus,
            gpu_source=f"simulated host {self.name}" if self.gpus else "none",
            rdma_devices=(),
        )


@dataclass(frozen=True)
class NetPlan:
    """The network of one run: its id, its /24, its bridge, its hosts."""

    run_id: str
    subnet: str
    bridge: str
    bridge_address: str
    hosts: tuple[SimHost, ...]
    prefixlen: int = SUBNET_PREFIX

    @property
    def short_dir(self) -> str:
        """The short link the Ray temp dirs are reached through (AF_UNIX path limit)."""
        return f"/tmp/{PREFIX}-{self.run_id}"


def check_run_id(run_id: str) -> str:
    if len(run_id) != RUN_ID_LEN or any(c not in "0123456789abcdef" for c in run_id):
        raise ConfigError("run id", f"{run_id!r} is not {RUN_ID_LEN} lower-case hex digits")
    return run_id


def check_count(n: int, cpus: Sequence[int]) -> None:
    """``--simulate-hosts N``: 1..253, and at least one core per host."""
    if not 1 <= n <= MAX_HOSTS:
        raise ConfigError("--simulate-hosts", f"got {n}; allowed: 1 to {MAX_HOSTS} hosts")
    if n > len(cpus):
        raise ConfigError(
            "--simulate-hosts",
            f"{n} hosts need at least {n} cores (each host gets its own), but this process may run "
            f"on {len(cpus)} ({','.join(map(str, cpus))}); ask for at most {len(cpus)} hosts",
        )


def shares(items: Sequence[object], n: int) -> list[tuple[int, int]]:
    """(start, stop) of ``n`` contiguous blocks of ``items``, as even as can be, the first
    ``len(items) % n`` one longer; blocks may be empty when there are fewer items than ``n``.

    >>> shares(range(5), 2)
    [(0, 3), (3, 5)]
    """
    q, r = divmod(len(items), n)
    out, start = [], 0
    for k in range(n):
        stop = start + q + (1 if k < r else 0)
        out.append((start, stop))
        start = stop
    return out


def core_shares(cpus: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """Disjoint, non-empty shares of ``cpus`` for ``n`` hosts (see the module docstring)."""
    check_count(n, cpus)
    ordered = sorted(cpus)
    return [tuple(ordered[a:b]) for a, b in shares(ordered, n)]


def gpu_shares(gpus: Sequence[str], n: int) -> list[tuple[str, ...]]:
    """Disjoint shares of ``gpus`` (in their order) for ``n`` hosts; some may be empty."""
    return [tuple(gpus[a:b]) for a, b in shares(gpus, n)]


def subnets() -> list[ipaddress.IPv4Network]:
    return list(NETWORK.subnets(new_prefix=SUBNET_PREFIX))


def pick_subnet(used: Iterable[str]) -> ipaddress.IPv4Network:
    """The first /24 of 198.18.0.0/15 that none of ``used`` (addresses or networks, e.g. every
    IPv4 address of the root namespace with its prefix, and the subnets of runs still going)
    overlaps. Raise when all 512 are taken."""
    taken = [ipaddress.ip_network(u, strict=False) for u in used]
    for net in subnets():
        if not any(net.overlaps(t) for t in taken if t.version == 4):
            return net
    raise ConfigError(
        "--simulate-hosts",
        f"every /{SUBNET_PREFIX} of {NETWORK} is already in use on this machine; remove the "
        "bridges of finished runs (`ip -br addr` lists them)",
    )


def bridge_name(run_id: str) -> str:
    """Run ``run_id``'s bridge (root side)."""
    return f"{PREFIX}{run_id}br"


def subnet_of(address: str) -> str | None:
    """The run's /24 that ``address`` is in ("198.18.3.0/24"), None outside 198.18.0.0/15."""
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        return None
    if ip not in NETWORK:
        return None
    return str(ipaddress.IPv4Network(f"{ip}/{SUBNET_PREFIX}", strict=False))


def ifnames(run_id: str, k: int) -> tuple[str, str]:
    """(name in the namespace, name of the peer on the bridge) of host ``k``."""
    inside, peer = f"{PREFIX}{run_id}n{k}", f"{PREFIX}{run_id}h{k}"
    assert len(inside) <= IFNAMSIZ and len(peer) <= IFNAMSIZ, (inside, peer)
    return inside, peer


def plan_network(
    n: int,
    run_id: str,
    subnet: ipaddress.IPv4Network,
    cpus: Sequence[int],
    gpus: Sequence[str] = (),
) -> NetPlan:
    """The whole network of one run (see the module docstring's tables)."""
    check_run_id(run_id)
    cores = core_shares(cpus, n)
    gpu = gpu_shares(gpus, n)
    base = subnet.network_address
    hosts = []
    for k in range(1, n + 1):
        name = f"host{k}"
        inside, peer = ifnames(run_id, k)
        hosts.append(
            SimHost(
                name=name,
                netns=f"{PREFIX}-{run_id}-{name}",
                address=str(base + k),
                ifname=inside,
                peer=peer,
                cpus=cores[k - 1],
                gpus=gpu[k - 1],
                labels={HOST_LABEL: name},
            )
        )
    bridge = bridge_name(run_id)
    assert len(bridge) <= IFNAMSIZ
    return NetPlan(
        run_id=run_id,
        subnet=str(subnet),
        bridge=bridge,
        bridge_address=str(base + BRIDGE_HOST),
        hosts=tuple(hosts),
    )


@dataclass(frozen=True)
class PrivilegeFacts:
    """What the simulated hosts need from this machine, as found (runtime.simhosts.facts)."""

    # effective capabilities of this process (/proc/self/status CapEff), as a bit mask
    cap_eff: int
    # /proc/self/ns/net exists (the kernel has network namespaces)
    netns_support: bool
    # the `ip` command (iproute2): `ip netns exec` runs each Ray node in its namespace
    ip_command: bool
    # the `taskset` command (util-linux): pins each node to its cores
    taskset_command: bool
    # `import ray` works (the [ray] extra: requirements/ray.txt)
    ray_module: bool


CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21


def missing(f: PrivilegeFacts) -> list[str]:
    """What is missing for ``--simulate-hosts``, each with how to get it; [] when nothing."""
    out = []
    lacking = [
        name
        for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
        if not (f.cap_eff >> bit) & 1
    ]
    if lacking:
        out.append(
            f"{' and '.join(lacking)} (to create network namespaces, a bridge and veth pairs): "
            "run as root, or in a container started with --cap-add NET_ADMIN --cap-add SYS_ADMIN"
        )
    if not f.netns_support:
        out.append("network namespaces in the kernel (/proc/self/ns/net is missing): CONFIG_NET_NS")
    if not f.ip_command:
        out.append("the `ip` command: apt-get install iproute2")
    if not f.taskset_command:
        out.append("the `taskset` command: apt-get install util-linux")
    if not f.ray_module:
        out.append("the Python module ray: pip install 'pd-sessions[ray]' (or -r requirements/ray.txt)")
    return out


def refusal(lacking: Sequence[str]) -> ConfigError:
    return ConfigError(
        "--simulate-hosts",
        "the simulated hosts need, and this machine lacks:\n  - " + "\n  - ".join(lacking),
    )


def ray_env(environ: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a Ray process we start: the caller's, less any pointer at another
    Ray cluster, plus :data:`RAY_ENV` and ``extra``."""
    env = {k: v for k, v in environ.items() if k not in RAY_ENV_DROP}
    env.update(RAY_ENV)
    env.update(extra or {})
    return env


def labels_arg(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def head_argv(ray: Sequence[str], plan: NetPlan, ports: Mapping[str, int], temp_dir: str) -> list[str]:
    """``ray start --head`` on the bridge's address: no CPUs (no task or actor lands on it unless
    asked), no dashboard, a small object store, every port allocated (``ports``: each of
    :data:`HEAD_PORTS`, plus ``min-worker-port``), its temp dir ``temp_dir``; ``--block`` keeps
    ``ray start`` up as the parent of the node's processes (they die with it)."""
    lo = ports["min-worker-port"]
    argv = [
        *ray,
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address",
        plan.bridge_address,
        "--num-cpus",
        "0",
        "--num-gpus",
        "0",
        "--include-dashboard",
        "false",
        "--no-monitor",  # no autoscaler: the nodes are fixed
        "--include-log-monitor",
        "false",  # nobody reads workers' output through the driver: each process logs to a file
        "--object-store-memory",
        str(OBJECT_STORE_BYTES),
        "--temp-dir",
        temp_dir,
        "--labels",
        labels_arg({HOST_LABEL: DRIVER_HOST}),
        "--min-worker-port",
        str(lo),
        "--max-worker-port",
        str(lo + HEAD_WORKER_PORTS - 1),
    ]
    for name in HEAD_PORTS:
        argv += [f"--{name}", str(ports[name])]
    return argv


def node_argv(ray: Sequence[str], plan: NetPlan, host: SimHost, head_port: int, temp_dir: str) -> list[str]:
    """Host ``host``'s Ray node: ``ip netns exec <netns> taskset -c <cores> ray start --address
    <head> --node-ip-address <its address>``, with its cores and GPUs as its resources, its label
    and custom resource. Inside its namespace Ray's default ports are free (no other process
    has that network), so none is given."""
    return [
        "ip",
        "netns",
        "exec",
        host.netns,
        "taskset",
        "--cpu-list",
        ",".join(map(str, host.cpus)),
        *ray,
        "start",
        "--block",
        "--disable-usage-stats",
        "--address",
        f"{plan.bridge_address}:{head_port}",
        "--node-ip-address",
        host.address,
        "--num-cpus",
        str(len(host.cpus)),
        "--num-gpus",
        str(len(host.gpus)),
        "--object-store-memory",
        str(OBJECT_STORE_BYTES),
        "--temp-dir",
        temp_dir,
        "--include-log-monitor",
        "false",
        "--labels",
        labels_arg(host.labels),
        "--resources",
        f'{{"{host.resource}": 1}}',
    ]


def node_env(host: SimHost) -> dict[str, str]:
    """What a host's Ray node adds to :func:`ray_env`: its GPUs only."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(host.gpus)}
