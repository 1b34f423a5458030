"""The fault scenarios' verdicts (pd_sessions/checks/faults/*: evaluate, promise), pure: each
scenario passes only when its fault happened, the promise held (or, for zero and swap, the
checks caught the corruption) and the cluster recovered, and fails naming what broke.
These are the scenarios' can-fail tests; the e2e runs are in tests/test_e2e_faults.py."""

from __future__ import annotations

import pytest
from helpers.builders import cfg

from pd_sessions.checks import burst
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
from pd_sessions.core.results import FAIL, NOT_RUN, PASS, CheckResult

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


def test_a_drop_that_did_not_fire_is_not_run_invalid_never_pass():
    """Issue 40, part 5: the injector's drop count is the proof; 0 is NOT RUN (invalid), never
    PASS, however right the requests were; what the scenario saw without its fault is kept."""
    r = drop.evaluate([Outcome("a", CORRECT, 0.3)], {}, recovered(), policy="fail")
    assert (
        r.verdict == NOT_RUN
        and r.message == "invalid: the fault did not fire (the injector's drop count read 0)"
    )
    assert r.details["proof"] == [{"what": "the injector's drop count", "value": 0, "fired": False}]
    assert r.details["without_fault"]["verdict"] == PASS and r.figures  # still reported
    bad = drop.evaluate(
        [Outcome("a", WRONG, 0.3, 200, "zz")], {"drop_skipped": 1}, recovered(), policy="fail"
    )
    assert (
        bad.verdict == NOT_RUN and "without its fault the scenario saw: FAIL: drop (1 request" in bad.message
    )
    fired = drop.evaluate([Outcome("a", CORRECT, 0.3)], {"drop": 1}, recovered(), policy="recompute")
    assert fired.verdict == PASS and fired.details["proof"][0]["fired"] is True


# ---------------------------------------------------------------- zero / swap


def burst_result(rows, verdict=FAIL, failed=()):
    """A burst's result; ``failed``: (prompt, error, HTTP status or None, seconds) each, recorded
    as burst.fire records them (burst.Failure)."""
    failures = [burst.Failure(p, e, status, s, 60.0) for p, e, status, s in failed]
    return CheckResult(
        "burst",
        verdict,
        "32 concurrent requests: 2/3 prompts differ: prompt '0 otters'...",
        {
            "parity": {"prompts": [{"prompt": p, "same": s} for p, s in rows]},
            "failed": [f.line() for f in failures],
            "failures": [f.to_dict() for f in failures],
        },
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
        (
            {"zero": 2},
            [("3 owls", "http://x: no answer within 60 s", None, 60.0)],
            recovered(),
            "1 request(s) hung",
        ),
        # hung by its seconds alone, whatever the text says
        ({"zero": 2}, [("3 owls", "http://x: HTTP 504: late", 504, 61.0)], recovered(), "1 request(s) hung"),
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


def test_a_corruption_that_did_not_fire_is_not_run_invalid():
    check = burst_result([("0 otters", True), ("1 herons", True)], verdict=PASS)
    r = corrupt.evaluate("zero", check, {"swap": 3}, recovered(), requests=2)
    assert r.verdict == NOT_RUN
    assert r.message.startswith("invalid: the fault did not fire (the injector's zero count read 0)")


def test_a_reset_under_corruption_is_broken_not_a_clear_failure():
    """Issue 40, hole 2d: every error that was not a timeout counted as "failed clearly", a
    connection reset included; the one classifier calls it broken, which breaks the promise."""
    failed = [
        ("1 herons", "http://x: ConnectionResetError: connection reset by peer", None, 0.4),
        # an HTTP status in the text of a request without one is no status: the record is read
        ("4 cranes", "http://x: RemoteDisconnected: 'HTTP 500' never came", None, 0.3),
        ("3 owls", "http://x: HTTP 500: boom", 500, 0.2),
    ]
    check = burst_result([("0 otters", False), ("2 lynxs", False)], failed=failed)
    r = corrupt.evaluate("zero", check, {"zero": 2}, recovered(), requests=5)
    assert r.verdict == FAIL and "2 request(s) got no HTTP answer (broken): '1 herons'" in r.message
    assert r.details["counts"][BROKEN] == 2 and r.details["counts"][FAILED_CLEARLY] == 1


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
        stalled=2,
        reached=2,
        got_token=0,
        injected={"stall": 2},
        left_s=0.3,
        queued=None,
        stall_ends_s=7.6,
        abort_bound_s=4.0,
        freed_s=0.4,
        held={"prefill-0": None, "decode-0": None},
        free_bound_s=13.0,
    )
    return stall_abort.Phase(**{**base, **kw})


