"""Network namespaces, a bridge and veth pairs (edge): iproute2's ``ip``, run as argv lists.

The simulated hosts (runtime/simhosts.py) build their network with these, and the reaper
(runtime/reaper.py) removes what a killed run left with :func:`remove`. Every function here
names what it touches; none looks anything up by pattern: the caller passes the exact names it
created (all of them ``pds<run id>...``, see core/simhost_plan.py).

Why ``ip`` and not a netlink library in this process: making a namespace and configuring inside
it means entering it, and pyroute2 does that by forking the calling process without exec. In a
process with threads, and a Ray driver's gRPC among them, the fork broke the driver (its
``ray.shutdown`` hung) and the child replayed the parent's buffered output. ``ip`` enters the
namespace in a process of its own (``ip netns add``, ``ip -n NS ...``), and the Ray nodes run
under ``ip netns exec`` anyway.

Nothing here sends a packet: a bridge forwards nothing it receives to another interface
(``/proc/sys/net/ipv4/conf/<bridge>/forwarding`` = 0, whatever the machine's ``ip_forward``), so
a namespace's default route ends at the bridge's address; :func:`forwards_out` checks that with a
route lookup (no packet).

Nor does the root side send one off the machine: while any run's bridge is up, the root namespace
has an ``unreachable 198.18.0.0/15`` route (:func:`create_bridge` adds it before the first bridge,
:func:`remove` of kind :data:`ROUTE` drops it once no rehearsal address is left on this machine;
both under one machine-wide lock). Each bridge's own /24 is a longer prefix and still wins; an
address whose bridge is gone then fails at once ("No route to host") instead of following the
default route out of the machine (issue 38). The route is recorded like a link (the reaper, the
state file), so a SIGKILLed run whose reaper died too leaves it only until the next run's sweep.
:func:`route_get` is the lookup runtime/routeguard.py checks every rehearsal connection with.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pd_sessions.core.errors import HostSetupError
from pd_sessions.core.simhost_plan import NETWORK

SYSFS_NET = Path("/sys/class/net")
PROC_CONF = Path("/proc/sys/net/ipv4/conf")
NETNS_DIR = Path("/run/netns")  # where `ip netns add` names namespaces
# `ip netns exec NS` mounts the files of /etc/netns/NS over /etc's: each namespace's resolv.conf.
ETC_NETNS = Path("/etc/netns")
# A simulated host has no name server: the machine's one is beyond the bridge, which forwards
# nothing, so every lookup that reached DNS (a reverse lookup of the host's own address, as
# Python's http.server does when it binds) waited out the resolver's 2 x 5 s first. Here the
# resolver asks the namespace's own loopback, where nothing listens: refused at once. /etc/hosts
# is the machine's, as on a real host.
RESOLV_CONF = (
    "# pd-sessions simulated host: no name server (runtime/netns.py); lookups end at once\n"
    "nameserver 127.0.0.1\n"
    "options timeout:1 attempts:1\n"
)
# Kinds of what this module creates, as the reaper records them. ROUTE: the root namespace's
# ``unreachable`` route for the whole rehearsal range (its name: "198.18.0.0/15"), shared by every
# run on this machine.
LINK, NETNS, ROUTE = "link", "netns", "route"
GUARD_ROUTE = str(NETWORK)
# Held while the guard route is added with a bridge, or dropped after the last one (machine-wide:
# runs with different state folders share the route).
GUARD_LOCK = Path("/run/pd-sessions/route.lock")


def _ip(*args: str, step: str) -> str:
    """``ip ARGS``'s output; HostSetupError naming ``step``, the command and its message."""
    try:
        out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostSetupError(f"simulated hosts: {step}: `ip {' '.join(args)}`: {e}") from e
    if out.returncode != 0:
        raise HostSetupError(
            f"simulated hosts: {step}: `ip {' '.join(args)}` failed: {out.stderr.strip() or out.returncode}"
        )
    return out.stdout


def root_addresses() -> list[str]:
    """Every IPv4 address of the root namespace, with its prefix ("198.18.0.254/24")."""
    links = json.loads(_ip("-j", "-4", "addr", "show", step="listing this machine's addresses") or "[]")
    return [
        f"{a['local']}/{a['prefixlen']}" for link in links for a in link.get("addr_info", []) if "local" in a
    ]


def link_exists(name: str) -> bool:
    return (SYSFS_NET / name).exists()


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


