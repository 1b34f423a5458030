"""``--ray ADDRESS`` against a Ray cluster this test starts itself, as a user with real hosts does:
two network namespaces on a bridge (the simulated hosts' network pieces, runtime/netns.py), a head
started with ``ray start --head`` on the bridge and a node in each namespace with ``ray start
--address ... --labels pd-host=hostK``; then ``pd-sessions sweep --ray HEAD`` (no --simulate-hosts)
on the fake stack. Its instances run on the two nodes with their addresses, the checks pass, and
nothing of the run is left; then the test stops its nodes and removes its network."""

from __future__ import annotations

import os
import secrets
import shutil
import sys

import pytest
from helpers import ROOT
from helpers.fake_runs import FAKE, fake_sweep_toml
from helpers.needs import simhosts_available
from helpers.waiting import wait_until

from pd_sessions.runtime import process
from pd_sessions.runtime.ports import PortAllocator

pytestmark = pytest.mark.multihost


@pytest.fixture
def own_ray_cluster(tmp_path):
    """(head address, hosts): a Ray head and two namespace nodes started with `ray start`."""
    simhosts_available()
    from pd_sessions.core import simhost_plan as core
    from pd_sessions.runtime import netns
    from pd_sessions.runtime.simhosts import _Nodes, ray_command

    run_id = secrets.token_hex(3)
    plan = core.plan_network(
        2, run_id, core.pick_subnet(netns.root_addresses()), sorted(os.sched_getaffinity(0))
    )
    running: list[process.Running] = []
    env = core.ray_env(os.environ)
    short = f"/tmp/{core.PREFIX}-{run_id}"  # Ray's socket paths must stay short
    try:
        netns.create_bridge(plan.bridge, plan.bridge_address, plan.prefixlen)
        for h in plan.hosts:
            netns.add_host(h.netns, peer=h.peer, ifname=h.ifname, bridge=plan.bridge, address=h.address,
                           prefixlen=plan.prefixlen, gateway=plan.bridge_address)  # fmt: skip
        with PortAllocator("0.0.0.0") as ports:
            got = {name: ports.take(name) for name in core.HEAD_PORTS}
            got["min-worker-port"] = ports.take_block("workers", core.HEAD_WORKER_PORTS)
        argv = core.head_argv(ray_command(), plan, got, f"{short}/head")
        running.append(process.spawn("ray-head", argv, env=env, log_path=tmp_path / "head.log"))
        for h in plan.hosts:
            argv = core.node_argv(ray_command(), plan, h, got["port"], f"{short}/{h.name}")
            log = tmp_path / f"{h.name}.log"
            running.append(
                process.spawn(f"ray-{h.name}", argv, env={**env, **core.node_env(h)}, log_path=log)
            )
        address = f"{plan.bridge_address}:{got['port']}"
        nodes = _Nodes(address)
        wait_until(
            lambda: nodes.refresh() is None and all(h.address in nodes.seen for h in plan.hosts),
            180,
            lambda: f"both nodes to join {address} (seen: {list(nodes.seen)})",
            tick=1.0,
        )
        yield address, plan.hosts
    finally:
        process.stop(running, grace_s=5.0)
        for h in plan.hosts:
            netns.remove(netns.NETNS, h.netns)
            netns.remove(netns.LINK, h.peer)
        netns.remove(netns.LINK, plan.bridge)
        netns.remove(netns.ROUTE, netns.GUARD_ROUTE)  # create_bridge added it (if no run held it)
        shutil.rmtree(short, ignore_errors=True)  # the nodes' temp dirs, and their parent
        assert not netns.exists(netns.ROUTE, netns.GUARD_ROUTE)
        assert not any(netns.netns_exists(h.netns) for h in plan.hosts) and not netns.link_exists(plan.bridge)
        assert not any((netns.ETC_NETNS / h.netns).exists() for h in plan.hosts)
        assert not os.path.lexists(short)


def test_ray_address_against_nodes_the_test_started_itself(tmp_path, own_ray_cluster):
    from helpers.cli_runs import Cli

    address, hosts = own_ray_cluster
    extra = f'extra_env = {{PYTHONPATH = "{FAKE}{os.pathsep}{ROOT}"}}'
    (tmp_path / "sweep.toml").write_text(fake_sweep_toml(top='checks = ["smoke", "parity"]', extra=extra))
    results = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": f"{FAKE}{os.pathsep}{ROOT}"}
    run = Cli(
        "sweep", str(tmp_path / "sweep.toml"), "--platform", "cpu", "--ray", address,
        "--results-dir", str(results), "--grace", "2", env=env,
    )  # fmt: skip
    assert run.wait(300) == 0, run.text
    plan = (results / "1x1" / "plan.txt").read_text()
    assert f"  prefill-0: http://{hosts[0].address}:" in plan and " on host1 (" in plan
    assert f"  decode-0: http://{hosts[1].address}:" in plan and " on host2 (" in plan
    assert f"joined the Ray cluster at {address}" in run.text
    assert sys.executable in plan  # each node's own interpreter (here the same)
