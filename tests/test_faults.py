"""Fault matrix: each way a P/D run breaks is detected fast, reported clearly, and leaves
nothing behind. These drive the real CLI; vLLM and the router are replaced by a throwaway
OpenAI-compatible server (pd_sessions/data/fake_stack) because what is under test is the
harness's own handling (the real-vLLM scenarios are in test_e2e_cpu_lane.py).

Every test checks: exit status, the message (role, URL, cause, log tail), and that afterwards
no process of the run is alive and every port of its plan is free; a bystander with "vllm" in
its command line survives all of them.
"""

from __future__ import annotations

import os
import re
import signal
import socket

import psutil
import pytest
from helpers.fake_runs import FakeSweep, assert_nothing_left, every_plan_port
from helpers.waiting import wait_until, within

pytestmark = pytest.mark.procs


def test_all_ok_passes(tmp_path, bystander):
    r = FakeSweep(tmp_path)
    assert r.wait() == 0, r.text
    assert "1/1 configs passed" in r.text
    assert_nothing_left(r.run_dir)


def test_instance_exits_during_startup(tmp_path, bystander):
    r = FakeSweep(tmp_path, env={"FAKE_DECODE_BEHAVIOR": "exit:1.0:3"})
    assert r.wait() == 1, r.text
    died = float(re.search(r"exiting with 3 as told at ([0-9.]+)", r.text).group(1))
    failed = r.first("FAILED: decode-0")
    assert failed >= died
    within(failed - died, 10.0, "the failure after decode-0 exited (the deadline: 1200 s)")
    line = next(line for _, line in r.lines if "FAILED: decode-0" in line)
    assert "http://127.0.0.1:" in line and "status 3" in line and "while the cluster was starting" in line
    assert "exiting with 3 as told" in r.text  # the log tail
    assert_nothing_left(r.run_dir)


def test_never_healthy_fails_at_the_deadline_not_later(tmp_path, bystander):
    r = FakeSweep(tmp_path, env={"FAKE_PREFILL_BEHAVIOR": "never_healthy"}, args=("--deadline", "4"))
    assert r.wait() == 1, r.text
    failed = r.first("FAILED: prefill-0")
    assert failed - r.t0 >= 4.0, f"{failed - r.t0:.1f} s"
    within(failed - r.t0 - 4.0, 20.0, "the failure past the 4 s deadline, from the command's start")
    assert "was not ready after" in r.text and "HTTP 503" in r.text
    assert_nothing_left(r.run_dir)


@pytest.mark.parametrize(
    "behavior,needle",
    [
        ("exit:0.5:2", "router (http://127.0.0.1:"),
        ("never_healthy", "router (http://127.0.0.1:"),
    ],
)
def test_router_dies_or_never_ready(tmp_path, bystander, behavior, needle):
    r = FakeSweep(tmp_path, env={"FAKE_ROUTER_BEHAVIOR": behavior}, args=("--deadline", "8"))
    assert r.wait() == 1, r.text
    line = next(line for _, line in r.lines if "FAILED: router" in line)
    assert needle in line
    if behavior.startswith("exit"):
        # the router starts with the instances, so its death is seen while they start
        died = float(re.search(r"exiting with 2 as told at ([0-9.]+)", r.text).group(1))
        assert "status 2" in line and r.first("FAILED: router") >= died
        within(r.first("FAILED: router") - died, 10.0, "the failure after the router exited (deadline 8 s)")
    else:
        assert "was not ready after" in line
        within(r.first("FAILED: router") - r.t0 - 8, 20.0, "the failure past the 8 s deadline")
    assert_nothing_left(r.run_dir)


def test_decode_dies_while_checks_run(tmp_path, bystander):
    # dies right after answering its first completion (the router readiness probe)
    r = FakeSweep(tmp_path, env={"FAKE_DECODE_BEHAVIOR": "die_after_ready:0"})
    assert r.wait() == 1, r.text
    assert "FAILED: decode-0" in r.text and "status 7" in r.text
    assert_nothing_left(r.run_dir)


def test_explicit_port_taken_is_refused_before_launch(tmp_path, bystander):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    try:
        r = FakeSweep(tmp_path, extra=f"router_port = {port}")
        assert r.wait() == 1, r.text
        assert f"port {port} on 127.0.0.1 is already in use (by pid {os.getpid()}" in r.text
        assert "started" not in r.text  # nothing launched
    finally:
        srv.close()


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_the_session_tears_everything_down(tmp_path, bystander, sig, status):
    r = FakeSweep(tmp_path, env={"FAKE_DECODE_BEHAVIOR": "never_healthy"}, args=("--deadline", "60"))
    r.wait_for("started 2 instances")
    procs = wait_until(
        lambda: ps if len(ps := psutil.Process(r.proc.pid).children(recursive=True)) >= 4 else None,
        30,
        lambda: (
            'each fake instance\'s "engine core" (4 processes under the harness; have '
            f"{psutil.Process(r.proc.pid).children(recursive=True)})"
        ),
    )
    grandchildren = [
        p
        for p in psutil.process_iter()
        if p.pid not in {c.pid for c in procs} and _in_sessions(p, {c.pid for c in procs})
    ]
    assert len(procs) >= 2
    r.proc.send_signal(sig)
    assert r.wait(30) == status, r.text
    assert "teardown done" in r.text
    for p in procs + grandchildren:
        assert not (p.is_running() and p.status() != psutil.STATUS_ZOMBIE), p
    assert_nothing_left(r.run_dir)


