"""Configs side by side (run/packed.py), through the real CLI on the fake stack and a fake 8-GPU
host (a fake ``nvidia-smi`` on PATH): the waves run at once on disjoint GPUs, the next config
starts while the last one's API servers still exit (teardown overlapped), one summary in the
sweep's order; a stop cancels every running config, marks the rest ``not run`` and leaves nothing
(every PID of the run checked)."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time

import psutil
import pytest
from helpers.cli_runs import Cli
from helpers.fake_runs import assert_nothing_left, fake_stack_env
from helpers.waiting import wait_until, within

from pd_sessions.runtime import cancel
from pd_sessions.runtime.process import alive, session_family

SMI = """#!/bin/sh
for i in 0 1 2 3 4 5 6 7; do
  case "$1" in *uuid*) echo "$i, GPU-$i, Fake GPU";; *) echo $i;; esac
done
"""


def sweep_toml(tmp_path, configs: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    toml = tmp_path / "sweep.toml"
    head = 'name = "packed"\nchecks = ["smoke"]\n[defaults]\nmodel = "fake-model"\nconnector = "mooncake"\n'
    toml.write_text(head + 'mooncake_protocol = "tcp"\n' + textwrap.dedent(configs))
    return toml


def packed_sweep(tmp_path, configs: str, *args: str, env: dict[str, str] | None = None) -> Cli:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "nvidia-smi").write_text(SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    run = Cli(
        "sweep",
        str(sweep_toml(tmp_path, configs)),
        "--platform",
        "cuda",
        "--results-dir",
        str(tmp_path / "results"),
        "--grace",
        "3",
        *args,
        env=fake_stack_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **(env or {})),
    )
    run.results = tmp_path / "results"
    return run


FOUR = """
[[config]]
name = "a"
[[config]]
name = "big"
prefill_tp = 2
decode_tp = 4
[[config]]
name = "b"
[[config]]
name = "c"
"""


@pytest.mark.procs
@pytest.mark.usefixtures("bystander")
def test_waves_run_at_once_the_next_starts_during_the_teardown_one_summary_in_order(tmp_path):
    run = packed_sweep(tmp_path, FOUR, env={"FAKE_STARTUP_S": "0.5", "FAKE_EXIT_S": "1.5"})
    assert run.wait(60) == 0, run.text
    assert "packing: 4 config(s) in 2 wave(s), as many as fit at once" in run.text
    assert "wave 1: a (2 GPUs: 0,1), big (6 GPUs: 2,3,4,5,6,7)" in run.text
    assert "wave 2: b (2 GPUs: 0,1), c (2 GPUs: 2,3)" in run.text
    # a wave runs at once: big starts before a has ended
    assert run.first("[2/4] big: ") < run.first("[1/4] a: PASSED")
    # b takes a's GPUs once a's engine cores are gone, while a's API servers still exit (1.5 s)
    assert run.first("[3/4] b: ") < run.first("[1/4] a: PASSED") - 0.5, run.text
    # c needs GPUs 2,3, which big holds: it waits for big's engine cores, not for b
    assert run.first("[4/4] c: ") > run.first("big | big: cluster ready")
    assert "a | a: cluster ready" in run.text and "big | prefill-0 ready" in run.text  # prefixed
    doc = json.loads((run.results / "summary.json").read_text())
    assert [c["name"] for c in doc["configs"]] == ["a", "big", "b", "c"]
    assert all(c["outcome"] == "passed" for c in doc["configs"])
    big = (run.results / "big" / "plan.txt").read_text()  # each plan on its own share
    assert "(GPUs 2,3, " in big and "(GPUs 4,5,6,7, " in big
    assert "(GPUs 0, " in (run.results / "b" / "plan.txt").read_text()
    for name in ("a", "big", "b", "c"):
        assert_nothing_left(run.results / name)


STOPPED = """
[[config]]
name = "a"
[[config]]
name = "b"
[[config]]
name = "all"
prefill_tp = 4
decode_tp = 4
"""


@pytest.mark.procs
@pytest.mark.parametrize(
    "sig,status,cause",
    [(signal.SIGTERM, 143, "stopped by SIGTERM"), (signal.SIGINT, 130, "stopped by SIGINT")],
    ids=["SIGTERM", "SIGINT"],
)
@pytest.mark.usefixtures("bystander")
def test_a_stop_cancels_every_running_config_marks_the_rest_not_run_and_leaves_nothing(
    tmp_path, sig, status, cause
):
    run = packed_sweep(tmp_path, STOPPED, "--deadline", "60", env={"FAKE_DECODE_BEHAVIOR": "never_healthy"})
    run.wait_for("a | a: started 2 instances", 30)
    run.wait_for("b | b: started 2 instances", 30)
    harness = psutil.Process(run.proc.pid)
    # two configs of two instances and a router, each with its "engine core" child, and the reaper
    wait_until(lambda: len(session_family(harness)) >= 1 + 2 * 3 * 2 + 1, 10, "every process started")
    procs = [p for p in session_family(harness) if p.pid != harness.pid]
    run.proc.send_signal(sig)
    assert run.wait(20) == status, run.text
    assert [p for p in procs if alive(p)] == []  # every PID we saw, gone when the harness exits
    doc = json.loads((run.results / "summary.json").read_text())
    assert "provisional" not in doc
    a, b, rest = doc["configs"]
    for c in (a, b):
        assert c["outcome"] == "cancelled" and cause in c["error"], c
        assert "while the cluster was starting" in c["error"]
        assert json.loads((run.results / c["name"] / "result.json").read_text())["outcome"] == "cancelled"
    assert rest["name"] == "all" and rest["outcome"] == "not run" and cause in rest["error"]
    assert f"{cause}: cancelling 2 running config(s)" in run.text
    for name in ("a", "b"):
        assert_nothing_left(run.results / name)


@pytest.mark.procs
def test_dry_run_shows_the_waves_and_max_parallel_across_hosts_is_refused_before_anything_starts(tmp_path):
    run = packed_sweep(tmp_path, FOUR, "--max-parallel", "3", "--dry-run")
    assert run.wait(30) == 0, run.text
    assert "packing: 4 config(s) in 2 wave(s), at most 3 at once" in run.text
    assert "wave 2: b (2 GPUs: 0,1), c (2 GPUs: 2,3)" in run.text
    assert "(GPUs 2,3, " in run.text  # big's plan, on its own share
    refused = packed_sweep(tmp_path / "x", FOUR, "--max-parallel", "2", "--simulate-hosts", "2", "--dry-run")
    assert refused.wait(30) == 2, refused.text
    assert "--max-parallel 2: across hosts" in refused.text


def test_a_cancel_is_raised_in_the_cancelled_thread_only_at_its_next_check():
    seen: dict[str, str] = {}
    go = threading.Event()

    def worker(name: str) -> None:
        go.wait(5)
        try:
            cancel.check()
            seen[name] = "not cancelled"
        except cancel.Cancelled as e:
            seen[name] = str(e)

    threads = {n: threading.Thread(target=worker, args=(n,)) for n in ("x", "y")}
    for t in threads.values():
        t.start()
    cancel.cancel([threads["x"]], "stopped by SIGTERM")
    cancel.check()  # this thread was not cancelled
    go.set()
    for t in threads.values():
        t.join(5)
        cancel.forget(t)
    assert seen == {"x": "stopped by SIGTERM", "y": "not cancelled"}
    t0 = time.monotonic()
    cancel.check()
    within(time.monotonic() - t0, 2.0, "a check once forgotten (it waits for nothing)")
