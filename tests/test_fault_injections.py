"""The verdicts of the injections of issue 41, part 2 (pure): fault_mixup (another request's whole
KV), fault_truncate (a 200 cut short) and fault_partial_recompute (the decode computes part of the
prompt). Each passes only when the harness caught every injected request, fails when one slipped
through (the can-fail case: as if the check were told to ignore it), and is NOT RUN when its fault
did not fire. The rules the checks themselves gained (smoke and exact parity read the
finish_reason) are here too. The e2e runs are in tests/test_e2e_faults.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers.builders import comp

from pd_sessions.checks import burst, kv_digest, parity, smoke
from pd_sessions.checks.faults import mixup, recompute, truncate
from pd_sessions.checks.faults.promise import CORRECT, FAILED_CLEARLY, HUNG, WRONG, Outcome, Recovery
from pd_sessions.core import check_registry, faults
from pd_sessions.core.kv_identity import Counts
from pd_sessions.core.results import FAIL, NOT_RUN, PASS, CheckResult


def recovered(ok: bool = True) -> Recovery:
    probe = Outcome("probe", CORRECT, 0.2, 200, "x")
    health = {"decode-0": "ok" if ok else "connection refused", "router": "ok"}
    return Recovery(health, {"decode-0": None}, probe, 0.5, 30)


def burst_result(rows, verdict=FAIL, failed=()):
    failures = [burst.Failure(p, e, status, s, 60.0) for p, e, status, s in failed]
    return CheckResult(
        "burst",
        verdict,
        "4 concurrent requests: ...",
        {
            "parity": {"prompts": [{"prompt": p, "same": s} for p, s in rows]},
            "failures": [f.to_dict() for f in failures],
        },
    )


# ---------------------------------------------------------------- fault_mixup


def test_mixup_passes_when_parity_caught_every_request_and_reports_both_rates():
    check = burst_result([("0 otters", False), ("1 herons", False)])
    r = mixup.evaluate(check, ["d1", "d2"], recovered(), requests=2, digest_caught=["d2", "d1", "other"])
    assert r.verdict == PASS, r.message
    assert "caught 2/2; parity: 2 of 2 compared differ" in r.message and "the KV digest 2/2" in r.message
    assert r.details["detection"] == {"parity": "2/2", "kv_digest": "2/2"}


def test_mixup_passes_on_the_digest_when_parity_lets_one_through_within_its_margin():
    check = burst_result([("0 otters", False), ("1 herons", True)])
    r = mixup.evaluate(check, ["d1", "d2"], recovered(), requests=2, digest_caught=["d1", "d2"])
    assert r.verdict == PASS and r.details["parity_detected"] == 1 and r.details["digest_detected"] == 2


@pytest.mark.parametrize("digest", [None, ["d1"]])
def test_a_mixed_up_answer_that_passes_every_comparison_fails_the_scenario(digest):
    """The can-fail case: one mixed-up request passed parity (as if told to ignore it) and the
    digest did not catch it either (or did not run)."""
    check = burst_result([("0 otters", False), ("1 herons", True)])
    r = mixup.evaluate(check, ["d1", "d2"], recovered(), requests=2, digest_caught=digest)
    assert r.verdict == FAIL, r.message
    assert "1 of 2 requests answered from another request's KV not shown caught by parity" in r.message
    assert "neither caught every one" in r.message


def test_parity_differing_on_a_request_not_mixed_up_does_not_count_as_caught():
    """The burst names no request ids: one mixed-up request answered the same while another,
    not mixed up, differs (parity sees 1 of 2 differ) is not the mixed-up one caught."""
    check = burst_result([("0 otters", True), ("1 herons", False)])
    for digest in (None, []):
        r = mixup.evaluate(check, ["d1"], recovered(), requests=2, digest_caught=digest)
        assert r.verdict == FAIL, r.message
        assert r.details["parity_detected"] == 0 and r.details["detection"]["parity"] == "0/1"
        assert "1 of 2 compared differ" in r.message and "1 of 1 requests" in r.message
    # every request of the burst differs: the mixed-up one is among them, caught without the digest
    every = burst_result([("0 otters", False), ("1 herons", False)])
    r = mixup.evaluate(every, ["d1"], recovered(), requests=2, digest_caught=None)
    assert r.verdict == PASS and r.details["parity_detected"] == 1 and "caught 1/1" in r.message
    # a request not compared (failed clearly) may be the mixed-up one: not caught
    failed = burst_result([("0 otters", False)], failed=[("1 herons", "HTTP 500", 500, 0.1)])
    assert mixup.evaluate(failed, ["d1"], recovered(), requests=2, digest_caught=None).verdict == FAIL


def test_mixup_fails_on_a_hung_request_or_a_cluster_not_whole_again():
    hung = burst_result([("0 otters", False)], failed=[("1 herons", "no answer within 60 s", None, 60.0)])
    r = mixup.evaluate(hung, ["d1"], recovered(), requests=2, digest_caught=["d1"])
    assert r.verdict == FAIL and "1 request(s) hung" in r.message and r.details["counts"][HUNG] == 1
    r = mixup.evaluate(
        burst_result([("0 otters", False)]), ["d1"], recovered(False), requests=1, digest_caught=None
    )
    assert r.verdict == FAIL and "decode-0: /health connection refused" in r.message


def test_a_mixup_that_did_not_fire_is_not_run_invalid():
    r = mixup.evaluate(
        burst_result([("0 otters", True)], PASS), [], recovered(), requests=1, digest_caught=[]
    )
    assert r.verdict == NOT_RUN and "the injector's mixup count read 0" in r.message


def test_the_digest_check_counts_a_mixup_as_an_injected_corruption():
    line = faults.event_line(epoch="e", mode="mixup", req="d7", applied=True)
    skipped = faults.event_line(epoch="e", mode="mixup", req="d8", applied=False)
    assert kv_digest.injected_requests([f"{line}\n{skipped}\n"]) == {"d7": "mixup"}


# ---------------------------------------------------------------- fault_truncate


def answer(kind=WRONG, tokens=2, finish="length", smoke_said="router returned 2 tokens, expected 8"):
    return truncate.Judged(Outcome("Truncated answer 0", kind, 0.3, 200, "ab"), tokens, finish, smoke_said)


def test_truncate_passes_when_parity_and_smoke_failed_every_cut_answer():
    r = truncate.evaluate(
        [answer(), answer()], {"truncate": 2}, recovered(), max_tokens=8, parity_mode="exact"
    )
    assert r.verdict == PASS, r.message
    assert "2 of 8 tokens, finish_reason 'length'" in r.message
    assert "parity (exact mode) failed 2/2, smoke 2/2" in r.message


@pytest.mark.parametrize(
    ("bad", "hole"),
    [
        (answer(kind=CORRECT), "passed parity"),  # as if parity were told to ignore it
        (answer(smoke_said=None), "passed smoke"),
        (answer(kind=CORRECT, smoke_said=None), "passed parity and smoke"),
    ],
)
def test_a_truncated_200_that_a_check_lets_through_fails_the_scenario(bad, hole):
    r = truncate.evaluate([answer(), bad], {"truncate": 2}, recovered(), max_tokens=8, parity_mode="margin")
    assert r.verdict == FAIL and hole in r.message and "a 200 with 2 of 8 tokens" in r.message, r.message


def test_truncate_fails_on_a_hang_and_on_no_200_at_all():
    hung = truncate.Judged(Outcome("t", HUNG, 61.0, None, "no answer within 60 s"), None, None, None)
    r = truncate.evaluate([answer(), hung], {"truncate": 2}, recovered(), max_tokens=8, parity_mode="exact")
    assert r.verdict == FAIL and "'t': hung" in r.message
    err = truncate.Judged(Outcome("t", FAILED_CLEARLY, 0.1, 500, "HTTP 500"), None, None, None)
    r = truncate.evaluate([err], {"truncate": 1}, recovered(), max_tokens=8, parity_mode="exact")
    assert r.verdict == FAIL and "no request got a 200 to judge" in r.message


def test_a_truncation_that_did_not_fire_is_not_run_invalid():
    full = answer(kind=CORRECT, tokens=8, smoke_said=None)
    r = truncate.evaluate([full], {"truncate_skipped": 1}, recovered(), max_tokens=8, parity_mode="exact")
    assert r.verdict == NOT_RUN and "the injector's truncate count read 0" in r.message
    assert "without its fault the scenario saw: FAIL" in r.message


# ---- what the checks themselves say of a truncated or broken 200 (both parity modes, and smoke)

FULL = comp(ids=range(8), text="abcdefgh")


@pytest.mark.parametrize(
    ("got", "says"),
    [
        (comp(ids=(0, 1), text="ab"), "returned 2 tokens, expected 8"),
        (replace(FULL, finish_reason="error"), "finish_reason 'error', not 'length'"),
        (replace(FULL, finish_reason=None), "finish_reason None, not 'length'"),
        (replace(FULL, text=""), "empty text"),
    ],
)
def test_smoke_fails_a_truncated_empty_or_errored_200(got, says):
    r = smoke.evaluate(got, max_tokens=8)
    assert r.verdict == FAIL and says in r.message, r.message


def test_smoke_still_passes_a_whole_answer():
    assert smoke.evaluate(FULL, max_tokens=8).passed


@pytest.mark.parametrize(
    ("got", "says"),
    [
        (comp(ids=(0, 1), text="ab"), "differ at token 2 (2 vs 8 tokens"),
        (comp(ids=(), text=""), "differ at token 0 (0 vs 8 tokens"),
        # every token right, but the server said the generation failed: not the same answer
        (replace(FULL, finish_reason="error"), "finish_reason 'error' vs prefill-0 'length'"),
    ],
)
def test_exact_parity_fails_a_truncated_empty_or_errored_200(got, says):
    r = parity.judge(
        parity.Judge("exact", "same layout", 1.0), [("p", got, FULL)], baseline="prefill-0", max_tokens=8
    )
    assert r.verdict == FAIL and says in r.message, r.message


def forced(n: int) -> tuple[parity.ForcedToken, ...]:
    """The reference's scores of ``n`` P/D tokens, each its top-1 (a truncation changes no token)."""
    return tuple(parity.ForcedToken(i, i, -0.1, 1, "x", i, -0.1, "x") for i in range(n))


