"""A Buildkite-style cancel of a real CPU-lane sweep, through the project's noxfile (its ``sweep``
session on this interpreter, as found: ``--no-venv``, ``--no-install``; the environment check and
the import canary run for real): SIGTERM to the group while the checks run, SIGKILL 10 s later. The
real cluster (vLLM API servers, their engine cores, vllm-router) must be gone, and the results
written, well inside those 10 s.

This one real cluster also stands for "SIGTERM to a running sweep stops vLLM and its engine
cores": the harness gets the SIGTERM either way (here as a member of nox's group); the exit
status of the CLI signalled alone (143) and every other way of stopping are proven on the fake
stack (test_faults.py, test_stops.py), where timing, not vLLM, is under test.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import psutil
import pytest
from conftest import heavy, plan_ports, processes_using
from helpers import NoxRun, process_on_port

from pd_sessions.runtime.process import alive
from pd_sessions.runtime.process import session_family as family

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
BUILDKITE_GRACE_S = 10.0


def test_buildkite_cancel_of_a_real_cluster_is_done_well_inside_10s(tmp_path):
    heavy("vllm")
    heavy("mooncake.engine")
    run = NoxRun(
        tmp_path, sweep="mooncake_sweep", args=("--only", "1x1"), grace=BUILDKITE_GRACE_S, fake=False
    )
    run.wait_for("cluster ready after", timeout=600)
    procs = family(psutil.Process(run.proc.pid))
    assert len(procs) >= 7, procs  # nox, harness, reaper, 2 API servers + engine cores, router
    ports = plan_ports(run.results / "1x1")
    servers = []  # each server's leader and its children (the API servers' engine cores)
    for name in ("prefill-0", "decode-0", "router"):
        leader = process_on_port(ports[name])
        assert leader, f"nothing listens on port {ports[name]}"
        servers += [leader, *leader.children(recursive=True)]
    assert len(servers) > 3 and {p.pid for p in servers} <= {p.pid for p in procs}, (servers, procs)
    t0 = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGTERM)
    took = run.all_gone_within(procs, t0, BUILDKITE_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.proc.pid, signal.SIGKILL)  # the agent's SIGKILL: nothing alive is left for it
    assert run.wait(10) != 0
    run.reader.join(5)
    assert re.search(r"stopped by SIGTERM[^\n]*: teardown done", run.text), run.text
    doc = run.summary()
    (res,) = doc["configs"]
    assert res["outcome"] == "cancelled" and "stopped by SIGTERM" in res["error"], res
    assert (run.results / "junit.xml").exists() and (run.results / "summary.txt").exists()
    run_dir = run.results / "1x1"
    assert processes_using(plan_ports(run_dir)) == []
    assert not any(alive(p) for p in procs)
    assert [p.pid for p in servers if alive(p)] == []
    teardown = res["phases"].get("teardown")
    print(
        f"\nreal 1x1 cluster, Buildkite-style cancel: every process gone and results written "
        f"{took:.2f} s after SIGTERM (harness teardown phase {teardown} s); Buildkite's grace: 10 s"
    )
    assert took < BUILDKITE_GRACE_S / 2, f"{took:.2f} s is not well inside Buildkite's 10 s grace"