def test_stall_abort_passes_when_the_abort_arrives_and_every_block_is_free_in_time():
    r = stall_abort.evaluate([phase(), phase("decode", freed_s=8.0)], recovered())
    assert r.verdict == PASS, r.message
    assert (
        "while the decode waited (stalled): the abort emptied its queues 0.3 s later (bound 4 s), "
        "every instance idle again 8.0 s later" in r.message
    )
    figures = {f.name: f.value for f in r.figures}
    assert figures["freed_after_decode_stall_s"] == 8.0 and figures["abort_reached_decode_s"] == 0.3
    assert [row[0] for row in r.tables[0].rows] == ["prefill", "decode"]
    assert [p["fired"] for p in r.details["proof"]] == [True, True]


NOT_ABORTED = "vllm:num_requests_waiting 2, vllm:num_requests_running 0"


@pytest.mark.parametrize(
    "decode",
    [
        # the abort never reached the decode: its requests stayed queued until the stall ended
        # (7.9-8.1 s after the disconnect, as the decode frees its blocks), past the bound
        phase("decode", left_s=None, queued=f"decode-0: {NOT_ABORTED}", freed_s=13.0),
        phase("decode", left_s=7.9, freed_s=8.0),
        # within the bound, but only once a stall could have ended: the stall, not the abort
        phase("decode", left_s=2.5, stall_ends_s=2.0, freed_s=2.6),
    ],
)
def test_stall_abort_fails_when_the_abort_does_not_reach_the_stalled_instance(decode):
    """Issue 40, hole 2e: the bound was 15 s, longer than the stall (8 s) plus the work, so a
    cluster that never propagated the abort passed; the queues must empty below the stall now."""
    r = stall_abort.evaluate([phase(), decode], recovered())
    assert r.verdict == FAIL, r.message
    assert "decode: the abort did not reach the decode" in r.message
    assert "only an abort that propagates empties the queues before" in r.message


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (
            phase(
                "decode", held={"decode-0": "KV cache usage 0.0400 (idle 0.0000, vllm:kv_cache_usage_perc)"}
            ),
            "13 s after 2 clients disconnected while the decode waited: decode-0: KV cache usage 0.0400",
        ),
        (phase(reached=1), "only 1/2 requests were seen waiting on the prefill (vllm:num_requests_waiting)"),
        (
            phase("decode", reached=0),
            "only 0/2 requests were seen waiting on the decode (vllm:num_requests_kv_fetch_by_stage",
        ),
        (phase(got_token=1), "1 stream(s) had a token before the disconnect"),
    ],
)
def test_stall_abort_fails_naming_the_instance_and_the_value(bad, says):
    r = stall_abort.evaluate([phase(), bad], recovered())
    assert r.verdict == FAIL and says in r.message, r.message


def test_a_stall_that_did_not_hold_every_request_is_not_run_invalid():
    """The proof is the injector's stall events on that side (the stalled load's event), one per
    request: fewer is NOT RUN (invalid), whatever else the phase saw."""
    r = stall_abort.evaluate([phase(), phase("decode", stalled=1, injected={"stall": 1})], recovered())
    assert r.verdict == NOT_RUN
    assert r.message == "invalid: the fault did not fire (the injector's stall events on the decode read 1)"


def test_a_stall_count_of_0_is_not_run_invalid_naming_the_count():
    r = stall_abort.evaluate(
        [phase(), phase("decode", stalled=0, reached=0, injected={}, left_s=0.3)], recovered()
    )
    assert r.verdict == NOT_RUN
    said = "invalid: the fault did not fire (the injector's stall events on the decode read 0)"
    assert r.message.startswith(said)


# The decode phase as the H200 with vLLM 0.26.0 recorded it (2026-12-05, nixl and mooncake alike):
# the injector stalled 2/2 requests, none was seen waiting on vllm:num_requests_kv_fetch_by_stage.
H200_DECODE = dict(
    stalled=2, reached=0, injected={"stall": 2}, left_s=0.374, stall_ends_s=1.389, freed_s=1.705
)


def test_a_stall_that_fired_but_was_not_seen_waiting_fails():
    r = stall_abort.evaluate([phase(), phase("decode", **H200_DECODE)], recovered())
    assert r.verdict == FAIL
    assert "decode: only 0/2 requests were seen waiting on the decode" in r.message


