"""Across hosts, phase 1's facts and the decisions taken on them before any instance is planned.

A multi-host plan (``--ray``) is made in two phases. First the facts of every host (gathered on
each Ray node by ``runtime.raylaunch``): its name, the address its processes bind and advertise,
its inventory (GPUs, cores, RDMA devices), its network interface, its node labels, its
interpreter and where the model lies there. Then the plan, from those facts alone (pure):

- which host each instance runs on (:func:`assign_hosts`: label selectors or the default split,
  round robin within a role);
- what each host adds to its instances' environment (:func:`host_env`);
- what it cannot run (:func:`host_problems`: RDMA devices named for another host);
- what would advertise loopback to the other hosts (:func:`loopback_advertised`).

The single-host plan never comes here (no :class:`HostLayout`): it is unchanged.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pd_sessions.core import connectors
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import PlanError
from pd_sessions.core.inventory import Inventory

# What every process tells other hosts to reach it by; each connector adds its own
# (ConnectorSpec.advertised_env). A loopback value there is the classic bug: vllm-project/vllm#27083
# for NIXL's side channel, Mooncake's workers registering 127.0.0.1.
ADVERTISED_ENV = ("VLLM_HOST_IP",)


@dataclass(frozen=True)
class HostFacts:
    """One host, as phase 1 found it."""

    name: str  # "host1": its pd-host label, else its address
    address: str  # what its processes bind and advertise (the Ray node's address)
    inventory: Inventory  # its GPUs, cores and RDMA devices
    interface: str | None = None  # the interface that carries ``address`` (GLOO/NCCL/UCX)
    labels: tuple[tuple[str, str], ...] = ()  # its Ray node labels
    python: str | None = None  # the interpreter that runs vLLM there; None: the plan's
    # the plan's model path -> where that model lies on this host (when it differs)
    model_paths: tuple[tuple[str, str], ...] = ()

    def has_label(self, selector: str) -> bool:
        key, _, value = selector.partition("=")
        return (key.strip(), value.strip()) in self.labels

    def model(self, path: str) -> str:
        """``path`` (the plan's --model) as this host has it."""
        return dict(self.model_paths).get(path, path)


@dataclass(frozen=True)
class HostLayout:
    """The hosts a plan may use, and the driver's (where the harness and the router run)."""

    hosts: tuple[HostFacts, ...]  # every Ray node, the driver's included
    driver: str  # the name of the driver's host
    # a loopback address advertised to other hosts is planned anyway (and warned): item 5's
    # proof that the rehearsal catches the bug
    allow_loopback: bool = False

    def by_name(self, name: str) -> HostFacts:
        return next(h for h in self.hosts if h.name == name)


@dataclass(frozen=True)
class Assignment:
    """The host of each instance, in plan order (prefill-0, prefill-1, ...; decode-0, ...)."""

    prefill: tuple[HostFacts, ...]
    decode: tuple[HostFacts, ...]
    notes: tuple[str, ...] = field(default=())


def _by_address(hosts: Sequence[HostFacts]) -> list[HostFacts]:
    """``hosts`` sorted by address (numerically; names that are not addresses last, by name)."""

    def key(h: HostFacts) -> tuple[int, int, str]:
        try:
            ip = ipaddress.ip_address(h.address)
        except ValueError:
            return (99, 0, h.address + "/" + h.name)
        return (ip.version, int(ip), h.name)

    return sorted(hosts, key=key)


def _describe(hosts: Sequence[HostFacts]) -> str:
    return "; ".join(
        f"{h.name} ({h.address}, labels {', '.join(f'{k}={v}' for k, v in h.labels) or 'none'})"
        for h in hosts
    )


def role_hosts(config: ClusterConfig, layout: HostLayout) -> tuple[list[HostFacts], list[HostFacts], str]:
    """(prefill hosts, decode hosts, how they were chosen), each list sorted by address.

    selectors for a role (``prefill_hosts``/``decode_hosts``)  -> the nodes matching any of
        them (the driver's too); none matching -> PlanError naming the field and every node
    no selectors                                                -> the default split of the
        nodes other than the driver's (the driver's alone when there is no other): the
        first half (rounded up) prefill, the rest decode; one node serves both
    """
    others = _by_address([h for h in layout.hosts if h.name != layout.driver]) or [
        layout.by_name(layout.driver)
    ]
    half = (len(others) + 1) // 2
    default = {"prefill": others[:half], "decode": others[half:] or others}
    chosen: dict[str, list[HostFacts]] = {}
    said = []
    for role, selectors in (("prefill", config.prefill_hosts), ("decode", config.decode_hosts)):
        if not selectors:
            chosen[role] = default[role]
            said.append(f"{role} on {', '.join(h.name for h in chosen[role])} (default split)")
            continue
        chosen[role] = _by_address([h for h in layout.hosts if any(h.has_label(s) for s in selectors)])
        if not chosen[role]:
            raise PlanError(
                f"{role}_hosts",
                f"no Ray node has any of the labels {list(selectors)}; the nodes: "
                f"{_describe(layout.hosts)} (label nodes with `ray start --labels KEY=VALUE`)",
            )
        said.append(f"{role} on {', '.join(h.name for h in chosen[role])} ({' or '.join(selectors)})")
    return chosen["prefill"], chosen["decode"], "; ".join(said)


def assign_hosts(config: ClusterConfig, layout: HostLayout) -> Assignment:
    """Each instance's host: a role's instances go round robin over that role's hosts
    (2P1D on 2 hosts: both prefills on the first, the decode on the second)."""
    prefill, decode, how = role_hosts(config, layout)
    return Assignment(
        prefill=tuple(prefill[i % len(prefill)] for i in range(config.num_prefill)),
        decode=tuple(decode[i % len(decode)] for i in range(config.num_decode)),
        notes=(f"hosts: {how}; the router on the driver's host ({layout.driver})",),
    )


def host_env(host: HostFacts, config: ClusterConfig, platform: str) -> dict[str, str]:
    """What ``host`` adds to an instance's environment, beside VLLM_HOST_IP and the connector's
    side-channel host (which take its address like every advertised address). The config's
    extra_env wins.

    always, interface known    GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME (torch.distributed's
                               sockets on the interface that carries the address)
    the connector              its spec's ``across_hosts.env`` (e.g. Mooncake's TCP transport
                               bound to the address; on the CPU lane, UCX over TCP only)
    """
    env: dict[str, str] = {}
    if host.interface:
        env["GLOO_SOCKET_IFNAME"] = host.interface
        env["NCCL_SOCKET_IFNAME"] = host.interface
    spec = connectors.get(config.connector)
    env.update(spec.across_hosts.env(config, platform, host.address, host.interface))
    return env


def host_problems(host: HostFacts, config: ClusterConfig, platform: str, env: Mapping[str, str]) -> None:
    """Raise PlanError when what an instance on ``host`` is told names a device that host lacks.

    host's RDMA devices unknown                  -> nothing to check
    the connector refuses the host's inventory   -> its field (its spec's ``limits.host_refusal``,
                                                    e.g. RDMA devices named that the host lacks)
    UCX_NET_DEVICES set, not "all":
        a device neither an RDMA device nor the host's interface -> "UCX_NET_DEVICES"
    """
    devices = host.inventory.rdma_devices
    if devices is None:
        return
    where = f"on {host.name} ({host.address})"
    refusal = connectors.get(config.connector).limits.host_refusal((config,), platform, host.inventory)
    if refusal:
        raise PlanError(refusal.field, f"{where}: {refusal.message}")
    ucx = env.get("UCX_NET_DEVICES")
    if ucx and ucx != "all":
        known = {*devices, *([host.interface] if host.interface else [])}
        unknown = [d for d in ucx.split(",") if d and d.split(":")[0] not in known]
        if unknown:
            raise PlanError(
                "UCX_NET_DEVICES",
                f"names {', '.join(unknown)}, not a device {where} (RDMA: "
                f"{', '.join(devices) or 'none'}; interface: {host.interface or 'unknown'})",
            )


def is_loopback(value: str) -> bool:
    """``localhost``, an empty value (vLLM's default is then localhost) or a loopback address."""
    v = value.strip().strip("[]").lower()
    if v in ("", "localhost") or v.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(v).is_loopback
    except ValueError:
        return False


def loopback_advertised(
    name: str, host: HostFacts, env: Mapping[str, str], url_host: str, connector: str
) -> list[tuple[str, str]]:
    """(variable, message) for every address instance ``name`` on ``host`` would give the other
    hosts that only reaches itself: its URL's host (what the router is told) and each of
    ADVERTISED_ENV and the connector's advertised variables that is set."""
    advertised = (*ADVERTISED_ENV, *connectors.get(connector).advertised_env())
    found = [("--host", url_host)] if is_loopback(url_host) else []
    found += [(var, env[var]) for var in advertised if var in env and is_loopback(env[var])]
    return [
        (
            var,
            f"{name} on {host.name} ({host.address}) would advertise {var}={value or '(empty)'}: "
            "a loopback address, which the other hosts cannot reach",
        )
        for var, value in found
    ]
