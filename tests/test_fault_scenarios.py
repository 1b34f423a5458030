"""The fault scenarios' verdicts (pd_sessions/checks/faults/*: evaluate, promise), pure: each
scenario passes only when its fault happened, the promise held (or, for zero and swap, the
checks caught the corruption) and the cluster recovered, and fails naming what broke.
These are the scenarios' can-fail tests; the e2e runs are in tests/test_e2e_faults.py."""

from __future__ import annotations

import pytest
from helpers.builders import cfg

from pd_sessions.checks.faults import corrupt, drop, peer_death, restart, stall_abort
from pd_sessions.checks.faults.promise import (
    BROKEN,
    CORRECT,
    FAILED_CLEARLY,
    HUNG,
    WRONG,
    Outcome,
    Recovery,
    classify,
    counts,
    said,
)
from pd_sessions.checks.faults.scenario import NotWrapped, control_file
from pd_sessions.core import check_registry
from pd_sessions.core.connectors.base import DetectionRate
from pd_sessions.core.errors import ConfigError
from pd_sessions.core.results import FAIL, PASS, CheckResult

OK = Recovery(
    {"prefill-0": "ok", "decode-0": "ok", "router": "ok"},
    {"prefill-0": None, "decode-0": None},
    None,
    0.4,
    30,
)


def recovered(**kw) -> Recovery:
    probe = Outcome("probe", CORRECT, 0.2, 200, "x")
    return Recovery(kw.get("health", OK.health), kw.get("held", OK.held), kw.get("probe", probe), 0.6, 30)


@pytest.mark.parametrize(
    ("kw", "kind"),
    [
        ({"status": None, "same": True, "text": "abc"}, CORRECT),
        ({"status": 200, "same": False, "text": "xyz"}, WRONG),
        ({"status": 200, "same": None, "text": "not compared"}, WRONG),
        ({"status": 500, "error": "HTTP 500: KV load failed"}, FAILED_CLEARLY),
        ({"status": 400, "error": "HTTP 400: bad"}, FAILED_CLEARLY),
        ({"status": None, "error": "RemoteDisconnected: closed"}, BROKEN),
        ({"status": None, "error": "no answer within 60 s"}, HUNG),
        ({"status": 500, "error": "HTTP 500", "seconds": 61.0}, HUNG),  # an error, but too late
    ],
)
def test_each_answer_has_one_kind(kw, kind):
    seconds = kw.pop("seconds", 1.0)
    assert classify("p", seconds=seconds, **kw).kind == kind


def test_counts_name_every_kind_and_broken_only_when_there_is_one():
    outs = [Outcome("a", CORRECT, 1), Outcome("b", FAILED_CLEARLY, 1, 500)]
    assert said(counts(outs)) == "2 requests: 1 correct, 1 failed clearly, 0 wrong, 0 hung"
    assert said(counts([Outcome("c", BROKEN, 1)])).endswith("0 hung, 1 broken")


# ---------------------------------------------------------------- drop


def test_drop_passes_when_every_request_is_recomputed_or_fails_clearly():
    outs = [Outcome("a", FAILED_CLEARLY, 0.3, 500, "HTTP 500"), Outcome("b", FAILED_CLEARLY, 0.2, 500)]
    r = drop.evaluate(outs, {"drop": 2}, recovered(), policy="fail")
    assert r.verdict == PASS, r.message
    assert "2 KV loads reported failed; 2 requests: 0 correct, 2 failed clearly" in r.message
    assert "failed with an HTTP error (kv_load_failure_policy fail)" in r.message
    assert r.details["counts"][FAILED_CLEARLY] == 2
    figures = {f.name: (f.value, f.unit) for f in r.figures}
    assert figures["recovery_s"] == (0.6, "s") and figures["drops_applied"] == (2, "")
    assert r.tables[0].columns == (CORRECT, FAILED_CLEARLY, WRONG, HUNG, BROKEN) and r.tables[0].rows == (
        (0, 2, 0, 0, 0),
    )
    r = drop.evaluate([Outcome("a", CORRECT, 0.3, 200)], {"drop": 1}, recovered(), policy="recompute")
    assert r.verdict == PASS and "recomputed on the decode" in r.message