def test_a_stall_on_an_instance_without_the_gauge_is_not_run_naming_the_metric():
    """A vLLM whose decode exports no vllm:num_requests_kv_fetch_by_stage cannot show the requests
    waiting: NOT RUN (the scenario could not look), never FAIL; the stall's count is named."""
    r = stall_abort.evaluate([phase(), phase("decode", exported=False, **H200_DECODE)], recovered())
    assert r.verdict == NOT_RUN, r.message
    assert "the injector stalled 2/2 requests" in r.message
    assert "exported no vllm:num_requests_kv_fetch_by_stage" in r.message
    assert r.details["phases"][1]["metric_exported"] is False


def test_a_missing_gauge_hides_nothing_else_wrong_in_that_phase():
    """Without the gauge only the waiting is unseen: a token before the disconnect, or blocks
    still held after the bound, in the same phase still FAIL (not a NOT RUN that fails nothing)."""
    blind = dict(H200_DECODE, exported=False)
    token = stall_abort.evaluate([phase(), phase("decode", got_token=1, **blind)], recovered())
    assert token.verdict == FAIL and "decode: 1 stream(s) had a token before the disconnect" in token.message
    assert "seen waiting" not in token.message  # the unseen part is not claimed either way
    held = stall_abort.evaluate(
        [phase(), phase("decode", held={"decode-0": "3 KV blocks"}, **blind)], recovered()
    )
    assert held.verdict == FAIL and "decode-0: 3 KV blocks" in held.message


def test_a_decode_without_the_gauge_is_read_from_the_injectors_stall_lines():
    """vLLM 0.26's decode exports no KV fetch gauge; the injector holds back loads the decode's
    scheduler already scheduled, so its stall lines are requests waiting there for their KV."""
    gauge = stall_abort.decode_waits(2, [(1.0, True), (0.0, True)])
    assert gauge == (1, "")  # the gauge, where a decode exports it, wins over the lines
    assert stall_abort.decode_waits(2, [(0.0, False)]) == (2, stall_abort.INJECTOR_STALLS)


def test_a_decode_phase_seen_by_the_injector_is_judged_not_blind():
    seen = dict(H200_DECODE, exported=False, reached=2, seen_by=stall_abort.INJECTOR_STALLS)
    r = stall_abort.evaluate([phase(), phase("decode", **seen)], recovered())
    assert r.verdict == PASS, r.message
    assert r.details["phases"][1]["reached_metric"] == stall_abort.INJECTOR_STALLS
    assert f"while the decode waited (stalled; seen by {stall_abort.INJECTOR_STALLS})" in r.message
    late = stall_abort.evaluate([phase(), phase("decode", **dict(seen, left_s=None))], recovered())
    assert late.verdict == FAIL and "the abort did not reach the decode" in late.message


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
    by = peer_death.evaluate(
        "prefill-0",
        out,
        {"stall": 1},
        survivors(),
        waited_s=0.5,
        killed_after_s=0.1,
        policy="fail",
        waited_by=stall_abort.INJECTOR_STALLS,
    )
    assert f"waiting for its KV (seen by {stall_abort.INJECTOR_STALLS})" in by.message
    assert by.details["decode_waited_by"] == stall_abort.INJECTOR_STALLS


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
    ],
)
def test_peer_death_fails_naming_what_broke(victim, out, rec, says):
    r = peer_death.evaluate(victim, out, {"stall": 1}, rec, waited_s=0.5, killed_after_s=0.1, policy="fail")
    assert r.verdict == FAIL and says in r.message, r.message


def test_a_peer_death_where_nothing_was_killed_is_not_run_invalid():
    r = peer_death.evaluate(
        None, Outcome("x", CORRECT, 1.0, 200), {"stall": 1}, survivors(), waited_s=None, killed_after_s=None,
        policy="fail",
    )  # fmt: skip
    assert r.verdict == NOT_RUN and r.message.startswith(
        "invalid: the fault did not fire (the killed prefill's processes gone read no prefill killed: "
        "the decode never reported the request waiting for remote KV"
    )


def test_a_peer_death_whose_prefill_outlives_its_sigkill_is_not_run_invalid():
    """Seen over NIXL on a loaded host: the prefill's worker outlived its SIGKILL for minutes
    while the decode hung. The killed PID gone is the proof of this fault: the peer did not die,
    so the scenario is NOT RUN (invalid), naming the survivor, never PASS, even with a correct
    answer."""
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
    assert r.verdict == NOT_RUN
    assert (
        "(the killed prefill's processes gone read prefill-0 outlived its SIGKILL: processes survived"
        in r.message
    )
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
        killed_gone=True,
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
        killed_gone=True,
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
        killed_gone=True,
    )
    assert r.verdict == FAIL and "no request through the router was correct within 120 s" in r.message
    assert "last: failed clearly after 0.1 s (HTTP 503)" in r.message
    unproven = restart.evaluate(
        "prefill-0",
        ready_s=41.2,
        start_error=None,
        attempts=good,
        correct_s=42.0,
        recovery=recovered(),
        killed_here=False,
        bound_s=120,
        killed_gone=False,
    )
    assert unproven.verdict == NOT_RUN and unproven.message == (
        "invalid: the fault did not fire (the killed prefill-0's processes gone before the restart "
        "read not verified)"
    )


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
        killed_gone=True,
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