@pytest.mark.parametrize(
    ("got", "scores", "says"),
    [
        (comp(ids=(0, 1), text="ab"), forced(2), "has 2 of the 8 tokens asked"),
        (replace(FULL, finish_reason="error"), forced(8), "finish_reason 'error', not 'length'"),
        (comp(ids=(), text=""), forced(0), "the P/D completion had no tokens"),
    ],
)
def test_margin_parity_fails_a_truncated_empty_or_errored_200_whose_tokens_are_top1(got, scores, says):
    """The hole the principal issue named: a truncated answer whose few tokens are all the
    reference's top-1 is within any margin; its length and finish_reason fail it."""
    j = parity.Judge("margin", "layouts differ", 1.0)
    r = parity.judge(j, [("p", got, scores)], baseline="prefill-0", max_tokens=8)
    assert r.verdict == FAIL and says in r.message, r.message


# ---------------------------------------------------------------- fault_partial_recompute

IDENTITY = "mooncake: external_kv_transfer = prompt - 0 - decode cache hit, local_compute = 0 per request"


def row(seen: Counts, kind=CORRECT, wrong="local_compute 8, expected 0") -> recompute.Accounted:
    return recompute.Accounted(Outcome("Partly recomputed 0", kind, 0.3, 200, "x"), 20, seen, wrong)