@pytest.mark.parametrize(
    ("outs", "injected", "rec", "says"),
    [
        (
            [Outcome("a", CORRECT, 0.3)],
            {},
            recovered(),
            "the fault did not happen: the injector applied drop 0",
        ),
        (
            [Outcome("a", WRONG, 0.3, 200, "garbage")],
            {"drop": 1},
            recovered(),
            "1 request(s) broke the promise (a 200 with other text",
        ),
        ([Outcome("a", HUNG, 60.0, None, "no answer")], {"drop": 1}, recovered(), "'a': hung after 60.0 s"),
        (
            [Outcome("a", FAILED_CLEARLY, 0.3, 500)],
            {"drop": 1},
            recovered(held={"decode-0": "1 requests still running (vllm:num_requests_running)"}),
            "not recovered 30 s after the fault: decode-0: 1 requests still running",
        ),
        (
            [Outcome("a", FAILED_CLEARLY, 0.3, 500)],
            {"drop": 1},
            recovered(probe=Outcome("probe", WRONG, 0.2, 200, "zz")),
            "a normal request through the router: wrong",
        ),
    ],
)
def test_drop_fails_naming_what_broke(outs, injected, rec, says):
    r = drop.evaluate(outs, injected, rec, policy="fail")
    assert r.verdict == FAIL and says in r.message, r.message


# ---------------------------------------------------------------- zero / swap


def burst_result(rows, verdict=FAIL, failed=()):
    return CheckResult(
        "burst",
        verdict,
        "32 concurrent requests: 2/3 prompts differ: prompt '0 otters'...",
        {"parity": {"prompts": [{"prompt": p, "same": s} for p, s in rows]}, "failed": list(failed)},
    )


def test_corruption_passes_when_the_burst_check_fails_naming_the_requests():
    check = burst_result([("0 otters", False), ("1 herons", False), ("2 lynxs", True)])
    r = corrupt.evaluate("swap", check, {"swap": 3, "swap_skipped": 1}, recovered(), requests=3)
    assert r.verdict == PASS, r.message
    assert "the burst check failed as it must, naming '0 otters', '1 herons'" in r.message
    assert "detected 2/3 (67 %)" in r.message and "1 passed unnoticed" in r.message
    assert (
        r.details["detection_rate"] == 0.6667
        and {f.name: f.value for f in r.figures}["detection_rate"] == 0.6667
    )
    assert r.details["counts"] == {CORRECT: 1, FAILED_CLEARLY: 0, WRONG: 2, HUNG: 0, BROKEN: 0}
    assert "no rate written for this connector in this parity mode: at least one detection" in r.message


def test_a_corruption_the_checks_are_told_to_ignore_fails_the_scenario():
    """The can-fail case the issue names: swapped KV that the comparison lets through (here the
    burst passed: as if the checks ignored it) must fail the scenario's own verdict."""
    check = burst_result([("0 otters", True), ("1 herons", True)], verdict=PASS)
    r = corrupt.evaluate("swap", check, {"swap": 2}, recovered(), requests=2)
    assert r.verdict == FAIL and "the checks missed every corrupted request" in r.message


@pytest.mark.parametrize(
    ("injected", "failed", "rec", "says"),
    [
        ({}, (), recovered(), "the fault did not happen: the injector applied zero 0"),
        ({"zero": 2}, ("'0 otters': http://x: no answer within 60 s",), recovered(), "1 request(s) hung"),
        (
            {"zero": 2},
            (),
            recovered(health={"decode-0": "connection refused"}),
            "decode-0: /health connection refused",
        ),
    ],
)
def test_corruption_fails_naming_what_broke(injected, failed, rec, says):
    check = burst_result([("0 otters", False), ("1 herons", True)], failed=failed)
    r = corrupt.evaluate("zero", check, injected, rec, requests=2)
    assert r.verdict == FAIL and says in r.message, r.message


def test_a_reset_under_corruption_is_broken_not_a_clear_failure():
    """Issue 40, hole 2d: every error that was not a timeout counted as "failed clearly", a
    connection reset included; the one classifier calls it broken, which breaks the promise."""
    reset = "'1 herons': http://x: connection reset by peer"
    check = burst_result(
        [("0 otters", False), ("2 lynxs", False)], failed=(reset, "'3 owls': HTTP 500: boom")
    )
    r = corrupt.evaluate("zero", check, {"zero": 2}, recovered(), requests=4)
    assert r.verdict == FAIL and "1 request(s) got no HTTP answer (broken): '1 herons'" in r.message
    assert r.details["counts"][BROKEN] == 1 and r.details["counts"][FAILED_CLEARLY] == 1


