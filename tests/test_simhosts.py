"""The simulated hosts for real (runtime/simhosts.py, runtime/netns.py): network namespaces on a
bridge with Ray nodes. Each host is a Ray node with its address, label and cores; a server bound
to a host's address is reachable from another host, one bound to its loopback is not; nothing is
left after a teardown, a SIGKILL of the harness (the reaper) or a dead run (the next run's sweep).
The pure decisions are tests/test_simhosts_plan.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT
from helpers.cli_runs import Cli
from helpers.e2e_runs import simhosts_leftovers
from helpers.needs import simhosts_available
from helpers.procs import move_btime, old_rule_same
from helpers.waiting import wait_for_text, wait_until, within

from pd_sessions.core import simhost_plan as core
from pd_sessions.core.errors import ConfigError, HttpError, ProcessExited, RouteError
from pd_sessions.runtime import routeguard, simhosts

pytestmark = pytest.mark.multihost

# Listens on HOST:0 and 127.0.0.1:0 (in its namespace), prints both ports, then answers each
# connection with the number of bytes it received.
SERVER = textwrap.dedent("""
    import json, select, socket, sys, time
    socks = []
    for host in (sys.argv[1], "127.0.0.1"):
        s = socket.socket(); s.bind((host, 0)); s.listen(8); socks.append(s)
    print(json.dumps([s.getsockname()[1] for s in socks]), flush=True)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        ready, _, _ = select.select(socks, [], [], 1)
        for s in ready:
            c, _ = s.accept()
            n = 0
            while (b := c.recv(65536)):
                n += len(b)
            c.sendall(str(n).encode()); c.close()
""")
# Sends SIZE bytes to HOST:PORT; prints {"got": <the server's count>} or {"error": <name>}.
CLIENT = textwrap.dedent("""
    import json, socket, sys
    host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    try:
        c = socket.create_connection((host, port), timeout=5)
        c.sendall(b"x" * size); c.shutdown(socket.SHUT_WR)
        print(json.dumps({"got": int(c.recv(64))}))
    except OSError as e:
        print(json.dumps({"error": type(e).__name__}))
""")


def _env() -> dict[str, str]:
    """This environment, with the package under test first on the path (scripts run with -c)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def _in(ns: str | None, *argv: str) -> list[str]:
    return (["ip", "netns", "exec", ns] if ns else []) + list(argv)