def test_partial_recompute_passes_when_the_accounting_named_every_request():
    rows = [row(Counts(12, 0, 8)), row(Counts(12, 0, 8))]
    r = recompute.evaluate(rows, {"recompute": 2}, recovered(), identity=IDENTITY)
    assert r.verdict == PASS, r.message
    assert (
        "the KV accounting caught 2/2, e.g. 'Partly recomputed 0': local_compute 8, expected 0" in r.message
    )


def test_a_partial_recompute_the_accounting_misses_fails_naming_the_request_and_its_counts():
    """The can-fail case: the counts kept the identity (as if the accounting were told to ignore
    the recomputed tokens)."""
    rows = [row(Counts(12, 0, 8)), row(Counts(20, 0, 0), wrong=None)]
    r = recompute.evaluate(rows, {"recompute": 2}, recovered(), identity=IDENTITY)
    assert r.verdict == FAIL, r.message
    assert (
        "'Partly recomputed 0': the accounting missed it (20 prompt tokens: external_kv_transfer 20"
        in r.message
    )


def test_a_partial_recompute_that_changes_the_answer_fails():
    r = recompute.evaluate(
        [row(Counts(12, 0, 8), kind=WRONG)], {"recompute": 1}, recovered(), identity=IDENTITY
    )
    assert r.verdict == FAIL and "a partly recomputed prompt still gives the right answer" in r.message


def test_a_partial_recompute_that_did_not_fire_is_not_run_invalid():
    rows = [row(Counts(20, 0, 0), wrong=None)]
    r = recompute.evaluate(rows, {"recompute_skipped": 1}, recovered(), identity=IDENTITY)
    assert r.verdict == NOT_RUN and "the injector's recompute count read 0" in r.message


def test_the_kv_accounting_names_a_partly_recomputed_request():
    """What the scenario runs per request: kv_transfer's identity over its counts."""
    from pd_sessions.checks import kv_transfer

    d: dict = {}
    why = kv_transfer.counters_verdict(
        Counts(12, 0, 8), {}, d, prompt_tokens=20, requests=1, connector="nixl", ssm=False
    )
    assert why is not None and "external_kv_transfer 12, expected 20; local_compute 8, expected 0" in why
    assert kv_transfer.counters_verdict(Counts(20, 0, 0), {}, {}, prompt_tokens=20, requests=1,
                                        connector="nixl", ssm=False) is None  # fmt: skip


def test_the_three_are_fault_scenarios_never_defaults():
    for name in ("fault_mixup", "fault_truncate", "fault_partial_recompute"):
        info = check_registry.BY_NAME[name]
        assert info.faults and not info.default and name in check_registry.FAULTS


def test_exact_parity_fails_a_200_without_a_finish_reason_and_ignores_a_reference_without_one():
    j = parity.Judge("exact", "same layout", 1.0)
    r = parity.judge(j, [("p", replace(FULL, finish_reason=None), FULL)], baseline="prefill-0", max_tokens=8)
    assert r.verdict == FAIL and "finish_reason None vs prefill-0 'length'" in r.message
    assert parity.judge(
        j, [("p", FULL, replace(FULL, finish_reason=None))], baseline="prefill-0", max_tokens=8
    ).passed