def test_a_detection_rate_below_the_connectors_fails():
    """Issue 40, hole 2d: 1 of 32 corruptions detected used to pass (at least one); the rate
    written for the connector and parity mode is required now."""
    rows = [(f"{i} otters", i != 0) for i in range(32)]  # only the first differs: 1/32
    need = DetectionRate("swap", "exact", 32, 32, "32/32 in each of 4 CI runs")
    r = corrupt.evaluate(
        "swap", burst_result(rows), {"swap": 32}, recovered(), requests=32, required=need, where="X"
    )
    assert r.verdict == FAIL and "detected 1/32, below the 32/32 written for X in exact mode" in r.message
    all_rows = [(f"{i} otters", False) for i in range(32)]
    ok = corrupt.evaluate(
        "swap", burst_result(all_rows), {"swap": 32}, recovered(), requests=32, required=need
    )
    assert ok.verdict == PASS and "(required: 32/32, measured 32/32 in each of 4 CI runs)" in ok.message


def test_every_connector_writes_the_rates_its_ci_run_measures():
    """The CPU lane's CI runs Mooncake in exact mode and NIXL in margin mode (tests/test_e2e_faults.py)."""
    from pd_sessions.core.connectors import ALL

    by = {s.name: s for s in ALL}
    for fault in ("zero", "swap"):
        assert by["mooncake"].detection_rate(fault, "exact") is not None
        assert by["nixl"].detection_rate(fault, "margin") is not None


# ---------------------------------------------------------------- stall, then abort


def phase(where="prefill", **kw):
    base = dict(
        where=where,
        requests=2,
        reached=2,
        got_token=0,
        injected={"stall": 2},
        freed_s=0.4,
        held={"prefill-0": None, "decode-0": None},
        bound_s=15.0,
    )
    return stall_abort.Phase(**{**base, **kw})


def test_stall_abort_passes_when_every_block_is_free_in_time_on_both_sides():
    r = stall_abort.evaluate([phase(), phase("decode", freed_s=5.2)], recovered())
    assert r.verdict == PASS, r.message
    assert "while the decode waited (stalled): every instance idle again 5.2 s later" in r.message
    assert {f.name: f.value for f in r.figures}["freed_after_decode_stall_s"] == 5.2
    assert [row[0] for row in r.tables[0].rows] == ["prefill", "decode"]


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (
            phase(
                "decode", held={"decode-0": "KV cache usage 0.0400 (idle 0.0000, vllm:kv_cache_usage_perc)"}
            ),
            "15 s after 2 clients disconnected while the decode waited: decode-0: KV cache usage 0.0400",
        ),
        (phase(injected={}), "prefill: the fault did not happen"),
        (phase(reached=1), "only 1/2 requests were seen waiting on the prefill"),
        (phase(got_token=1), "1 stream(s) had a token before the disconnect"),
    ],
)
def test_stall_abort_fails_naming_the_instance_and_the_value(bad, says):
    r = stall_abort.evaluate([phase(), bad], recovered())
    assert r.verdict == FAIL and says in r.message, r.message


# ---------------------------------------------------------------- peer death, restart


def survivors(**held):
    return Recovery(
        {"decode-0": "ok", "router": "ok"}, {"decode-0": None, **held}, None, 0.7, 30, down=("prefill-0",)
    )


def test_peer_death_passes_naming_the_dead_and_what_each_survivor_holds():
    out = Outcome("A peer dies", FAILED_CLEARLY, 10.4, 500, "HTTP 500")
    r = peer_death.evaluate(
        "prefill-0", out, {"stall": 1}, survivors(), waited_s=0.5, killed_after_s=0.1, policy="fail"
    )
    assert r.verdict == PASS, r.message
    assert r.message.startswith("prefill-0 SIGKILLed 0.1 s after the decode began waiting for its KV")
    assert "the request failed with HTTP 500 after 10.4 s" in r.message
    assert "survivors: decode-0: healthy, idle" in r.message and r.details["dead"] == "prefill-0"
    ok = peer_death.evaluate(
        "prefill-0",
        Outcome("x", CORRECT, 9.0, 200),
        {"stall": 1},
        survivors(),
        waited_s=0.5,
        killed_after_s=0.1,
        policy="recompute",
    )
    assert ok.verdict == PASS and "was recomputed correctly on the decode" in ok.message


