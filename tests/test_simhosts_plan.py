"""The simulated hosts' pure decisions (core/simhost_plan.py): names, addresses, core shares, the
privilege check and the Ray command lines. The real hosts are tests/test_simhosts.py."""

from __future__ import annotations

import ipaddress
import itertools
import json

import pytest

from pd_sessions.core import simhost_plan as core
from pd_sessions.core.errors import ConfigError

SUBNET = ipaddress.IPv4Network("198.18.7.0/24")
ALL_THERE = core.PrivilegeFacts(
    cap_eff=(1 << core.CAP_NET_ADMIN) | (1 << core.CAP_SYS_ADMIN),
    netns_support=True,
    ip_command=True,
    taskset_command=True,
    ray_module=True,
)


@pytest.mark.parametrize(
    ("cpus", "n", "want"),
    [
        ((0, 1), 2, [(0,), (1,)]),
        ((0, 1, 2, 3, 4), 2, [(0, 1, 2), (3, 4)]),
        ((7, 3, 5), 3, [(3,), (5,), (7,)]),  # sorted, then cut
        ((0, 1, 2, 3), 1, [(0, 1, 2, 3)]),
    ],
)
def test_core_shares_are_disjoint_contiguous_and_cover_every_core(cpus, n, want):
    got = core.core_shares(cpus, n)
    assert got == want
    flat = [c for share in got for c in share]
    assert sorted(flat) == sorted(cpus) and len(set(flat)) == len(flat)


def test_more_hosts_than_cores_is_refused_naming_the_flag_and_the_count():
    with pytest.raises(ConfigError, match=r"--simulate-hosts: 3 hosts need at least 3 cores.*on 2 \(0,1\)"):
        core.core_shares((0, 1), 3)
    with pytest.raises(ConfigError, match="allowed: 1 to 253"):
        core.check_count(0, (0, 1))


def test_gpu_shares_may_leave_a_host_without_one():
    assert core.gpu_shares(("0", "1", "2"), 2) == [("0", "1"), ("2",)]
    assert core.gpu_shares(("3",), 2) == [("3",), ()]
    assert core.gpu_shares((), 2) == [(), ()]


@pytest.mark.parametrize(
    ("used", "want"),
    [
        ([], "198.18.0.0/24"),
        (["127.0.0.1/8", "192.0.2.2/24", "10.0.0.5/8"], "198.18.0.0/24"),  # others don't matter
        (["198.18.0.254/24"], "198.18.1.0/24"),  # another run's bridge
        (["198.18.0.0/24", "198.18.1.7/24"], "198.18.2.0/24"),
        (["198.18.0.0/16"], "198.19.0.0/24"),  # someone's wider network in the range
        (["fd00::2/64", "198.18.0.1/32"], "198.18.1.0/24"),  # IPv6 ignored; a /32 inside counts
    ],
)
def test_pick_subnet_takes_the_first_24_no_address_of_the_machine_is_in(used, want):
    assert str(core.pick_subnet(used)) == want


def test_pick_subnet_when_the_whole_range_is_taken_says_what_to_remove():
    with pytest.raises(ConfigError, match=r"every /24 of 198\.18\.0\.0/15 is already in use"):
        core.pick_subnet(["198.18.0.0/15"])


def test_the_network_plan_names_addresses_and_shares():
    plan = core.plan_network(2, "a1b2c3", SUBNET, (0, 1), ("0",))
    assert plan.bridge == "pdsa1b2c3br"
    assert plan.bridge_address == "198.18.7.254" and plan.subnet == "198.18.7.0/24"
    h1, h2 = plan.hosts
    assert (h1.name, h1.netns, h1.address, h1.ifname, h1.peer) == (
        "host1",
        "pds-a1b2c3-host1",
        "198.18.7.1",
        "pdsa1b2c3n1",
        "pdsa1b2c3h1",
    )
    assert (h2.address, h2.cpus, h2.gpus) == ("198.18.7.2", (1,), ())
    assert h1.labels == {"pd-host": "host1"} and h1.resource == "pd-host-host1"
    assert {h1: "a", h2: "b"}[h1] == "a"  # hashable: a host can key a dict
    inv = h1.inventory()
    assert (inv.cpus, inv.gpus, inv.rdma_devices) == ((0,), ("0",), ())


def test_every_name_fits_linux_and_every_address_is_in_the_test_range_for_the_most_hosts():
    n = core.MAX_HOSTS
    plan = core.plan_network(n, "ffffff", ipaddress.IPv4Network("198.19.255.0/24"), range(n))
    names = [plan.bridge] + [h.ifname for h in plan.hosts] + [h.peer for h in plan.hosts]
    assert max(map(len, names)) <= core.IFNAMSIZ
    assert len(set(names)) == len(names)
    addresses = [plan.bridge_address] + [h.address for h in plan.hosts]
    assert len(set(addresses)) == n + 1
    assert all(ipaddress.ip_address(a) in core.NETWORK for a in addresses)
    # Ray's sockets live in each node's temp dir, reached through the short link: AF_UNIX <= 107
    sock = f"{plan.short_dir}/host{n}/session_2026-12-01_21-56-23_391564_4194304/sockets/plasma_store"
    assert len(sock) <= 107