def _connect(ns: str | None, host: str, port: int, size: int = 1000) -> dict:
    out = subprocess.run(
        _in(ns, sys.executable, "-c", CLIENT, host, str(port), str(size)),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return json.loads(out.stdout)


def test_each_host_is_a_ray_node_with_its_address_label_cores_and_network(simulated_hosts_2):
    """An actor placed by the host's label runs on that host's node, in its namespace, pinned
    to its cores, and Ray reports the host's address for it."""
    import ray

    sim = simulated_hosts_2
    ray.init(**sim.ray_init_kwargs(), logging_level="warning")
    try:
        _each_host_is_its_node(ray, sim)
    finally:
        ray.shutdown()  # the next test using the hosts may join them as its own driver


def _each_host_is_its_node(ray, sim) -> None:
    @ray.remote(num_cpus=0)
    class Where:
        def report(self) -> dict:
            return {
                "ip": ray.util.get_node_ip_address(),
                "cpus": sorted(os.sched_getaffinity(0)),
                "node_id": ray.get_runtime_context().get_node_id(),
                "netns": os.stat("/proc/self/ns/net").st_ino,
            }

    actors = [Where.options(label_selector=dict(h.labels)).remote() for h in sim.hosts]
    try:
        reports = ray.get([a.report.remote() for a in actors], timeout=120)
    finally:
        for a in actors:
            ray.kill(a)
    for h, got in zip(sim.hosts, reports, strict=True):
        assert got["ip"] == h.address, h
        assert got["cpus"] == list(h.cpus), h
        assert got["node_id"] == h.node_id, h
        assert got["netns"] == os.stat(f"/run/netns/{h.netns}").st_ino, h
        assert h.inventory().cpus == h.cpus
    h1, h2 = sim.hosts
    assert not set(h1.cpus) & set(h2.cpus), "two hosts share cores"
    assert ray.get_runtime_context().get_node_id() == sim.head_node_id  # the driver: on the head


def test_a_hosts_address_is_reachable_from_another_host_but_its_loopback_is_not(simulated_hosts_2, tmp_path):
    """The point of the rehearsal: host2 reaches host1's address (and the bytes show in both
    interfaces' counters) but not host1's loopback, which host1 itself does reach."""
    sim = simulated_hosts_2
    h1, h2 = sim.hosts
    server = subprocess.Popen(
        _in(h1.netns, sys.executable, "-c", SERVER, h1.address), stdout=subprocess.PIPE, text=True
    )
    try:
        on_address, on_loopback = json.loads(server.stdout.readline())
        size = 1 << 20
        rx1, _ = sim.counters(h1)
        _, tx2 = sim.counters("host2")
        assert _connect(h2.netns, h1.address, on_address, size) == {"got": size}
        assert sim.counters(h1)[0] - rx1 >= size
        assert sim.counters(h2)[1] - tx2 >= size
        assert _connect(h1.netns, "127.0.0.1", on_loopback) == {"got": 1000}  # it is up
        assert _connect(h2.netns, "127.0.0.1", on_loopback) == {"error": "ConnectionRefusedError"}
        assert _connect(h2.netns, h1.address, on_loopback) == {"error": "ConnectionRefusedError"}
        assert _connect(None, h1.address, on_address) == {"got": 1000}  # the driver's side
        assert _connect(None, "127.0.0.1", on_loopback) == {"error": "ConnectionRefusedError"}
    finally:
        server.kill()
        server.wait()
    from pd_sessions.runtime import netns

    assert not netns.forwards_out(sim.plan.bridge, h1.address), "the bridge would forward off the machine"


LOOKUP = (
    "import socket, sys, time; t = time.monotonic(); name = socket.getfqdn(sys.argv[1]); "
    "print(name, round(time.monotonic() - t, 2))"
)


def test_a_host_has_no_name_server_so_a_lookup_ends_at_once(simulated_hosts_2):
    """The machine's name server is beyond the bridge, which forwards nothing: a lookup that
    reached it from a host waited out the resolver (2 x 5 s; Python's http.server binding
    looked up its own address so: every fake server on a host started 10 s late). Each host has
    its own resolv.conf (the namespace's loopback: refused at once), and it goes with the host."""
    from pd_sessions.runtime import netns

    h1, _ = simulated_hosts_2.hosts
    out = subprocess.run(
        _in(h1.netns, sys.executable, "-c", LOOKUP, h1.address), capture_output=True, text=True, timeout=60
    )
    name, took = out.stdout.split()
    assert name == h1.address, out
    within(float(took), 4.0, "a lookup on a host (the resolver's timeout: 5 s)")
    assert "nameserver 127.0.0.1" in (netns.ETC_NETNS / h1.netns / "resolv.conf").read_text()


HOLDER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from pd_sessions.runtime.simhosts import start
    sim = start(1, Path(sys.argv[1]), say=lambda m: print(m, flush=True))
    print("HOSTS " + json.dumps({"run_id": sim.run_id, "pids": [r.pid for r in sim.processes]}), flush=True)
    time.sleep(600)
""")


def test_a_sigkilled_holder_leaves_nothing_its_reaper_removes_the_nodes_and_the_network(tmp_path):
    """The harness SIGKILLed with a host up: its reaper stops the Ray nodes (each ``ray start
    --block`` also hears its parent die) and removes the namespace, links and files."""
    simhosts_available()
    holder = Cli(argv=[sys.executable, "-c", HOLDER, str(tmp_path)], env=_env())
    try:
        holder.wait_for("HOSTS ", timeout=300)
    finally:
        holder.proc.kill()
        holder.wait()
    info = json.loads(holder.text.split("HOSTS ", 1)[1].splitlines()[0])
    wait_until(
        lambda: not simhosts_leftovers(info["run_id"], info["pids"]),
        60,
        lambda: f"run {info['run_id']} to be gone; left: {simhosts_leftovers(info['run_id'], info['pids'])}",
    )
    log = tmp_path / "simhosts" / "reaper.log"
    wait_for_text(log, f"netns pds-{info['run_id']}-host1: removed")
    assert "FAILED" not in log.read_text()


# Holds one host whose "Ray" is a sleeper (the real nodes are the SIGKILL test's and the
# fixture's): the CLI's signal handlers turn a signal into Stopped, and the context manager's
# exit removes everything.
STOPPED_HOLDER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from pd_sessions.runtime import console, simhosts
    def sleeper(self, timeout_s):
        argv = [sys.executable, "-c", "import time; time.sleep(600)"]
        self._spawn("ray-head", argv, dict(os.environ), self.results_dir / "sleeper.log")
    simhosts.SimulatedHosts.start_ray = sleeper
    console.install_signal_handlers()
    with simhosts.simulated_hosts(1, Path(sys.argv[1]), say=lambda m: print(m, flush=True)) as sim:
        info = {"run_id": sim.run_id, "pids": [r.pid for r in sim.processes]}
        print("HOSTS " + json.dumps(info), flush=True)
        time.sleep(600)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_removes_the_hosts_on_the_way_out(tmp_path, sig):
    simhosts_available()
    holder = Cli(argv=[sys.executable, "-c", STOPPED_HOLDER, str(tmp_path)], env=_env())
    try:
        holder.wait_for("HOSTS ", timeout=60)
        holder.proc.send_signal(sig)
        holder.wait(timeout=60)
    finally:
        holder.proc.kill()
        holder.wait()
    info = json.loads(holder.text.split("HOSTS ", 1)[1].splitlines()[0])
    assert simhosts_leftovers(info["run_id"], info["pids"]) == []  # at once: the harness did it
    assert f"run {info['run_id']} removed" in holder.text
    wait_for_text(tmp_path / "simhosts" / "reaper.log", "nothing to do")


def test_a_failed_start_removes_what_it_made_and_names_the_cause(tmp_path, monkeypatch):
    """The head dies at start: the error names it and its log; the network is gone."""
    simhosts_available()
    dies = [sys.executable, "-c", "import sys; print('no head today'); sys.exit(3)"]
    monkeypatch.setattr(core, "head_argv", lambda *a: dies)
    said: list[str] = []
    states = tmp_path / "states"
    with pytest.raises(ProcessExited, match=r"(?s)ray-head exited with status 3.*no head today"):
        simhosts.start(1, tmp_path / "r", say=said.append, state_dir=states)
    run_id = said[0].split("run ", 1)[1].split(",")[0]
    assert simhosts_leftovers(run_id) == []
    assert list(states.glob("*.json")) == []


def test_the_next_run_removes_what_a_dead_run_listed_and_nothing_else(tmp_path):
    """A run whose harness and reaper are both gone: the sweep removes exactly what its state
    file lists; a live run's state and an unlisted ``pds`` link are left alone."""
    simhosts_available()
    from pd_sessions.runtime import netns

    states = tmp_path / "states"
    states.mkdir()
    dead, live, stray = "d0d0d0", "e1e1e1", "f2f2f2"
    subnet = core.pick_subnet(netns.root_addresses())
    plan = core.plan_network(1, dead, subnet, (0,))
    (h,) = plan.hosts
    made = [(netns.LINK, plan.bridge), (netns.NETNS, h.netns), (netns.LINK, h.peer)]
    alive_bridge, stray_bridge = f"pds{live}br", f"pds{stray}br"
    try:
        netns.create_bridge(plan.bridge, plan.bridge_address, 24)
        netns.add_host(
            h.netns,
            peer=h.peer,
            ifname=h.ifname,
            bridge=plan.bridge,
            address=h.address,
            prefixlen=24,
            gateway=plan.bridge_address,
        )
        netns.create_bridge(alive_bridge, str(subnet.network_address + 100), 32)
        netns.create_bridge(stray_bridge, str(subnet.network_address + 101), 32)
        link = tmp_path / "short"
        link.symlink_to(tmp_path)
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
        gone_pid = gone.stdout.decode().strip()
        (states / f"{dead}.json").write_text(
            json.dumps(
                {
                    "run_id": dead,
                    "owner": {"pid": int(gone_pid), "start_ticks": 1},
                    "reaper": {"pid": int(gone_pid), "start_ticks": 1},
                    "processes": [],
                    "resources": [["route", netns.GUARD_ROUTE]]
                    + [[kind, name] for kind, name in made]
                    + [["file", str(link)]],
                }
            )
        )
        me = simhosts._identity(os.getpid())
        (states / f"{live}.json").write_text(
            json.dumps({"run_id": live, "owner": me, "resources": [["link", alive_bridge]]})
        )
        said: list[str] = []
        assert simhosts.sweep_stale(states, said.append) == [dead]
        assert f"run {dead}" in said[0] and "removing route 198.18.0.0/15, link pdsd0d0d0br" in said[0]
        assert not any(netns.exists(kind, name) for kind, name in made)
        assert not os.path.lexists(link) and tmp_path.exists()
        assert not (states / f"{dead}.json").exists() and (states / f"{live}.json").exists()
        assert netns.link_exists(alive_bridge) and netns.link_exists(stray_bridge)
        assert netns.guard_route_exists()  # the live run's bridge still holds it
    finally:
        for kind, name in [*made, (netns.LINK, alive_bridge), (netns.LINK, stray_bridge)]:
            netns.remove(kind, name)
        netns.remove(netns.ROUTE, netns.GUARD_ROUTE)
    assert not netns.exists(netns.ROUTE, netns.GUARD_ROUTE)


def test_the_reaper_removes_recorded_links_and_files_when_the_harness_is_gone(tmp_path):
    simhosts_available()
    from pd_sessions.runtime import netns
    from pd_sessions.runtime.reaper import Reaper

    subnet = core.pick_subnet(netns.root_addresses())
    bridge, kept = "pdsa0a0a0br", tmp_path / "kept"
    state = tmp_path / "state.json"
    state.write_text("{}")
    kept.write_text("not recorded")
    reaper = Reaper(tmp_path / "reaper.log", grace_s=1.0, warn=pytest.fail)
    try:
        reaper.created("file", str(state))
        reaper.created(netns.ROUTE, netns.GUARD_ROUTE)
        reaper.created(netns.LINK, bridge)
        netns.create_bridge(bridge, str(subnet.network_address + 1), 24)
        assert netns.guard_route_exists()
        reaper.close(timeout=60)  # the pipe ends as when the harness dies
        assert not netns.link_exists(bridge)
        assert not state.exists() and kept.exists()
        text = (tmp_path / "reaper.log").read_text()
        assert f"link {bridge}: removed" in text and f"file {state}: removed" in text
        assert f"route {netns.GUARD_ROUTE}: " in text
        assert not netns.exists(netns.ROUTE, netns.GUARD_ROUTE)
    finally:
        netns.remove(netns.LINK, bridge)
        netns.remove(netns.ROUTE, netns.GUARD_ROUTE)


def test_without_the_privilege_it_is_refused_before_anything_is_made(tmp_path, monkeypatch):
    lacking = core.PrivilegeFacts(
        cap_eff=0,
        netns_support=True,
        ip_command=True,
        taskset_command=True,
        ray_module=True,
    )
    monkeypatch.setattr(simhosts, "facts", lambda: lacking)
    needs = r"(?s)--simulate-hosts: .*CAP_NET_ADMIN and CAP_SYS_ADMIN.*run as root"
    with pytest.raises(ConfigError, match=needs):
        simhosts.start(1, tmp_path / "results", cpus=(0,), state_dir=tmp_path / "states")
    assert not (tmp_path / "results").exists() and not (tmp_path / "states").exists()
    with pytest.raises(ConfigError, match="2 hosts need at least 2 cores"):
        simhosts.start(2, tmp_path / "results", cpus=(0,), state_dir=tmp_path / "states")


def test_single_host_code_imports_the_simulated_hosts_without_ray(tmp_path):
    """The sweep may import runtime.simhosts at the top: that must not need the [ray] extra."""
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "ray":
                    raise ImportError(f"blocked: {name}")
        sys.meta_path.insert(0, Block())
        import pd_sessions.runtime.simhosts, pd_sessions.runtime.reaper
        assert "ray" not in sys.modules
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr


# --- issue 38: a live run is never taken for a dead one; its traffic never leaves the machine ---


@pytest.mark.parametrize("by", [1.0, -1.0])
def test_a_live_run_is_kept_by_the_sweep_whatever_btime_says(tmp_path, monkeypatch, by):
    """btime (/proc/stat) moves by a whole second when the kernel recomputes it across a
    second's boundary: every psutil create_time moves with it. The sweep tells a run's owner by
    its start ticks, so a live run's bridge stays while a dead run's goes in the same sweep.
    (The rule before, create_time within 0.01 s, took the live run for a dead one and removed its
    bridge: what removed the suite's simulated_hosts_2 network.)"""
    simhosts_available()
    from pd_sessions.runtime import netns

    states = tmp_path / "states"
    states.mkdir()
    live, dead = "a3a3a3", "b4b4b4"
    subnet = core.pick_subnet(netns.root_addresses())
    bridges = {run: core.bridge_name(run) for run in (live, dead)}
    gone = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.2)"], check=False)
    assert gone.returncode == 0
    try:
        for k, run in enumerate((live, dead)):
            netns.create_bridge(bridges[run], str(subnet.network_address + 200 + k), 32)
        me = simhosts._identity(os.getpid())
        dying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        them = simhosts._identity(dying.pid)
        dying.kill()
        dying.wait()
        for run, who in ((live, me), (dead, them)):
            doc = {"run_id": run, "owner": who, "reaper": who}
            doc["resources"] = [["route", netns.GUARD_ROUTE], ["link", bridges[run]]]
            (states / f"{run}.json").write_text(json.dumps(doc))
        recorded = __import__("psutil").Process().create_time()
        move_btime(monkeypatch, by)
        assert not old_rule_same(os.getpid(), recorded)  # the rule before: "the owner is gone"
        said: list[str] = []
        assert simhosts.sweep_stale(states, said.append) == [dead]
        assert netns.link_exists(bridges[live]) and (states / f"{live}.json").exists()
        assert not netns.link_exists(bridges[dead]) and not (states / f"{dead}.json").exists()
        assert netns.guard_route_exists()  # the live run still holds it
    finally:
        for run in (live, dead):
            netns.remove(netns.LINK, bridges[run])
        netns.remove(netns.ROUTE, netns.GUARD_ROUTE)
    assert not netns.exists(netns.ROUTE, netns.GUARD_ROUTE)