@pytest.mark.parametrize(
    ("victim", "out", "rec", "says"),
    [
        (
            "prefill-0",
            Outcome("x", HUNG, 60.0, None, "no answer within 60 s"),
            survivors(),
            "hung after 60.0 s",
        ),
        ("prefill-0", Outcome("x", WRONG, 9.0, 200, "zz"), survivors(), "a 200 with other text"),
        (
            "prefill-0",
            Outcome("x", FAILED_CLEARLY, 9.0, 500),
            survivors(**{"decode-0": "1 requests still running (vllm:num_requests_running)"}),
            "survivors: decode-0: 1 requests still running",
        ),
        (None, Outcome("x", CORRECT, 1.0, 200), survivors(), "no prefill was killed"),
    ],
)
def test_peer_death_fails_naming_what_broke(victim, out, rec, says):
    r = peer_death.evaluate(victim, out, {"stall": 1}, rec, waited_s=0.5, killed_after_s=0.1, policy="fail")
    assert r.verdict == FAIL and says in r.message, r.message


def test_peer_death_fails_when_the_killed_prefill_outlives_its_sigkill():
    """Seen over NIXL on a loaded host: the prefill's worker outlived its SIGKILL for minutes
    while the decode hung; even with a correct answer, the scenario fails naming the survivor."""
    r = peer_death.evaluate(
        "prefill-0",
        Outcome("x", CORRECT, 9.0, 200),
        {"stall": 1},
        survivors(),
        waited_s=0.5,
        killed_after_s=30.2,
        policy="recompute",
        undead="processes survived SIGKILL: prefill-0 pid 5625 "
        "(VLLM::Worker: 2 threads: 1 R, 1 S in do_epoll_wait)",
        died_s=30.1,
    )
    assert r.verdict == FAIL and "the SIGKILL did not end prefill-0: processes survived" in r.message
    # where the survivor's threads were, as the kernel said (process.kernel_state)
    assert "prefill-0 pid 5625 (VLLM::Worker: 2 threads: 1 R, 1 S in do_epoll_wait)" in r.message
    assert r.details["died_s"] == 30.1


def test_restart_passes_with_its_times_and_fails_naming_why():
    good = [Outcome("a", FAILED_CLEARLY, 0.1, 503), Outcome("b", CORRECT, 0.3, 200)]
    r = restart.evaluate(
        "prefill-0",
        ready_s=41.2,
        start_error=None,
        attempts=good,
        correct_s=42.0,
        recovery=recovered(),
        killed_here=False,
        bound_s=120,
    )
    assert r.verdict == PASS and "ready after 41.2 s, P/D correct again 42.0 s after the restart" in r.message
    assert {f.name: (f.value, f.unit) for f in r.figures}["pd_correct_s"] == (42.0, "s")
    assert r.tables[0].rows == ((0, FAILED_CLEARLY, 0.1, 503), (1, CORRECT, 0.3, 200))
    r = restart.evaluate(
        "prefill-0",
        ready_s=None,
        start_error="prefill-0 (URL) exited with status 1",
        attempts=[],
        correct_s=None,
        recovery=None,
        killed_here=False,
        bound_s=120,
    )
    assert r.verdict == FAIL and "did not start again in place: prefill-0 (URL) exited" in r.message
    r = restart.evaluate(
        "prefill-0",
        ready_s=40.0,
        start_error=None,
        attempts=[Outcome("a", FAILED_CLEARLY, 0.1, 503)],
        correct_s=None,
        recovery=None,
        killed_here=False,
        bound_s=120,
    )
    assert r.verdict == FAIL and "no request through the router was correct within 120 s" in r.message
    assert "last: failed clearly after 0.1 s (HTTP 503)" in r.message


@pytest.mark.parametrize("bad", [WRONG, BROKEN, HUNG])
def test_restart_fails_on_a_bad_answer_before_the_right_one(bad):
    """Issue 40, hole 2a: [WRONG 200, CORRECT] used to pass (the loop retried until one answer
    was correct and the e2e looked at the last); every attempt is judged now, and listed."""
    attempts = [
        Outcome("a", bad, 0.2, 200 if bad == WRONG else None, "other text"),
        Outcome("b", CORRECT, 0.3),
    ]
    r = restart.evaluate(
        "prefill-0",
        ready_s=40.0,
        start_error=None,
        attempts=attempts,
        correct_s=41.0,
        recovery=recovered(),
        killed_here=False,
        bound_s=120,
    )
    assert r.verdict == FAIL, r.message
    assert f"request 1 through the router was {bad}" in r.message
    assert f"a wrong answer before a right one is a failure, not a retry; attempts: 1: {bad}" in r.message
    assert "2: correct" in r.message


