"""A connection to a simulated host's address goes through its run's bridge, or is not made (edge).

The simulated hosts (runtime/simhosts.py) take their addresses from 198.18.0.0/15, a /24 per run,
reached from the root side through that run's bridge. Were the bridge gone (issue 38: a later
run's sweep removed a live run's network), the next connection to one of its addresses would
follow the default route off the machine, and whatever answers there (an HTTP/2 404 in the
issue) would be taken for the run's Ray head or server. So before the driver joins a rehearsal's
Ray cluster (raylaunch.RayHosts), a readiness probe or any request of runtime/http.py goes out,
the simulated hosts' own probes connect, or the router is let go at its instances
(runtime/cluster.py), :func:`check` looks the address up:

- Not in 198.18.0.0/15: nothing to check.
- In a run this machine knows (its subnet in a state file of ``/run/pd-sessions/simhosts``, or a
  run of this process not yet removed): the route (``ip route get``, runtime/netns.py) must go through that
  run's bridge (root side; for the bridge's own address: the bridge must carry it), or through
  one of that run's namespace interfaces (a process on a simulated host). Else :class:`RouteError`
  naming the address, the missing bridge and the run id, at once.
- In no run this machine knows: refused when there is no route (the guard route
  ``unreachable 198.18.0.0/15``, netns.py) or when the route goes through a gateway (the
  default route: off the machine); a directly connected network of a user's own (real hosts
  numbered from this range) is let through.

Cheap: one ``ip route get`` per address per process; after that a connection reads the interface
index of the device it went through (sysfs) and compares it with the one seen: a removed bridge
is noticed on the next connection.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from pd_sessions.core import simhost_plan as core
from pd_sessions.core.errors import RouteError
from pd_sessions.runtime import netns

# subnet ("198.18.3.0/24") -> run id, of the runs made in this process (simhosts.start)
_runs: dict[str, str] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class _Seen:
    run_id: str | None
    dev: str
    ifindex: int


# address -> the device its route went through when last checked
_seen: dict[str, _Seen] = {}


def register(subnet: str, run_id: str) -> None:
    """A run made in this process, until :func:`forget` (its state file may be elsewhere)."""
    with _lock:
        _runs[subnet] = run_id


def forget(subnet: str, run_id: str) -> None:
    """That run is removed: its /24 may go to another run, or to a network of a user's own."""
    with _lock:
        if _runs.get(subnet) == run_id:
            del _runs[subnet]


def run_of(address: str, state_dir: Path | None = None) -> str | None:
    """The run id of the simulated-hosts run whose /24 holds ``address`` on this machine, None if
    none does (or ``address`` is not a rehearsal address)."""
    subnet = core.subnet_of(address)
    if subnet is None:
        return None
    for p in sorted(Path(state_dir or core.STATE_DIR).glob("*.json")):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("subnet") == subnet and doc.get("run_id"):
            return str(doc["run_id"])
    with _lock:
        return _runs.get(subnet)


def check(address: str | None, *, state_dir: Path | None = None) -> None:
    """Raise RouteError unless a connection to ``address`` would go through its run's bridge (see
    the module docstring); a host name, or an address outside 198.18.0.0/15, passes at once."""
    if not address or not address.startswith("198.1") or core.subnet_of(address) is None:
        return
    seen = _seen.get(address)
    if seen is not None and netns.ifindex(seen.dev) == seen.ifindex:
        return
    run_id = run_of(address, state_dir)
    try:
        dev = _device(address, run_id)
    except RouteError:
        if run_id is None and seen is not None and seen.run_id is not None:
            # its state file went with its bridge: name the run it belonged to when last seen
            raise _gone(address, seen.run_id, "no route to it through a bridge") from None
        raise
    index = netns.ifindex(dev)
    if index is None:  # gone between the lookup and now
        dev = _device(address, run_id)
        index = netns.ifindex(dev)
        if index is None:
            raise _gone(address, run_id, f"its interface {dev} is gone")
    _seen[address] = _Seen(run_id, dev, index)


def _device(address: str, run_id: str | None) -> str:
    """The device a connection to ``address`` goes through, when it is one the run allows."""
    route = netns.route_get(address)
    if route is None:
        raise _gone(address, run_id, "no route to it (198.18.0.0/15 is unreachable here)")
    dev = str(route.get("dev") or "")
    if route.get("type") == "local":  # an address of this namespace: the interface that has it
        dev = netns.interface_with(address) or dev
    if run_id is None:
        if route.get("gateway"):
            raise RouteError(
                address,
                f"a simulated host's address (198.18.0.0/15), but no simulated-hosts run on this "
                f"machine has its subnet {core.subnet_of(address)} (none in {core.STATE_DIR}) and its "
                f"route goes through gateway {route['gateway']} (dev {dev}), off this machine: not "
                "connecting",
            )
        return dev
    bridge = core.bridge_name(run_id)
    if dev == bridge or dev.startswith(f"{core.PREFIX}{run_id}n"):
        return dev
    raise _gone(address, run_id, f"its route goes through {dev or route}, not through the run's bridge")


def _gone(address: str, run_id: str | None, why: str) -> RouteError:
    if run_id is None:
        return RouteError(
            address,
            f"a simulated host's address (198.18.0.0/15), but no simulated-hosts run on this machine "
            f"has its subnet {core.subnet_of(address)} (none in {core.STATE_DIR}): {why}; not connecting",
        )
    bridge = core.bridge_name(run_id)
    state = "is gone" if not netns.link_exists(bridge) else "is there"
    return RouteError(
        address,
        f"the bridge {bridge} of simulated-hosts run {run_id} {state}: {why}; not connecting "
        "(its traffic must not leave through another route)",
        bridge=bridge,
        run_id=run_id,
    )
