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
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from pd_sessions.core.errors import HostSetupError

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
# Kinds of what this module creates, as the reaper records them.
LINK, NETNS = "link", "netns"


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


def create_bridge(name: str, address: str, prefixlen: int) -> None:
    """A bridge ``name`` with ``address``/``prefixlen``, up, forwarding nothing elsewhere."""
    step = f"creating bridge {name} ({address}/{prefixlen})"
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
    /etc/netns folder with it); False if it was gone already."""
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
    return link_exists(name) if kind == LINK else netns_exists(name)


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