@pytest.mark.parametrize("bad", [WRONG, BROKEN, HUNG])
def test_recovery_fails_on_a_bad_probe_before_the_right_one(bad):
    """Issue 40, hole 2b: the recovery probe after a scenario was retried silently and a wrong one
    dropped; every probe is kept and judged now. A clear error while it recovers keeps the promise."""
    probe = Outcome("probe", CORRECT, 0.2, 200, "x")
    earlier = (Outcome("probe 1", FAILED_CLEARLY, 0.1, 503), Outcome("probe 2", bad, 0.2, None, "zz"))
    r = Recovery(OK.health, OK.held, probe, 0.6, 30, earlier=earlier)
    assert not r.ok and r.problems() == [f"probe 2 through the router was {bad}: 'zz' before the last one"]
    assert r.to_dict()["earlier_probes"][1]["kind"] == bad
    assert Recovery(OK.health, OK.held, probe, 0.6, 30, earlier=earlier[:1]).ok


# ---------------------------------------------------------------- selection, the plan


def test_peer_death_needs_the_restart_after_it():
    with pytest.raises(ConfigError, match="fault_peer_death needs fault_restart after it"):
        check_registry.resolve(["smoke", "fault_peer_death"])
    assert check_registry.resolve(["fault_restart", "fault_peer_death"]) == (
        "fault_peer_death",
        "fault_restart",
    )
    assert not set(check_registry.FAULTS) & set(check_registry.DEFAULTS)
    assert check_registry.injects_faults(["smoke", "exec[0]", "fault_drop"])
    assert not check_registry.injects_faults(["smoke", "exec[0]"])


def test_a_cluster_without_the_injector_is_said_not_guessed():
    from helpers.builders import plan

    from pd_sessions.core.inventory import Inventory

    inv = Inventory(gpus=(), cpus=(0, 1), gpu_source="test")
    plain = plan(cfg(connector="nixl"), inv, platform="cpu")
    with pytest.raises(NotWrapped, match="not wrapped by the fault injector"):
        control_file(plain)
    wrapped = plan(cfg(connector="nixl"), inv, platform="cpu", faults_control="/r/c/faults.json")
    assert control_file(wrapped) == "/r/c/faults.json"


# ---------------------------------------------------------------- what an instance holds


def test_blocks_in_use_are_counted_exactly_from_the_usage_and_the_cache_size():
    from helpers import FIXTURES

    from pd_sessions.checks.faults.scenario import BLOCKS, holds, state

    text = (FIXTURES / "nixl_decode_metrics_after.txt").read_text()  # num_gpu_blocks 4096, usage 0
    idle = state(text)
    assert idle[BLOCKS] == 0 and idle["vllm:num_requests_running"] == 0
    one = state(
        text.replace(
            'kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0',
            f'kv_cache_usage_perc{{engine="0",model_name="tiny-llama"}} {1 / 4095}',
        )
    )
    assert one[BLOCKS] == 1
    # one stranded block: below abort_frees_kv's slack on the fraction (1e-3), seen here
    assert holds(idle, one) == (
        "1 KV blocks in use (idle 0; vllm:kv_cache_usage_perc x num_gpu_blocks of vllm:cache_config_info)"
    )
    assert holds(one, one) is None
    assert holds(idle, {**idle, "vllm:num_requests_waiting": 2.0}).startswith("2 requests still waiting")
    # no cache size exposed: abort_frees_kv's rule on the fraction
    assert holds(
        {"vllm:kv_cache_usage_perc": 0.0}, {"vllm:num_requests_running": 0.0, "vllm:kv_cache_usage_perc": 0.5}
    ).startswith("KV cache usage 0.5000")


def test_a_scenario_on_a_cluster_without_the_injector_fails_saying_why():
    from types import SimpleNamespace

    from helpers.builders import plan

    from pd_sessions.core.inventory import Inventory

    inv = Inventory(gpus=(), cpus=(0, 1), gpu_source="test")
    planned = plan(cfg(decode_kv_transfer=False), inv, platform="cpu")
    window = SimpleNamespace(plan=planned, cluster=SimpleNamespace(plan=planned))
    r = drop.run(window, {"requests": 1})
    assert (
        r.verdict == FAIL
        and r.message
        == "could not run: decode-0 has no --kv-transfer-config: no KV connector to inject faults into"
    )
