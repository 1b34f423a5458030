"""A planned death and a restart in place (runtime/cluster.py: kill_instance, restart_instance),
on the fake stack (throwaway servers shaped like the cluster; what is under test is the
harness's process handling, not vLLM): the guard does not take the planned death for a failure,
watches the new process from its spawn on, still fails at once on a death nobody planned; the
reaper hears of the old process gone and of the new one; nothing is left afterwards."""

from __future__ import annotations

import os
import signal
import time

import pytest
from helpers.builders import live_plan
from helpers.fake_runs import fake_stack_env
from helpers.procs import gone

from pd_sessions.core.errors import ProcessExited, StopError
from pd_sessions.runtime import http, process
from pd_sessions.runtime.cluster import running_cluster

pytestmark = pytest.mark.procs


class Told(process.Observer):
    """What the reaper is told (its observer interface), recorded."""

    def __init__(self):
        self.started, self.gone = [], []

    def spawned(self, r):
        self.started.append((r.name, r.pid))

    def stopped(self, rs):
        self.gone += [(r.name, r.pid) for r in rs]


def test_a_planned_kill_and_restart_in_place_are_no_failure_and_the_reaper_knows(tmp_path):
    plan = live_plan(connector="mooncake")
    told = Told()
    with (
        process.observed(told),
        running_cluster(plan, tmp_path / "run", base_env=fake_stack_env(), grace_s=2) as cluster,
    ):
        old = cluster.instance("prefill-0")

        def scenario():
            cluster.kill_instance("prefill-0")
            assert gone(old.pid) and list(cluster.down) == ["prefill-0"]
            assert [r.name for r in cluster.instances] == ["decode-0"]
            time.sleep(0.5)  # the guard ticks (every 50 ms) while it is dead
            return cluster.restart_instance("prefill-0", deadline_s=30)

        new = cluster.guard(scenario, when="while a fault scenario ran")
        assert new.pid != old.pid and not cluster.down
        assert [r.name for r in cluster.instances] == ["prefill-0", "decode-0"]
        status, _ = http.request(plan.prefill[0].health_url)  # the same port, served again
        assert status == 200
        assert ("prefill-0", new.pid) in told.started and ("prefill-0", old.pid) in told.gone
        # the new process is watched: its death, not planned, fails the guard at once
        with pytest.raises(ProcessExited, match=r"prefill-0 .* exited with status -9 \(SIGKILL\)"):
            cluster.guard(lambda: (os.killpg(new.pid, signal.SIGKILL), time.sleep(10)))
    assert gone(new.pid) and gone(old.pid)
    assert all(gone(pid) for _, pid in told.started)


def test_a_restart_needs_an_instance_stopped_on_purpose(tmp_path):
    plan = live_plan(connector="mooncake")
    with running_cluster(plan, tmp_path / "run", base_env=fake_stack_env(), grace_s=2) as cluster:
        with pytest.raises(KeyError, match="prefill-0 was not stopped on purpose"):
            cluster.restart_instance("prefill-0", deadline_s=5)
        with pytest.raises(KeyError, match="no running instance 'prefill-9'"):
            cluster.kill_instance("prefill-9")


def test_no_restart_while_a_killed_process_is_still_alive(tmp_path, monkeypatch):
    """A SIGKILLed process that outlived kill_instance's wait (a NIXL worker did, for minutes)
    still holds the ports: restart_instance starts nothing and says so."""
    plan = live_plan(connector="mooncake")
    with running_cluster(plan, tmp_path / "run", base_env=fake_stack_env(), grace_s=2) as cluster:
        cluster.kill_instance("prefill-0")
        monkeypatch.setattr(process, "still_running", lambda rs: [f"{rs[0].name} pid 4242"])
        with pytest.raises(StopError, match=r"prefill-0 not started again: .*\(prefill-0 pid 4242\)"):
            cluster.restart_instance("prefill-0", deadline_s=5)
        assert list(cluster.down) == ["prefill-0"] and [r.name for r in cluster.instances] == ["decode-0"]
