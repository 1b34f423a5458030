"""Every way of stopping a run across hosts (issue 26, item 3): the "Stopping a run" rows
(docs/explanation/running-clusters.md), and
the two that only a multi-host run has (a node's agent killed, the driver SIGKILLed), each through
nox as in test_stops.py, with the instances on the simulated hosts (``--ray``, the session's
simulated_hosts_2) and the router here. After each, nothing of the run is left on any host.

Also here, on the same hosts: the launcher's own contract driven in-process (the agent's process
group, the environment, the log streamed from a node that cannot see the results), and the
pd_cluster fixture started with --pd-ray.

The servers are the fake stack (pd_sessions/data/fake_stack): what is under test is the harness's own
handling across hosts. The instances run on the Ray nodes with the node's environment, so the fake
stack's path and behaviours reach them through the config's extra_env.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from helpers import ROOT
from helpers.fake_runs import FAKE, GRACE, NoxRun, fake_stack_env, fake_sweep_toml
from helpers.procs import gone
from helpers.waiting import wait_until, within

from pd_sessions.runtime.process import alive

pytestmark = pytest.mark.multihost


def hosts_sweep(behaviour: str = "never_healthy", configs=("1x1", "1x1b")) -> str:
    """Two configs of the fake stack whose instances find it on the Ray nodes (their decode
    ``behaviour``: never healthy by default, so the first config is still starting when stopped)."""
    extra = f'extra_env = {{PYTHONPATH = "{FAKE}{os.pathsep}{ROOT}", FAKE_DECODE_BEHAVIOR = "{behaviour}"}}'
    return fake_sweep_toml(extra=extra, configs=configs)


class HostsRun(NoxRun):
    """NoxRun of :func:`hosts_sweep` with ``--ray`` at the simulated hosts."""

    def __init__(
        self,
        tmp_path,
        sim,
        *,
        behaviour="never_healthy",
        grace=GRACE,
        configs=("1x1", "1x1b"),
        session="sweep",
        args=(),
    ):
        (tmp_path / "hosts.toml").write_text(hosts_sweep(behaviour, configs))
        self.sim = sim
        super().__init__(
            tmp_path,
            sweep=str(tmp_path / "hosts.toml"),
            args=("--ray", sim.ray_address, *args),
            grace=grace,
            session=session,
        )

    def servers(self) -> list[psutil.Process]:
        """Once both instances run on their hosts with their "engine core": those processes (they
        share this machine's process table) and their children."""
        self.wait_for("started 2 instances", timeout=180)
        text = (self.results / "1x1" / "plan.txt").read_text()
        urls = re.findall(r"^  (?:prefill|decode)-0: http://([\d.]+):(\d+) on ", text, re.M)

        def found() -> list[psutil.Process] | None:
            procs = []
            for p in psutil.process_iter(["cmdline"]):
                flags = dict(itertools.pairwise(p.info["cmdline"] or []))
                if (flags.get("--host"), flags.get("--port")) in urls:
                    with contextlib.suppress(psutil.Error):
                        procs += [p, *p.children(recursive=True)]
            cores = [p for p in procs if "time.sleep(3600)" in " ".join(p.cmdline())]
            return procs if len(cores) >= 2 else None

        return wait_until(found, 60, lambda: f"both instances and their engine cores on {urls}\n{self.text}")

    def local(self) -> list[psutil.Process]:
        """The harness and the router (this host)."""
        out = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "pd_sessions" in " ".join(p.cmdline()):
                    out.append(p)
        return out


ROWS = {
    "ctrl_c": lambda run: os.killpg(run.proc.pid, signal.SIGINT),
    "term_group": lambda run: os.killpg(run.proc.pid, signal.SIGTERM),
    "term_nox": lambda run: os.kill(run.proc.pid, signal.SIGTERM),
    "kill_nox": lambda run: os.kill(run.proc.pid, signal.SIGKILL),
    "hup_group": lambda run: os.killpg(run.proc.pid, signal.SIGHUP),
}


@pytest.mark.parametrize("how", list(ROWS))
def test_each_way_of_stopping_across_hosts_leaves_nothing_on_any_host(tmp_path, simulated_hosts_2, how):
    run = HostsRun(tmp_path, simulated_hosts_2)
    servers = run.servers()
    t0 = time.monotonic()
    ROWS[how](run)
    took = run.all_gone_within(servers + run.local(), t0, GRACE + 5)
    assert run.wait(30) != 0
    run.reader.join(5)
    assert "teardown done" in run.text, run.text
    doc = run.summary()
    assert [c["outcome"] for c in doc["configs"]] == ["cancelled", "not run"], doc
    print(f"{how} across hosts: everything gone {took:.2f} s after the stop")


def test_sigkill_to_the_parent_of_serve_across_hosts_leaves_nothing_on_any_host(tmp_path, simulated_hosts_2):
    """``nox -s serve -- ... --ray`` with nox SIGKILLed once the cluster serves: serve's parent
    watch gives it SIGTERM, and it tears down its instances on host1 and host2 and the router
    here; every PID is gone within grace + 5 s."""
    run = HostsRun(
        tmp_path, simulated_hosts_2, behaviour="ok", configs=("1x1",), session="serve", args=("--only", "1x1")
    )
    servers = run.servers()
    run.wait_for("serving until Ctrl-C", timeout=120)
    local = run.local()
    assert any("pd_sessions.runtime.reaper" in " ".join(p.cmdline()) for p in local), local  # the lifeline
    t0 = time.monotonic()
    os.kill(run.proc.pid, signal.SIGKILL)
    took = run.all_gone_within(servers + local, t0, GRACE + 5)
    run.reader.join(5)
    assert "stopped by SIGTERM: the parent process (pid" in run.text, run.text
    print(f"serve across hosts, nox SIGKILLed: everything gone {took:.2f} s after")


def test_buildkite_cancel_across_hosts_is_done_well_inside_its_10s(tmp_path, simulated_hosts_2):
    run = HostsRun(tmp_path, simulated_hosts_2, grace=10.0)
    servers = run.servers()
    t0 = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGTERM)
    took = run.all_gone_within(servers + run.local(), t0, 10.0)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.proc.pid, signal.SIGKILL)
    within(took, 5.0, "the teardown across hosts, of Buildkite's 10 s grace")
    assert run.wait(10) != 0
    print(f"buildkite cancel across hosts: everything gone {took:.2f} s after SIGTERM")