# ---------------------------------------------------------------- every fault proves it fired


def fake_scenario(*, declares_proof: bool = True):
    """A fault scenario of our own (issue 40, part 5), run through the gatherer every fault
    scenario runs under: its ``evaluate`` passes, and proves its fault by the injector's count
    that ``options["applied"]`` fakes."""
    from pd_sessions.checks.faults.promise import injector_count, proven
    from pd_sessions.checks.faults.scenario import gatherer

    def judged(injected):
        return CheckResult("fault_fake", PASS, "every request right", {"injected": dict(injected)})

    evaluate = proven(lambda d: [injector_count(d["injected"], "fake")])(judged) if declares_proof else judged

    @gatherer("fault_fake")
    def run(window, options):
        return evaluate({"fake": options["applied"]})

    return run


def decided(check: CheckResult, *, required=()):
    from pd_sessions.core.results import ConfigResult

    r = ConfigResult("1x1", "1xP(TP1) + 1xD(TP1)", "mooncake", "cpu")
    r.checks = [CheckResult("smoke", PASS, "fine"), check]
    r.decide(["smoke", check.name], required=required)
    return r


def test_a_fault_that_did_not_fire_is_not_run_invalid_and_fails_a_sweep_that_requires_it():
    from pd_sessions.core.results import FAILED, PASSED

    r = fake_scenario()(None, {"applied": 0})
    assert r.verdict == NOT_RUN and not r.passed
    assert r.message == "invalid: the fault did not fire (the injector's fake count read 0)"
    required = decided(r, required=["smoke", "fault_fake"])
    assert required.outcome == FAILED and required.unmet_checks == ["fault_fake"]
    assert required.unmet == [
        "fault_fake is required by the sweep and did not run: invalid: the fault did not fire "
        "(the injector's fake count read 0)"
    ]
    assert decided(r).label == "passed, 1 not run"  # added with --check: never plain green
    fired = fake_scenario()(None, {"applied": 2})
    assert fired.verdict == PASS and fired.details["proof"] == [
        {"what": "the injector's fake count", "value": 2, "fired": True}
    ]
    assert decided(fired, required=["smoke", "fault_fake"]).outcome == PASSED


def test_a_scenario_that_declares_no_proof_never_passes():
    r = fake_scenario(declares_proof=False)(None, {"applied": 2})
    assert r.verdict == NOT_RUN
    assert (
        r.message == "invalid: the fault did not fire (the scenario declared no proof that its fault fired)"
    )


def test_an_instance_killed_on_purpose_that_outlives_its_sigkill_is_not_run_invalid():
    from pd_sessions.checks.faults.scenario import gatherer
    from pd_sessions.core.errors import StopError

    @gatherer("fault_restart")
    def run(window, options):
        raise StopError("prefill-0 not started again: its killed processes are still alive (pid 7)")

    r = run(None, {})
    assert r.verdict == NOT_RUN and r.message.startswith(
        "invalid: the fault did not fire (the processes of the instance killed on purpose gone read "
        "prefill-0 not started again: its killed processes are still alive (pid 7))"
    )


def test_the_injectors_stall_lines_count_requests_not_lines():
    """With decode TP=2 each worker logs its own stall line for the same request: the decode's
    waiting, read from those lines (vLLM 0.26), counts each request once."""
    from pd_sessions.checks.faults.scenario import Scenario

    s = object.__new__(Scenario)
    lines = [
        {"mode": "stall", "side": "decode", "req": "r1"},
        {"mode": "stall", "side": "decode", "req": "r1"},  # rank 1's line
        {"mode": "stall", "side": "decode", "req": "r2", "applied": False},
        {"mode": "stall", "side": "prefill", "req": "r3"},
    ]
    s.events = lambda: lines  # type: ignore[method-assign]
    assert s.requests_held("stall", "decode") == 1
    assert stall_abort.decode_waits(s.requests_held("stall", "decode"), [(0.0, False)])[0] == 1