def _in_sessions(p: psutil.Process, sids: set[int]) -> bool:
    try:
        return os.getsid(p.pid) in sids
    except OSError:
        return False


def test_stubborn_child_is_killed_after_grace(tmp_path, bystander):
    r = FakeSweep(
        tmp_path,
        env={"FAKE_DECODE_BEHAVIOR": "ignore_term", "FAKE_PREFILL_BEHAVIOR": "never_healthy"},
        args=("--deadline", "3"),
    )
    assert r.wait(60) == 1, r.text
    assert "SIGKILL after 2 s grace: decode-0" in r.text or "needed SIGKILL: decode-0" in r.text
    assert_nothing_left(r.run_dir)


def test_two_sweeps_at_once_share_no_port(tmp_path, bystander):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    ra, rb = FakeSweep(a), FakeSweep(b)
    assert ra.wait() == 0 and rb.wait() == 0, ra.text + rb.text
    pa, pb = set(every_plan_port(ra.run_dir)), set(every_plan_port(rb.run_dir))
    assert pa and pb and not pa & pb
    assert_nothing_left(ra.run_dir)
    assert_nothing_left(rb.run_dir)


# ---------------------------------------------------------------- edge checks can fail (issue 17)


def _result(r: FakeSweep) -> dict:
    import json

    return json.loads((r.run_dir / "result.json").read_text())


def _check(r: FakeSweep, name: str) -> dict:
    return next(c for c in _result(r)["checks"] if c["name"] == name)


def test_too_long_fails_when_the_router_never_answers(tmp_path, bystander):
    # the prefill rejects the prompt (HTTP 400); this router then waits forever instead of
    # passing the error on
    r = FakeSweep(
        tmp_path,
        env={"FAKE_ROUTER_BEHAVIOR": "hang_too_long"},
        top='checks = ["smoke", "too_long"]\n[check_options.too_long]\nbound_s = 2',
    )
    assert r.wait() == 1, r.text
    c = _check(r, "too_long")
    assert c["verdict"] == "fail" and "got no answer within 2 s" in c["message"], c
    assert c["details"]["status"] is None
    within(c["seconds"], 20.0, "too_long with its 2 s bound (the router: for ever)")
    assert "too_long FAIL" in r.text
    assert_nothing_left(r.run_dir)


def test_abort_frees_kv_fails_when_a_server_keeps_a_request_running(tmp_path, bystander):
    r = FakeSweep(
        tmp_path,
        env={"FAKE_PREFILL_BEHAVIOR": "keep_running"},
        top='checks = ["smoke", "abort_frees_kv"]\n[check_options.abort_frees_kv]\nbound_s = 2',
    )
    assert r.wait() == 1, r.text
    c = _check(r, "abort_frees_kv")
    assert c["verdict"] == "fail", c
    assert "2 s after 4 clients disconnected: prefill-0: 1 requests still running" in c["message"]
    assert c["details"]["held"]["decode-0"] is None and c["details"]["waited_s"] >= 2
    within(c["details"]["waited_s"] - 2, 3.0, "abort_frees_kv's wait past its 2 s bound")
    assert_nothing_left(r.run_dir)


def test_burst_fails_when_the_decode_recomputes(tmp_path, bystander):
    r = FakeSweep(
        tmp_path,
        env={"FAKE_DECODE_BEHAVIOR": "recompute"},
        top='checks = ["burst"]\n[check_options.burst]\nrequests = 6',
    )
    assert r.wait() == 1, r.text
    c = _check(r, "burst")
    assert c["verdict"] == "fail" and "KV proof: decode instances received 0 prompt tokens" in c["message"]
    assert c["details"]["failed"] == [] and c["details"]["kv"]["router_requests"] == 6
    assert [x["name"] for x in _result(r)["checks"]] == ["burst"]
    assert_nothing_left(r.run_dir)


def test_pd_path_budget_bounds_how_long_a_failing_pd_path_may_keep_failing(tmp_path):
    """`--pd-path-budget 3`: every instance healthy, every P/D request answered 500 by the decode:
    the config fails once the path has failed for 3 s (not the default 60), naming the pair, the
    bound and the option; nothing is left."""
    r = FakeSweep(tmp_path, env={"FAKE_DECODE_BEHAVIOR": "fail_kv"}, args=("--pd-path-budget", "3"))
    assert r.wait(60) == 1, r.text
    ready = r.first("decode-0 ready after")
    failed = r.first("FAILED")
    within(failed - ready, 30.0, "the failure after ready with a 3 s P/D budget (the default: 60 s)")
    assert "pair prefill-0 -> decode-0: the P/D path kept failing for 3 s" in r.text
    assert "--pd-path-budget SECONDS sets how long it may" in r.text
    assert_nothing_left(r.run_dir)


def test_pd_path_budget_must_be_a_positive_number_of_seconds(tmp_path):
    r = FakeSweep(tmp_path, args=("--pd-path-budget", "0"))
    assert r.wait(30) == 2, r.text
    assert "--pd-path-budget: got 0; give a number of seconds above 0" in r.text