def test_a_rehearsal_address_of_no_run_or_of_another_route_is_refused(monkeypatch, tmp_path):
    """The route guard's rules without a network (route lookups faked): an address outside
    198.18.0.0/15 passes; one of no run on this machine is refused when the route goes through a
    gateway (off the machine) or there is none, and let through on a directly connected network;
    one of a run must go through that run's bridge."""
    from pd_sessions.runtime import netns

    routes = {
        "198.18.77.1": {"dst": "198.18.77.1", "gateway": "192.0.2.1", "dev": "eth0"},
        "198.18.78.1": None,
        "198.18.79.1": {"dst": "198.18.79.1", "dev": "lab0"},
        "198.18.80.1": {"dst": "198.18.80.1", "dev": "eth0", "gateway": "192.0.2.1"},
        "198.18.80.2": {"dst": "198.18.80.2", "dev": "pdsc5c5c5br"},
    }
    monkeypatch.setattr(netns, "route_get", lambda a: routes[a])
    monkeypatch.setattr(netns, "ifindex", lambda dev: 7)
    monkeypatch.setattr(routeguard, "_seen", {})
    monkeypatch.setattr(routeguard, "_runs", {})
    routeguard.check("10.1.2.3")
    routeguard.check("127.0.0.1")
    routeguard.check("localhost")
    with pytest.raises(RouteError, match=r"198\.18\.77\.1: .*no simulated-hosts run .*gateway 192\.0\.2\.1"):
        routeguard.check("198.18.77.1", state_dir=tmp_path)
    with pytest.raises(RouteError, match=r"198\.18\.78\.1: .*no simulated-hosts run .*no route to it"):
        routeguard.check("198.18.78.1", state_dir=tmp_path)
    routeguard.check("198.18.79.1", state_dir=tmp_path)
    routeguard.register("198.18.80.0/24", "c5c5c5")
    said = r"bridge pdsc5c5c5br of simulated-hosts run c5c5c5 .*through eth0"
    with pytest.raises(RouteError, match=said) as e:
        routeguard.check("198.18.80.1", state_dir=tmp_path)
    assert (e.value.bridge, e.value.run_id) == ("pdsc5c5c5br", "c5c5c5")
    routeguard.check("198.18.80.2", state_dir=tmp_path)