def test_the_driver_sigkilled_its_instances_go_with_its_ray_job(tmp_path, simulated_hosts_2):
    """pd-sessions (the Ray driver) SIGKILLed: its agents are not detached, so Ray ends them with
    its job, and their worker process groups with them (the instances); the router here is the
    reaper's."""
    from pd_sessions.runtime.raylaunch import ray_hosts

    run = HostsRun(tmp_path, simulated_hosts_2)
    servers = run.servers()
    remote = [p for p in servers if dict(itertools.pairwise(p.cmdline())).get("--host") != "127.0.0.1"]
    tmps = sorted({Path(p.environ()["TMPDIR"]) for p in remote})  # the instances' TMPDIRs on host1, host2
    assert len(tmps) == 2 and all(t.name.startswith("pds-tmp-") and t.is_dir() for t in tmps), tmps
    harness = next(p for p in run.local() if "pd_sessions sweep" in " ".join(p.cmdline()))
    t0 = time.monotonic()
    harness.kill()
    took = run.all_gone_within(servers + run.local(), t0, 30.0)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.proc.pid, signal.SIGKILL)
    print(f"driver SIGKILLed: everything gone on every host {took:.2f} s after")
    # Only the nodes' Ray jobs ended those processes: their folders stay until a later run's agent
    # on each node finds their owners gone (process.remove_orphan_tmp_dirs).
    assert [t for t in tmps if t.exists()] == tmps
    with ray_hosts(simulated_hosts_2.ray_address) as hosts:
        hosts.layout()  # a later run: its agents, one per node
    assert [t for t in tmps if t.exists()] == []


def test_a_nodes_agent_killed_fails_the_run_naming_the_instance_and_leaves_nothing(
    tmp_path, simulated_hosts_2
):
    """The Ray worker of host2's agent SIGKILLed: the decode (in that worker's process group) dies
    with it, the run fails at once naming decode-0, and the rest is torn down."""
    run = HostsRun(tmp_path, simulated_hosts_2, configs=("1x1",))
    servers = run.servers()
    host2 = simulated_hosts_2.hosts[1].address
    decode = next(p for p in servers if dict(itertools.pairwise(p.cmdline())).get("--host") == host2)
    worker = psutil.Process(decode.ppid())
    assert worker.pid != run.proc.pid and os.getpgid(decode.pid) == os.getpgid(worker.pid)
    tmp = Path(decode.environ()["TMPDIR"])  # its private TMPDIR on host2
    assert tmp.name.startswith("pds-tmp-decode-0-") and tmp.is_dir()
    t0 = time.monotonic()
    worker.kill()
    took = run.all_gone_within(servers + run.local(), t0, 60.0)
    assert run.wait(60) == 1, run.text
    run.reader.join(5)
    assert "decode-0 (http://" in run.text and "exited with status -9" in run.text, run.text
    assert not any(alive(p) for p in servers)
    assert not tmp.exists()  # removed by a fresh agent once it verified the decode gone
    print(f"agent killed: the run failed and everything was gone {took:.2f} s after")


USER_TEST = """
def test_across_hosts(pd_cluster):
    assert pd_cluster.prefill_urls[0].startswith("http://{host1}:")
    assert pd_cluster.decode_urls[0].startswith("http://{host2}:")
    out = pd_cluster.router.completions.create(model=pd_cluster.model, prompt="a b c", max_tokens=4)
    assert out.choices[0].text
"""