@pytest.mark.parametrize("bad", ["A1B2C3", "a1b2c", "a1b2c3d", "zzzzzz", "../../"])
def test_a_run_id_is_six_lower_case_hex_digits(bad):
    with pytest.raises(ConfigError, match="run id"):
        core.plan_network(1, bad, SUBNET, (0,))


def test_nothing_missing_when_all_is_there():
    assert core.missing(ALL_THERE) == []


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"cap_eff": 0}, "CAP_NET_ADMIN and CAP_SYS_ADMIN (to create network namespaces"),
        ({"cap_eff": 1 << core.CAP_SYS_ADMIN}, "CAP_NET_ADMIN (to create"),
        ({"netns_support": False}, "CONFIG_NET_NS"),
        ({"ip_command": False}, "apt-get install iproute2"),
        ({"taskset_command": False}, "apt-get install util-linux"),
        ({"ray_module": False}, "the Python module ray: pip install 'pd-sessions[ray]'"),
    ],
)
def test_what_is_missing_is_named_with_how_to_get_it(change, needle):
    facts = core.PrivilegeFacts(**{**ALL_THERE.__dict__, **change})
    lacking = core.missing(facts)
    assert len(lacking) == 1 and needle in lacking[0]
    err = core.refusal(lacking)
    assert isinstance(err, ConfigError) and err.field == "--simulate-hosts" and needle in str(err)


def test_the_head_binds_the_bridge_takes_no_cpu_and_only_allocated_ports():
    plan = core.plan_network(2, "a1b2c3", SUBNET, (0, 1))
    ports = {name: 40000 + i for i, name in enumerate(core.HEAD_PORTS)} | {"min-worker-port": 41000}
    argv = core.head_argv(["ray"], plan, ports, "/tmp/pds-a1b2c3/head")
    opt = _options(argv)
    assert argv[:4] == ["ray", "start", "--head", "--block"]
    assert opt["--node-ip-address"] == "198.18.7.254"
    assert (opt["--num-cpus"], opt["--num-gpus"], opt["--include-dashboard"]) == ("0", "0", "false")
    assert opt["--temp-dir"] == "/tmp/pds-a1b2c3/head" and opt["--labels"] == "pd-host=driver"
    assert "--disable-usage-stats" in argv
    for name in core.HEAD_PORTS:
        assert opt[f"--{name}"] == str(ports[name])
    last = 41000 + core.HEAD_WORKER_PORTS - 1
    assert (opt["--min-worker-port"], opt["--max-worker-port"]) == ("41000", str(last))


def test_a_node_runs_in_its_namespace_pinned_to_its_cores_with_its_address_and_label():
    plan = core.plan_network(2, "a1b2c3", SUBNET, (0, 1, 2, 3), ("0", "1"))
    h2 = plan.hosts[1]
    argv = core.node_argv(["ray"], plan, h2, 40123, "/tmp/pds-a1b2c3/host2")
    assert argv[:7] == ["ip", "netns", "exec", "pds-a1b2c3-host2", "taskset", "--cpu-list", "2,3"]
    assert argv[7:10] == ["ray", "start", "--block"]
    opt = _options(argv)
    assert opt["--address"] == "198.18.7.254:40123"
    assert opt["--node-ip-address"] == "198.18.7.2"
    assert (opt["--num-cpus"], opt["--num-gpus"]) == ("2", "1")
    assert opt["--labels"] == "pd-host=host2"
    assert json.loads(opt["--resources"]) == {"pd-host-host2": 1}
    assert core.node_env(h2) == {"CUDA_VISIBLE_DEVICES": "1"}


def test_ray_processes_never_join_another_cluster_and_report_nothing_home():
    env = core.ray_env({"PATH": "/bin", "RAY_ADDRESS": "10.0.0.1:6379", "RAY_NAMESPACE": "x"}, {"A": "1"})
    assert env["PATH"] == "/bin" and env["A"] == "1"
    assert "RAY_ADDRESS" not in env and "RAY_NAMESPACE" not in env
    assert env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"


def _options(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in itertools.pairwise(argv) if a.startswith("--")}


@pytest.mark.parametrize("still_there,expected", [(False, False), (True, "raises")])
def test_removing_what_vanished_meanwhile_is_not_an_error(monkeypatch, still_there, expected):
    """A veth's root end goes with its namespace, asynchronously: seen before ``ip link del``,
    gone when it runs. That is "already gone", not a failure; a removal that fails while the
    thing is still there raises."""
    from pd_sessions.core.errors import HostSetupError
    from pd_sessions.runtime import netns

    seen = iter([True, still_there])
    monkeypatch.setattr(netns, "exists", lambda kind, name: next(seen))

    def fails(*args, step):
        raise HostSetupError(f"simulated hosts: {step}: Cannot find device")

    monkeypatch.setattr(netns, "_ip", fails)
    if expected == "raises":
        with pytest.raises(HostSetupError, match="removing link pdsX"):
            netns.remove(netns.LINK, "pdsX")
    else:
        assert netns.remove(netns.LINK, "pdsX") is False