# Counts every packet for 198.18.0.0/15 that leaves the root namespace through any interface but
# the loopback and the simulated hosts' own (``pds...``: the bridges; another run, the suite's
# fixture, may be up): the default route's eth0 among them.
NFT_TABLE = "pds_guard_test"
NFT_COUNTER = f"""table ip {NFT_TABLE} {{
  counter leaked {{ }}
  chain out {{
    type filter hook output priority 0; policy accept;
    ip daddr 198.18.0.0/15 oifname "lo" accept
    ip daddr 198.18.0.0/15 oifname "{core.PREFIX}*" accept
    ip daddr 198.18.0.0/15 counter name "leaked"
  }}
}}
"""


def _leaked() -> int:
    out = subprocess.run(
        ["nft", "-j", "list", "counter", "ip", NFT_TABLE, "leaked"],
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(out.stdout)
    return next(x["counter"]["packets"] for x in doc["nftables"] if "counter" in x)


def _guard_routes() -> str:
    return subprocess.run(
        ["ip", "route", "show", "198.18.0.0/15"], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_a_removed_bridge_fails_the_next_connection_at_once_and_nothing_leaves(tmp_path, monkeypatch):
    """A run of its own (its "Ray" a sleeper), its bridge deleted by hand: the next connection to
    its addresses (a request, a probe, the driver's join, a fresh process's request) fails at once
    naming the bridge and the run, and no packet for 198.18.0.0/15 leaves through another
    interface (an nftables counter in the root namespace's output chain stays 0, while it counts
    a datagram sent through another interface on purpose)."""
    simhosts_available()
    import socket
    import time

    from pd_sessions.runtime import http, netns, raylaunch

    def sleeper(self, timeout_s):
        argv = [sys.executable, "-c", "import time; time.sleep(600)"]
        self._spawn("ray-head", argv, dict(os.environ), self.results_dir / "sleeper.log")
        self.ray_address = f"{self.plan.bridge_address}:6379"

    monkeypatch.setattr(simhosts.SimulatedHosts, "start_ray", sleeper)
    raylaunch.import_ray()  # imported before the clock starts
    sim = simhosts.start(1, tmp_path / "r", say=print)
    dummy = f"i38t{sim.run_id}a"  # not pds...: the counter counts what leaves through it
    try:
        (h,) = sim.hosts
        assert _guard_routes() == "unreachable 198.18.0.0/15"
        subprocess.run(["nft", "-f", "-"], input=NFT_COUNTER, text=True, check=True)
        # The counter counts: a datagram through another interface (a veth pair of the root
        # namespace: it goes nowhere).
        subprocess.run(
            ["ip", "link", "add", dummy, "type", "veth", "peer", "name", f"{dummy[:-1]}b"], check=True
        )
        subprocess.run(["ip", "addr", "add", "198.19.254.1/24", "dev", dummy], check=True)
        for end in (dummy, f"{dummy[:-1]}b"):
            subprocess.run(["ip", "link", "set", end, "up"], check=True)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"x", ("198.19.254.9", 9))
        assert _leaked() == 1
        subprocess.run(["ip", "link", "del", dummy], check=True)
        reset = ["nft", "reset", "counter", "ip", NFT_TABLE, "leaked"]
        subprocess.run(reset, check=True, capture_output=True)
        # Through the bridge: checked and let through (nothing listens there: refused).
        url = f"http://{h.address}:9/health"
        with pytest.raises(HttpError, match="connection refused"):
            http.request(url, timeout=2)
        routeguard.check(sim.driver_address)

        subprocess.run(["ip", "link", "del", sim.plan.bridge], check=True)
        said = rf"the bridge {sim.plan.bridge} of simulated-hosts run {sim.run_id} is gone"
        took = {}
        for what, call in {
            "request": lambda: http.request(url, timeout=30),
            "probe of the head": simhosts._tcp_probe(sim.driver_address, 6379),
            "driver's join": lambda: raylaunch.RayHosts(sim.ray_address),
        }.items():
            t0 = time.monotonic()
            with pytest.raises(RouteError, match=said):
                call()
            took[what] = time.monotonic() - t0
        code = f"from pd_sessions.runtime import http; http.request({url!r}, timeout=30)"
        t0 = time.monotonic()
        fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
        took["a fresh process"] = time.monotonic() - t0
        assert fresh.returncode != 0 and "RouteError" in fresh.stderr
        assert f"bridge {sim.plan.bridge} of simulated-hosts run {sim.run_id} is gone" in fresh.stderr
        print(f"refused in: {', '.join(f'{k} {v:.3f} s' for k, v in took.items())}")
        assert max(took.values()) < 5.0, took
        # Past the guard, by hand: the kernel refuses it too, and no packet goes anywhere.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, pytest.raises(OSError):
            s.sendto(b"x", (h.address, 9))
        assert _leaked() == 0
    finally:
        subprocess.run(["ip", "link", "del", dummy], capture_output=True, check=False)
        subprocess.run(["nft", "delete", "table", "ip", NFT_TABLE], capture_output=True, check=False)
        sim.close()
    assert simhosts_leftovers(sim.run_id) == []
    if not netns._rehearsal_addresses():  # no other run is up: the route went with this one
        assert _guard_routes() == ""
