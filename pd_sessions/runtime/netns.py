"""Network namespaces, a bridge and veth pairs, through netlink (edge; pyroute2, the [ray] extra).

The simulated hosts (runtime/simhosts.py) build their network with these, and the reaper
(runtime/reaper.py) removes what a killed run left with :func:`remove`. Every function here
names what it touches; none looks anything up by pattern: the caller passes the exact names it
created (all of them ``pds<run id>...``, see core/simhosts.py).

Nothing here sends a packet: a bridge forwards nothing it receives to another interface
(``/proc/sys/net/ipv4/conf/<bridge>/forwarding`` = 0, whatever the machine's ``ip_forward``), so
a namespace's default route ends at the bridge's address; :func:`forwards_out` checks that with a
route lookup (no packet).
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from pd_sessions.core.errors import HostSetupError

SYSFS_NET = Path("/sys/class/net")
PROC_CONF = Path("/proc/sys/net/ipv4/conf")
# Kinds of what this module creates, as the reaper records them.
LINK, NETNS = "link", "netns"


def _fail(step: str, e: OSError) -> HostSetupError:
    return HostSetupError(f"simulated hosts: {step}: {os.strerror(e.errno or 0) or e} (errno {e.errno})")


def root_addresses() -> list[str]:
    """Every IPv4 address of the root namespace, with its prefix ("198.18.0.254/24")."""
    from pyroute2 import IPRoute

    with IPRoute() as ip:
        return [
            f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}"
            for a in ip.get_addr(family=2)
            if a.get_attr("IFA_ADDRESS")
        ]


def link_exists(name: str) -> bool:
    return (SYSFS_NET / name).exists()


def _plain_children() -> None:
    """pyroute2 does namespace work in a forked child and ends it with SIGTERM: the child must not
    keep the harness's signal handlers, or that SIGTERM runs the harness's stop and teardown in
    the child (seen: a forked child removed the run's links while the run went on)."""
    from pyroute2 import config

    config.disable_mp_signal = True


def netns_exists(name: str) -> bool:
    from pyroute2 import netns

    return name in netns.listnetns()


def create_bridge(name: str, address: str, prefixlen: int) -> None:
    """A bridge ``name`` with ``address``/``prefixlen``, up, forwarding nothing elsewhere."""
    from pyroute2 import IPRoute, NetlinkError

    try:
        with IPRoute() as ip:
            ip.link("add", ifname=name, kind="bridge")
            idx = ip.link_lookup(ifname=name)[0]
            (PROC_CONF / name / "forwarding").write_text("0\n")
            ip.addr("add", index=idx, address=address, prefixlen=prefixlen)
            ip.link("set", index=idx, state="up")
    except (NetlinkError, OSError) as e:
        raise _fail(f"creating bridge {name} ({address}/{prefixlen})", e) from e


def add_host(
    ns: str, *, peer: str, ifname: str, bridge: str, address: str, prefixlen: int, gateway: str
) -> None:
    """Namespace ``ns`` with ``lo`` up and a veth pair: ``ifname`` inside (``address``,
    default route via ``gateway``), ``peer`` on ``bridge``."""
    from pyroute2 import IPRoute, NetlinkError, NetNS, netns

    _plain_children()
    try:
        netns.create(ns)
        with IPRoute() as ip:
            ip.link("add", ifname=peer, kind="veth", peer={"ifname": ifname, "net_ns_fd": ns})
            idx = ip.link_lookup(ifname=peer)[0]
            ip.link("set", index=idx, master=ip.link_lookup(ifname=bridge)[0], state="up")
        with NetNS(ns) as nsip:
            nsip.link("set", index=nsip.link_lookup(ifname="lo")[0], state="up")
            idx = nsip.link_lookup(ifname=ifname)[0]
            nsip.addr("add", index=idx, address=address, prefixlen=prefixlen)
            nsip.link("set", index=idx, state="up")
            nsip.route("add", dst="0.0.0.0/0", gateway=gateway)
    except (NetlinkError, OSError) as e:
        step = f"creating namespace {ns} ({ifname} {address}/{prefixlen}, peer {peer} on {bridge})"
        raise _fail(step, e) from e


def remove_link(name: str) -> bool:
    """Delete link ``name`` (a veth's root end takes its pair with it); False if it was gone."""
    from pyroute2 import IPRoute, NetlinkError

    try:
        with IPRoute() as ip:
            found = ip.link_lookup(ifname=name)
            if not found:
                return False
            ip.link("del", index=found[0])
            return True
    except NetlinkError as e:
        if e.code == errno.ENODEV:
            return False
        raise _fail(f"removing link {name}", e) from e


def remove_netns(name: str) -> bool:
    """Delete namespace ``name`` (its interfaces go with the last process in it); False if it
    was gone."""
    from pyroute2 import netns

    _plain_children()
    if not netns_exists(name):
        return False
    try:
        netns.remove(name)
    except OSError as e:
        if e.errno == errno.ENOENT:
            return False
        raise _fail(f"removing namespace {name}", e) from e
    return True


def remove(kind: str, name: str) -> bool:
    """Remove one thing the simulated hosts created, by kind (:data:`LINK`, :data:`NETNS`)."""
    if kind == LINK:
        return remove_link(name)
    if kind == NETNS:
        return remove_netns(name)
    raise ValueError(f"unknown kind {kind!r}")


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
        raise _fail(f"reading the counters of {peer}", e) from e
    return rx, tx


def forwards_out(bridge: str, src: str, dst: str = "203.0.113.7") -> bool:
    """Would the root namespace forward a packet from ``src`` arriving on ``bridge`` to ``dst``
    (TEST-NET-3 by default)? A route lookup, no packet."""
    from pyroute2 import IPRoute, NetlinkError

    with IPRoute() as ip, contextlib.suppress(NetlinkError):
        idx = ip.link_lookup(ifname=bridge)[0]
        ip.route("get", dst=dst, src=src, iif=idx)
        return True
    return False
