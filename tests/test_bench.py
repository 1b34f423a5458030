"""The benchmark's own logic: arithmetic, summaries, files, the prober, the teardown
measurement, the router bench and the cluster drivers. The cluster drivers run against
the throwaway OpenAI-compatible stack (pd_sessions/data/fake_stack): what is tested is
the plumbing and the bookkeeping, not any speed (speed is what `nox -s bench` reports).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest
from helpers import ROOT
from helpers.builders import bench_doc
from helpers.fake_runs import fake_stack_env, fake_sweep_toml
from helpers.needs import needs
from helpers.waiting import wait_until, within

from pd_sessions.bench import bench_results, teardown
from pd_sessions.bench.clusters import UPSTREAM_PROXY_SLEEP_S, RunRecord
from pd_sessions.bench.prober import HealthProber
from pd_sessions.bench.stats import Goal, overhead, percentile, summary


def test_summary_median_and_spread():
    s = summary([3.0, 1.0, 2.0, 10.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (4, 2.5, 1.0, 10.0)
    assert s["values"] == [3.0, 1.0, 2.0, 10.0]
    assert summary([])["median"] is None


def test_percentile_interpolates():
    vals = list(range(1, 101))  # 1..100
    assert percentile(vals, 50) == pytest.approx(50.5)
    assert percentile(vals, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_overhead_is_wall_minus_slowest_startup_minus_checks():
    o = overhead(100.0, {"prefill-0": 80.0, "decode-0": 90.0}, checks_s=5.0)
    assert o["slowest_startup_s"] == 90.0
    assert o["overhead_s"] == pytest.approx(5.0)
    assert o["overhead_fraction"] == pytest.approx(0.05)
    with pytest.raises(ValueError):
        overhead(1.0, {}, 0.0)


def test_overhead_parts_add_up():
    o = overhead(
        100.0,
        {"prefill-0": 80.0, "decode-0": 90.0},
        checks_s=5.0,
        phases={"prepare": 0.5, "instances": 90.25, "router": 1.5, "checks": 5.0, "teardown": 2.0},
    )
    assert o["noticing_s"] == pytest.approx(0.25)
    assert (o["prepare_s"], o["router_s"], o["teardown_s"]) == (0.5, 1.5, 2.0)
    assert o["other_s"] == pytest.approx(5.0 - 0.5 - 0.25 - 1.5 - 2.0)


def test_goal_verdicts():
    assert Goal("g", 0.02, "fraction", 0.019, "").met is True
    assert Goal("g", 0.02, "fraction", 0.021, "").met is False
    assert Goal("g", 0.02, "fraction", None, "").met is None


def _run(driver, wall, instances, own, checks=1.0, ok=True, repeat=0, teardown_s=2.0):
    r = RunRecord(
        driver,
        "1x1",
        repeat,
        ok=ok,
        wall_s=wall,
        phases={
            "prepare": 0.1,
            "instances": instances,
            "router": 1.0,
            "checks": checks,
            "teardown": teardown_s,
        },
        own_startup_s={"prefill-0": own - 1, "decode-0": own} if driver != "single" else {"prefill-0": own},
        noticed_s={"prefill-0": 0.05, "decode-0": 0.07} if driver != "single" else {},
    )
    return r.to_dict()


def test_summarize_clusters_ratios_and_failed_runs_left_out():
    runs = [_run("pd_sessions", 100.0, 90.0, 89.0, repeat=i) for i in range(3)]
    runs += [_run("upstream", 110.0, 91.0, 89.0, repeat=i) for i in range(3)]
    runs += [_run("single", 61.0, 60.0, 59.9, repeat=i) for i in range(3)]
    runs.append(_run("pd_sessions", 999.0, 999.0, 1.0, ok=False, repeat=3))
    c = bench_results.summarize_clusters(runs)["1x1"]
    assert c["pd_sessions"]["runs"] == 4 and c["pd_sessions"]["ok"] == 3
    assert c["pd_sessions"]["wall_s"]["median"] == 100.0
    assert c["pd_sessions"]["overhead_s"]["median"] == pytest.approx(10.0)  # 100 - 89 - 1
    assert c["pd_sessions"]["overhead_fraction"]["median"] == pytest.approx(0.1)
    assert c["parallel_start"]["ratio"] == pytest.approx(1.5)
    assert c["upstream_vs_pd_sessions"]["ratio"] == pytest.approx(1.1)
    assert c["upstream_vs_pd_sessions"]["overhead_ratio"] == pytest.approx(2.0)  # (110-89-1)/10
    assert c["upstream_vs_pd_sessions"]["saved_s"] == pytest.approx(10.0)
    assert c["pd_sessions"]["noticed_s"]["median"] == pytest.approx(0.06)
    # own code = prepare 0.1 + noticing (90 - 89) + other (10 - 0.1 - 1 - 1 router - 2 teardown)
    assert c["pd_sessions"]["own_code_s"]["median"] == pytest.approx(7.0)


def test_goals_markdown_and_chart(tmp_path):
    runs = [
        _run(d, 100.0, 90.0, 89.0, repeat=i) for d in ("pd_sessions", "upstream", "single") for i in range(3)
    ]
    runs.append(_run("upstream", 5.0, 1.0, 1.0, ok=False, repeat=9))
    doc = bench_doc(
        runs,
        teardown={
            "grace_s": 5.0,
            "what": "trees",
            "healthy": summary([0.1]),
            "ignores_sigterm": summary([5.1, 5.2, 8.0]),
        },
    )
    doc["goals"] = [g.to_dict() for g in bench_results.goals(doc)]
    by_name = {g["name"]: g for g in doc["goals"]}
    assert by_name["1x1: harness overhead"]["met"] is False  # 10 %
    assert by_name["1x1: readiness noticed after /health 200"]["met"] is True
    assert by_name["1x1: teardown, healthy cluster"]["met"] is True  # 2 s
    assert by_name["teardown, a child ignores SIGTERM"]["limit"] == 7.0
    assert by_name["teardown, a child ignores SIGTERM"]["met"] is True  # median 5.2
    paths = bench_results.write(doc, tmp_path)
    md = paths["markdown"].read_text()
    assert "| 1x1: harness overhead | <= 2 % | 10.00 % | no |" in md
    assert "upstream 1x1 #9" in md  # failed runs are listed, not hidden
    assert json.loads(paths["json"].read_text())["goals"] == doc["goals"]
    assert paths["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _health_server(turn_at: float) -> ThreadingHTTPServer:
    """/health answers 503 until ``turn_at`` (time.monotonic()), then 200."""

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if time.monotonic() >= turn_at else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.mark.procs
def test_prober_records_when_health_turned_200():
    turn_at = time.monotonic() + 0.5
    srv = _health_server(turn_at)
    try:
        with HealthProber(interval=0.01) as prober:
            prober.watch("x", f"http://127.0.0.1:{srv.server_address[1]}/health")
            wait_until(
                lambda: "x" in prober.first_ok, 10, "the prober to see x's /health turn 200", tick=0.01
            )
        assert prober.first_ok["x"] >= turn_at  # never before it really answered 200
    finally:
        srv.shutdown()


@pytest.mark.procs
def test_a_driver_that_saw_ready_first_waits_for_the_prober_before_stopping():
    """The single driver stops its server right after its own probe saw it ready; a prober
    between two probes (1 s apart here) has not seen the 200 yet, and must before the stop."""
    healthy, probed = threading.Event(), threading.Event()

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if healthy.is_set() else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            probed.set()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with HealthProber(interval=1.0) as prober:
            prober.watch("x", f"http://127.0.0.1:{srv.server_address[1]}/health")
            assert probed.wait(10)  # its first probe got 503; the next one is a second away
            healthy.set()
            assert "x" not in prober.first_ok
            prober.wait_seen(["x"])
            assert "x" in prober.first_ok
    finally:
        srv.shutdown()


@pytest.mark.procs
def test_teardown_measure_waits_out_the_grace_only_for_a_stubborn_child(tmp_path):
    stubborn = teardown.measure("ignores_sigterm", tmp_path / "a", grace_s=0.5)
    healthy = teardown.measure("healthy", tmp_path / "b", grace_s=10.0)
    assert stubborn >= 0.5  # SIGKILL only after the grace
    within(healthy, 5.0, "a healthy teardown with a 10 s grace")  # nobody waited for a grace not needed


@pytest.mark.procs
def test_bench_refuses_unknown_part(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "pd_sessions", "bench", "--parts", "clusters,speed", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2
    assert (
        "--parts takes router, teardown, clusters, checks, digest, startup, report, multihost, packing "
        "(got speed)" in p.stderr
    )
    p = subprocess.run(
        [sys.executable, "-m", "pd_sessions", "bench", "--repeats", "0", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2 and "--repeats must be at least 1 (got 0)" in p.stderr


@pytest.mark.procs
def test_router_bench_against_fake_backends(tmp_path):
    needs("vllm_router")
    from pd_sessions.bench import routers

    out = routers.run(tmp_path, requests=30, concurrent_requests=200, concurrency=20, rounds=1)
    t = out["targets"]
    assert set(t) == {"direct", "vllm-router", "python-proxy"}
    for name, r in t.items():
        assert r["errors"] == 0 and r["samples"] == 30, name
        assert 0 < r["p50_ms"] <= r["p99_ms"]
        assert r["throughput_rps"]["n"] == 1
    assert t["vllm-router"]["added_p50_ms"] == pytest.approx(
        t["vllm-router"]["p50_ms"] - t["direct"]["p50_ms"], abs=0.002
    )
    assert "fake" in out["backend"]
    # the four servers were our children; stopped and reaped, none is left
    assert psutil.Process().children(recursive=True) == []


def _bench_on_fake_stack(tmp_path, *args: str) -> tuple[dict, str]:
    """``pd-sessions bench ARGS`` on the fake stack with the fake sweep: its results.json, stdout."""
    (tmp_path / "sweep.toml").write_text(fake_sweep_toml())
    env = fake_stack_env()
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-m", "pd_sessions", "bench", "--platform", "cpu", *args]
        + ["--skip-check", "kv_digest"]  # the fake stack has no vLLM connector for its observer
        + ["--repeats", "1", "--grace", "2", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((out / "results.json").read_text()), p.stdout


@pytest.mark.procs
def test_cluster_drivers_on_the_fake_stack(tmp_path):
    sweep = str(tmp_path / "sweep.toml")
    # the check sweep is measured by the clusters part: not run again
    doc, stdout = _bench_on_fake_stack(
        tmp_path, "--sweep", sweep, "--parts", "clusters,checks", "--check-sweeps", sweep
    )
    out = tmp_path / "out"  # where the helper has the bench write
    runs = {r["driver"]: r for r in doc["runs"]}
    assert set(runs) == {"single", "pd_sessions", "upstream"} and all(r["ok"] for r in runs.values())
    pd, up = runs["pd_sessions"], runs["upstream"]
    for r in (pd, up):
        assert set(r["own_startup_s"]) == {"prefill-0", "decode-0"}
        o = r["overhead"]
        assert o["overhead_s"] == pytest.approx(
            r["wall_s"] - max(r["own_startup_s"].values()) - r["checks_s"], abs=0.001
        )
    assert up["phases"]["router"] >= UPSTREAM_PROXY_SLEEP_S  # its fixed sleep
    assert up["phases"]["teardown"] >= 5.0  # sleep 2 + sleep 3
    assert pd["spawn_spread_s"] is not None and pd["router_health_to_ready_s"] is not None
    c = doc["clusters"]["1x1"]
    # the ratio of the two medians (each one run here, rounded to the ms as every summary is)
    assert c["upstream"]["wall_s"]["median"] == pytest.approx(up["wall_s"], abs=0.001)
    assert c["upstream_vs_pd_sessions"]["ratio"] == pytest.approx(
        c["upstream"]["wall_s"]["median"] / c["pd_sessions"]["wall_s"]["median"], abs=0.001
    )
    assert (out / "phases.png").read_bytes()[:4] == b"\x89PNG"
    # every check's own time, as the runner measured it; the same checks in both drivers
    assert set(pd["check_s"]) == set(doc["settings"]["checks"]) == set(up["check_s"])
    assert "accuracy" not in pd["check_s"] and pd["connector"] == "mooncake"
    assert sum(pd["check_s"].values()) <= pd["checks_s"]
    assert "measured by the clusters part" in stdout and doc["check_runs"] == []
    cost = doc["checks_cost"]["fake:1x1"]
    edge = sum(pd["check_s"][n] for n in bench_results.EDGE_CHECKS)
    assert cost["edge_s"]["median"] == pytest.approx(edge, abs=0.01)
    assert "## What each check costs" in (out / "results.md").read_text()
    assert "## Config 1x1: phases (s)" in (out / "results.md").read_text()
    # every process the drivers started logged its argv first: none of their ports is in use
    started = [
        line
        for log in (out / "logs").rglob("*.log")
        for line in log.read_text().splitlines()
        if line.startswith("# pd_sessions: starting ")
    ]
    ports = {int(m) for line in started for m in re.findall(r"'--port', '(\d+)'", line)}
    assert len(started) >= 7 and len(ports) >= 7  # single 1 + pd_sessions 3 + upstream 3
    listening = [
        c.laddr.port
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports
    ]
    assert listening == []
    left = [
        q.info["cmdline"]
        for q in psutil.process_iter(["cmdline"])
        if any(f"'--port', '{port}'" in str(q.info["cmdline"]) for port in ports)
    ]
    assert left == []


def test_partial_results_of_an_interrupted_run_are_marked(tmp_path):
    runs = [_run("pd_sessions", 100.0, 90.0, 89.0)]  # stopped before upstream and single ran
    doc = bench_doc(runs, interrupted="Stopped: stopped by SIGTERM")
    doc["goals"] = [g.to_dict() for g in bench_results.goals(doc)]
    md = bench_results.write(doc, tmp_path)["markdown"].read_text()
    assert "**INTERRUPTED** (Stopped: stopped by SIGTERM): partial results." in md
    assert "= **-** (1.0" in md  # no parallel-start ratio without a single-instance run


def test_rerender_from_raw_samples(tmp_path):
    runs = [
        _run(d, 100.0, 90.0, 89.0, repeat=i) for d in ("pd_sessions", "upstream", "single") for i in range(3)
    ]
    doc = bench_doc(runs)
    doc["clusters"] = {}  # stale summaries are recomputed from the runs
    (tmp_path / "results.json").write_text(json.dumps(doc))
    paths = bench_results.rerender(tmp_path / "results.json")
    assert json.loads(paths["json"].read_text())["clusters"]["1x1"]["pd_sessions"]["ok"] == 3
    assert "## Config 1x1: phases (s)" in paths["markdown"].read_text()


def _checked_run(sweep, connector, check_s, *, ok=True, driver="pd_sessions", repeat=0):
    r = _run(driver, 100.0, 90.0, 89.0, ok=ok, repeat=repeat)
    return {**r, "sweep": sweep, "connector": connector, "check_s": check_s}


BASE = {"smoke": 0.5, "parity": 1.0, "kv_transfer": 0.5}


def test_summarize_checks_per_connector_edge_sum_and_goal(tmp_path):
    edge_fast = {"cache_paths": 1.0, "too_long": 0.5, "burst": 3.0, "abort_frees_kv": 1.5}  # 6 s
    edge_slow = {"cache_paths": 2.0, "too_long": 30.5, "burst": 5.0, "abort_frees_kv": 22.5}  # 60 s
    runs = [_checked_run("mooncake_sweep", "mooncake", {**BASE, **edge_fast}, repeat=i) for i in range(3)]
    runs += [_checked_run("nixl_sweep", "nixl", {**BASE, **edge_slow}, repeat=i) for i in range(2)]
    # a failed run counts as a run but not in the times; other drivers and untimed runs do not count
    runs.append(_checked_run("nixl_sweep", "nixl", {**BASE, "too_long": 999.0}, ok=False, repeat=2))
    runs.append(_checked_run("nixl_sweep", "nixl", {**BASE, "burst": 999.0}, driver="upstream"))
    runs.append(_run("pd_sessions", 100.0, 90.0, 89.0))
    cost = bench_results.summarize_checks(runs)
    assert list(cost) == ["mooncake_sweep:1x1", "nixl_sweep:1x1"]
    moon, nixl = cost["mooncake_sweep:1x1"], cost["nixl_sweep:1x1"]
    assert (moon["runs"], moon["ok"], nixl["runs"], nixl["ok"]) == (3, 3, 3, 2)
    assert list(moon["check_s"]) == ["smoke", "parity", "kv_transfer", "cache_paths", "too_long", "burst"] + [
        "abort_frees_kv"
    ]  # in the registry's running order
    assert moon["base_s"]["median"] == 2.0 and moon["edge_s"]["median"] == 6.0
    assert nixl["edge_s"]["median"] == 60.0 and nixl["check_s"]["too_long"]["max"] == 30.5
    assert nixl["connector"] == "nixl" and nixl["edge_checks"] == list(bench_results.EDGE_CHECKS)
    doc = bench_doc([r for r in runs if "check_s" not in r or r["driver"] != "pd_sessions"])
    doc["checks_cost"] = cost
    goals = {g.name: g for g in bench_results.goals(doc)}
    assert goals["1x1 over mooncake: the edge checks add"].met is True
    assert goals["1x1 over nixl: the edge checks add"].met is False
    assert goals["1x1 over nixl: the edge checks add"].limit == bench_results.EDGE_CHECKS_GOAL_S == 15.0
    md = bench_results.markdown({**doc, "goals": [g.to_dict() for g in goals.values()]})
    assert "## What each check costs (s, pd_sessions driver)" in md
    assert "| nixl | 1x1 | 2/3 | 0.50 (0.50-0.50) |" in md and "| **60.00 (60.00-60.00)** |" in md
    assert "| 1x1 over nixl: the edge checks add | <= 15 s | 60.000 s | no |" in md
    assert "nixl_sweep" not in bench_results.summarize_checks([runs[-2]])  # upstream driver: not counted


def test_checks_cost_only_edge_checks_that_ran():
    runs = [_checked_run("s", "nixl", {**BASE, "too_long": 0.3})]
    c = bench_results.summarize_checks(runs)["s:1x1"]
    assert c["edge_checks"] == ["too_long"] and c["edge_s"]["median"] == 0.3
    assert bench_results.checks_markdown({}) == []


def test_rerender_recomputes_checks_cost(tmp_path):
    runs = [_checked_run("mooncake_sweep", "mooncake", {**BASE, "burst": 4.0})]
    doc = bench_doc(runs, check_runs=[_checked_run("nixl_sweep", "nixl", {**BASE, "burst": 9.0})])
    (tmp_path / "results.json").write_text(json.dumps(doc))
    out = json.loads(bench_results.rerender(tmp_path / "results.json")["json"].read_text())
    assert {k: v["edge_s"]["median"] for k, v in out["checks_cost"].items()} == {
        "mooncake_sweep:1x1": 4.0,
        "nixl_sweep:1x1": 9.0,
    }


@pytest.mark.procs
def test_checks_part_runs_each_check_sweep(tmp_path):
    doc, stdout = _bench_on_fake_stack(
        tmp_path, "--parts", "checks", "--check-sweeps", str(tmp_path / "sweep.toml")
    )
    assert "runs" not in doc and len(doc["check_runs"]) == 1
    run = doc["check_runs"][0]
    assert run["ok"] and run["sweep"] == "fake" and set(run["check_s"]) >= set(bench_results.EDGE_CHECKS)
    assert doc["checks_cost"]["fake:1x1"]["ok"] == 1
    assert "edge checks" in stdout


def test_request_features_has_its_own_goal_of_10_s_per_config():
    rf = {"request_features": 4.0}
    runs = [_checked_run("mooncake_sweep", "mooncake", {**BASE, **rf}, repeat=i) for i in range(2)]
    runs += [_checked_run("nixl_sweep", "nixl", {**BASE, "request_features": 12.5}, repeat=0)]
    doc = bench_doc([])
    doc["checks_cost"] = bench_results.summarize_checks(runs)
    goals = {g.name: g for g in bench_results.goals(doc)}
    assert goals["1x1 over mooncake: request_features adds"].met is True
    assert goals["1x1 over nixl: request_features adds"].met is False
    assert (
        goals["1x1 over nixl: request_features adds"].limit == bench_results.REQUEST_FEATURES_GOAL_S == 10.0
    )


# ------------------------------------------------------------------ the digest part


def _digest_run(digest: bool, wall: float, checks: float, *, check=0.5, observer=0.1, loads=50, ok=True):
    rec = {"config": "1x1", "connector": "mooncake", "digest": digest, "ok": ok, "wall_s": wall}
    rec["checks_s"] = checks
    if digest:
        rec["kv_digest"] = {"seconds": check, "verdict": "pass", "observer_s": observer, "loads": loads}
    return rec


def test_the_digest_part_reports_seconds_share_of_the_config_and_per_request_cost():
    from pd_sessions.bench import digest_bench

    runs = [
        _digest_run(True, 100.0, 40.0),
        _digest_run(False, 98.0, 39.0),
        _digest_run(False, 97.0, 38.0),
        _digest_run(True, 110.0, 41.0, check=1.0, observer=0.2),
        _digest_run(True, 400.0, 300.0, check=90.0, ok=False),  # a failed run: not in the times
    ]
    c = digest_bench.summarize(runs)["1x1"]
    assert c["runs"] == {"with": 3, "without": 2} and c["ok"] == {"with": 2, "without": 2}
    assert c["digest_s"]["values"] == [0.6, 1.2] and c["digest_s"]["median"] == 0.9
    assert c["fraction"]["values"] == [0.006, round(1.2 / 110.0, 5)]
    assert c["per_request_ms"]["values"] == [2.0, 4.0]  # the observer's seconds per load digested
    assert c["checks_diff_s"] == 40.5 - 38.5
    doc = {"digest_cost": {"1x1": c}}
    (goal,) = [g for g in bench_results.goals(doc) if "KV digest" in g.name]
    assert goal.limit == digest_bench.DIGEST_GOAL == 0.05 and goal.met is True
    md = "\n".join(digest_bench.markdown(doc["digest_cost"]))
    assert (
        "## What the KV digest costs a config" in md and "**0.900 (0.600-1.200) s, 0.84 (0.60-1.09) %**" in md
    )


def test_a_digest_over_the_goal_is_not_met_and_the_section_says_no():
    from pd_sessions.bench import digest_bench

    c = digest_bench.summarize([_digest_run(True, 20.0, 15.0, check=1.5, observer=0.5)])
    (goal,) = digest_bench.goals(c)
    assert goal.measured == 0.1 and goal.met is False  # 2 s of a 20 s config: 10 %
    md = bench_results.goals_markdown([goal.to_dict()])
    assert "| 1x1 over mooncake: the KV digest costs | <= 5 % | 10.00 % | no |" in md


def test_the_digest_figures_of_a_run_come_from_its_kv_digest_check():
    from pd_sessions.bench import digest_bench
    from pd_sessions.core.results import PASS, CheckResult

    checks = [
        CheckResult("smoke", PASS, "ok", seconds=1.0),
        CheckResult("kv_digest", PASS, "ok", {"observer_s": 0.25, "loads": 40, "blocks_compared": 9}, 0.7),
    ]
    assert digest_bench.record(checks) == {
        "seconds": 0.7,
        "verdict": PASS,
        "observer_s": 0.25,
        "loads": 40,
        "blocks_compared": 9,
    }
    assert digest_bench.record(checks[:1]) == {}
