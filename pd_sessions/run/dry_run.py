"""``--dry-run`` (sweep and serve): every plan printed, nothing launched.

Across a Ray cluster (``--ray``) each host's facts are gathered there (nothing generated, every
port held only while planning). With ``--simulate-hosts N`` nothing is made at all: no
namespace, no bridge, no Ray node; the plans use the hosts' stated shape
(core/simhost_plan.py: their names, addresses and shares of this machine's cores and GPUs), as
the run would make them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from pd_sessions.core import simhost_plan
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan.across_hosts import HostFacts, HostLayout
from pd_sessions.core.plan.packing import Packing
from pd_sessions.core.port_source import PortSource
from pd_sessions.core.selection import Selection
from pd_sessions.run.ray_hosts import hosts_for, phase_one
from pd_sessions.run.sweep_options import SweepOptions, make_plan
from pd_sessions.runtime.ports import PortAllocator
from pd_sessions.runtime.raylaunch import RayHosts, RemotePorts

# The run id the stated shape is planned with: a real run draws its own.
STATED_RUN_ID = "000000"


def stated_layout(n: int, inv: Inventory, *, allow_loopback: bool = False) -> HostLayout:
    """The layout ``--simulate-hosts n`` would give, from the plan of the hosts alone: each
    host's name, address (in the first /24 of 198.18.0.0/15; a run takes the first one free) and
    inventory as its agent would detect it (its share of ``inv``'s cores, the GPUs this machine
    shows, no RDMA device on a veth), the driver on the bridge's address."""
    net = simhost_plan.plan_network(n, STATED_RUN_ID, simhost_plan.subnets()[0], inv.cpus)
    label = simhost_plan.HOST_LABEL
    driver = HostFacts(
        simhost_plan.DRIVER_HOST,
        net.bridge_address,
        inv,
        interface=net.bridge,
        labels=((label, simhost_plan.DRIVER_HOST),),
    )
    hosts = [
        HostFacts(
            h.name,
            h.address,
            Inventory(gpus=inv.gpus, cpus=h.cpus, gpu_source=inv.gpu_source, rdma_devices=()),
            interface=h.ifname,
            labels=((label, h.name),),
            python=sys.executable,
        )
        for h in net.hosts
    ]
    return HostLayout((driver, *hosts), driver.name, allow_loopback=allow_loopback)


@contextmanager
def planning_hosts(
    opts: SweepOptions, inv: Inventory, say: Callable[[str], None]
) -> Iterator[RayHosts | HostLayout | None]:
    """What a dry run plans across: the simulated hosts' stated layout (nothing made), the Ray
    cluster of ``--ray`` (joined for its facts), or None (this host)."""
    if opts.simulate_hosts:
        say(
            f"dry run: {opts.simulate_hosts} simulated hosts planned as stated, none made "
            "(a run takes the first free /24 of 198.18.0.0/15: its addresses may differ)"
        )
        yield stated_layout(opts.simulate_hosts, inv, allow_loopback=opts.allow_loopback_advertise)
        return
    with hosts_for(opts, say) as hosts:
        yield hosts


def plan_text(
    config: ClusterConfig, inv: Inventory, opts: SweepOptions, hosts: RayHosts | HostLayout | None
) -> str:
    """One config's plan as --dry-run prints it (see the module docstring)."""
    with PortAllocator(config.host) as ports:
        layout: HostLayout | None = None
        remote: dict[str, RemotePorts] = {}
        sources: Mapping[str, PortSource] = {}
        if isinstance(hosts, HostLayout):  # nothing runs there: this host's ports stand in
            layout, sources = hosts, {h.name: ports for h in hosts.hosts if h.name != hosts.driver}
        elif hosts is not None:
            layout, remote = phase_one(hosts, config, opts, create_model=False)
            sources = remote
        try:
            plan = make_plan(config, inv, ports, opts, create_model=False, layout=layout, host_ports=sources)
        finally:
            for p in remote.values():
                p.release()
    return plan.render()


def dry_run(sel: Selection, opts: SweepOptions, packing: Packing, say: Callable[[str], None]) -> int:
    """Print the waves and every plan (on the share of the host its wave gives it), left-out
    configs too (marked, on the whole host), so that each can be reviewed."""
    share = {p.name: p.inventory for p in packing.order}
    shown = [(c, "") for c in sel.configs] + [
        (e.config, "  (left out of this run)") for e in sel.left_out if not sel.only
    ]
    print(packing.render())
    with planning_hosts(opts, sel.inv, say) as hosts:
        for config, mark in shown:
            inv = share.get(config.name, sel.inv)
            print(plan_text(config, inv, opts, hosts).replace("\n", mark + "\n", 1))
    say(f"dry run: {len(shown)} plans, nothing was launched")
    return 0