@contextlib.contextmanager
def _guard_locked() -> Iterator[None]:
    GUARD_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(GUARD_LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def guard_route_exists() -> bool:
    """Is the ``unreachable 198.18.0.0/15`` route in the root namespace?"""
    routes = json.loads(_ip("-j", "route", "show", GUARD_ROUTE, step="listing the guard route") or "[]")
    return any(r.get("type") == "unreachable" for r in routes)


def _rehearsal_addresses() -> list[str]:
    """This namespace's addresses in 198.18.0.0/15 (a live run's bridge holds one)."""
    return [a for a in root_addresses() if ipaddress.ip_interface(a).ip in NETWORK]


def release_guard_route() -> bool:
    """Drop the guard route if no rehearsal address is left on this machine (the last run is
    gone); True if it was dropped."""
    with _guard_locked():
        if _rehearsal_addresses() or not guard_route_exists():
            return False
        _ip("route", "del", "unreachable", GUARD_ROUTE, step="removing the guard route")
        return True


def create_bridge(name: str, address: str, prefixlen: int) -> None:
    """A bridge ``name`` with ``address``/``prefixlen``, up, forwarding nothing elsewhere; the
    guard route (``unreachable 198.18.0.0/15``) added first if it is not there (the caller
    records :data:`ROUTE` before, as it records the bridge)."""
    step = f"creating bridge {name} ({address}/{prefixlen})"
    with _guard_locked():
        if not guard_route_exists():
            _ip("route", "add", "unreachable", GUARD_ROUTE, step=f"{step}: adding the guard route")
        _ip("link", "add", name, "type", "bridge", step=step)
        try:
            (PROC_CONF / name / "forwarding").write_text("0\n")
        except OSError as e:
            raise HostSetupError(f"simulated hosts: {step}: turning its forwarding off: {e}") from e
        _ip("addr", "add", f"{address}/{prefixlen}", "dev", name, step=step)
    _ip("link", "set", name, "up", step=step)


def add_host(
    ns: str, *, peer: str, ifname: str, bridge: str, address: str, prefixlen: int, gateway: str
) -> None:
    """Namespace ``ns`` with ``lo`` up and a veth pair: ``ifname`` inside (``address``,
    default route via ``gateway``), ``peer`` on ``bridge``."""
    step = f"creating namespace {ns} ({ifname} {address}/{prefixlen}, peer {peer} on {bridge})"
    _ip("netns", "add", ns, step=step)
    try:
        (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
        (ETC_NETNS / ns / "resolv.conf").write_text(RESOLV_CONF)
    except OSError as e:
        raise HostSetupError(f"simulated hosts: {step}: writing {ETC_NETNS / ns}/resolv.conf: {e}") from e
    _ip("link", "add", peer, "type", "veth", "peer", "name", ifname, "netns", ns, step=step)
    _ip("link", "set", peer, "master", bridge, "up", step=step)
    _ip("-n", ns, "link", "set", "lo", "up", step=step)
    _ip("-n", ns, "addr", "add", f"{address}/{prefixlen}", "dev", ifname, step=step)
    _ip("-n", ns, "link", "set", ifname, "up", step=step)
    _ip("-n", ns, "route", "add", "default", "via", gateway, step=step)


def remove(kind: str, name: str) -> bool:
    """Remove one thing the simulated hosts created, by kind (:data:`LINK`: a veth's root end
    takes its pair with it; :data:`NETNS`: its interfaces go with the last process in it, its
    /etc/netns folder with it; :data:`ROUTE`: the shared guard route, dropped only once no run's
    bridge is left, :func:`release_guard_route`); False if it was gone already (or, for the
    route, is still held by another run)."""
    if kind == ROUTE:
        if name != GUARD_ROUTE:
            raise ValueError(f"unknown route {name!r}")
        return release_guard_route()
    if kind not in (LINK, NETNS):
        raise ValueError(f"unknown kind {kind!r}")
    if kind == NETNS:
        shutil.rmtree(ETC_NETNS / name, ignore_errors=True)  # only read when a process enters it
    if not exists(kind, name):
        return False
    try:
        if kind == LINK:
            _ip("link", "del", name, step=f"removing link {name}")
        else:
            _ip("netns", "del", name, step=f"removing namespace {name}")
    except HostSetupError:
        if not exists(kind, name):  # gone meanwhile: a veth goes with its namespace, asynchronously
            return False
        raise
    return True


def exists(kind: str, name: str) -> bool:
    """Is it there? For :data:`ROUTE`: left over (there while no run's bridge holds it)."""
    if kind == ROUTE:
        return guard_route_exists() and not _rehearsal_addresses()
    return link_exists(name) if kind == LINK else netns_exists(name)


def route_get(address: str) -> dict[str, Any] | None:
    """The root namespace's (this namespace's) route to ``address`` (``ip -j route get``: its
    ``type``, ``dev``...), None where there is none ("No route to host": the guard route). A
    lookup, no packet."""
    out = subprocess.run(["ip", "-j", "route", "get", address], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return None
    routes = json.loads(out.stdout or "[]")
    return routes[0] if routes else None


def interface_with(address: str) -> str | None:
    """The interface of this namespace that carries ``address``, or None."""
    out = _ip("-j", "-4", "addr", "show", "to", f"{address}/32", step=f"finding {address}")
    links = json.loads(out or "[]")
    return str(links[0]["ifname"]) if links else None


def ifindex(name: str) -> int | None:
    """``name``'s interface index, None if there is no such interface (a cheap read of sysfs)."""
    try:
        return int((SYSFS_NET / name / "ifindex").read_text())
    except (OSError, ValueError):
        return None


def counters(peer: str) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of the interface inside a namespace, read from its veth peer on the
    bridge: what the peer sends, the inside end receives, and the other way round."""
    stats = SYSFS_NET / peer / "statistics"
    try:
        rx = int((stats / "tx_bytes").read_text())
        tx = int((stats / "rx_bytes").read_text())
    except OSError as e:
        raise HostSetupError(f"simulated hosts: reading the counters of {peer}: {e}") from e
    return rx, tx


def forwards_out(bridge: str, src: str, dst: str = "203.0.113.7") -> bool:
    """Would the root namespace forward a packet from ``src`` arriving on ``bridge`` to ``dst``
    (TEST-NET-3 by default)? A route lookup, no packet."""
    out = subprocess.run(
        ["ip", "route", "get", dst, "from", src, "iif", bridge], capture_output=True, timeout=30, check=False
    )
    return out.returncode == 0