def test_the_pd_cluster_fixture_starts_its_cluster_across_hosts_with_pd_ray(tmp_path, simulated_hosts_2):
    sim = simulated_hosts_2
    (tmp_path / "hosts.toml").write_text(hosts_sweep("ok", ("1x1",)))
    user = tmp_path / "test_user.py"
    user.write_text(USER_TEST.format(host1=sim.hosts[0].address, host2=sim.hosts[1].address))
    env = {**fake_stack_env(), "PD_SESSIONS_CLUSTER": ""}
    argv = [sys.executable, "-m", "pytest", "-p", "pd_sessions.pytest_plugin", "-p", "no:cacheprovider", "-q"]
    argv += [str(user), "--pd-cluster", f"{tmp_path / 'hosts.toml'}:1x1", "--pd-platform", "cpu"]
    argv += ["--pd-results-dir", str(tmp_path / "r"), "--pd-ray", sim.ray_address]
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "1 passed" in r.stdout
    plan = (tmp_path / "r" / "hosts" / "1x1" / "plan.txt").read_text()
    assert " on host1 (" in plan and " on host2 (" in plan


SHOW = (
    "import json, os, subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "e = os.environ; print(json.dumps({'pgid': os.getpgid(0), 'ppid': os.getppid(), "
    "'ray': sorted(k for k in e if k.startswith('RAY_')), 'cuda': e.get('CUDA_VISIBLE_DEVICES'), "
    "'path': e['PYTHONPATH'], 'tmp': e.get('TMPDIR')}), flush=True); time.sleep(600)"
)


def test_the_launcher_spawns_in_the_agents_group_streams_the_log_and_verifies_gone(
    tmp_path, simulated_hosts_2
):
    """In this process as the driver: a spec for host2 runs there in its agent's worker group,
    without Ray's variables, with the spec's CUDA_VISIBLE_DEVICES and the shipped pd_sessions first
    on PYTHONPATH; a node that cannot see the results directory has its log streamed over; the stop
    leaves nothing (the child included) and each node verifies it."""
    import json

    from pd_sessions.core.errors import PlanError
    from pd_sessions.core.plan import ProcessSpec
    from pd_sessions.runtime.raylaunch import SHARED_MARKER, ray_hosts

    with ray_hosts(simulated_hosts_2.ray_address) as hosts:
        layout = hosts.layout()
        with pytest.raises(PlanError) as e:  # a local model path is checked on each host
            hosts.with_models(layout, [], None, [str(tmp_path / "no-model")])
        assert e.value.field == "model"
        assert re.search(r"no-model does not exist on host[12] \(198\.", str(e.value)), e.value
        launcher = hosts.launcher(tmp_path, hosts.port_sources())
        (tmp_path / SHARED_MARKER).write_text("another run's")  # as if host2 saw another directory
        spec = ProcessSpec(
            name="decode-0", role="decode", argv=(sys.executable, "-c", SHOW),
            env=(("CUDA_VISIBLE_DEVICES", "7"),), host=simulated_hosts_2.hosts[1].address, port=1,
            log_name="decode-0.log", node="host2",
        )  # fmt: skip
        before = set(Path(tempfile.gettempdir()).glob("pd-sessions-*/decode-0.log"))
        r = launcher.spawn(spec, tmp_path, {})
        line = wait_until(
            lambda: next((x for x in r.log_path.read_text().splitlines() if x.startswith("{")), None),
            60,
            "the log streamed over from host2",
        )
        seen = json.loads(line)
        worker = psutil.Process(seen["ppid"])
        assert seen["pgid"] == os.getpgid(worker.pid) and "ray::NodeAgent" in " ".join(worker.cmdline())
        assert seen["ray"] == [] and seen["cuda"] == "7"
        first = Path(seen["path"].split(os.pathsep)[0], "pd_sessions", "runtime", "raylaunch.py")
        assert first.read_text() == (ROOT / "pd_sessions" / "runtime" / "raylaunch.py").read_text()
        family = [r.pid] + [c.pid for c in psutil.Process(r.pid).children(recursive=True)]
        assert r.poll() is None and len(family) == 2
        tmp = Path(seen["tmp"])  # its private TMPDIR on host2 (process.spawn's private_tmp)
        assert tmp.name.startswith("pds-tmp-decode-0-") and tmp.is_dir()
        node_logs = sorted(set(Path(tempfile.gettempdir()).glob("pd-sessions-*/decode-0.log")) - before)
        assert len(node_logs) == 1, node_logs  # host2's own copy of the log, streamed from there
        rep = launcher.stop([r], grace_s=2.0)
        assert sorted(rep.pids) == sorted(family) and launcher.verify() == []
        assert all(gone(pid) for pid in family)
        assert not tmp.exists() and not node_logs[0].parent.exists()  # both gone with it
