"""hostile_clients' verdict (pd_sessions/checks/hostile_clients.py evaluate, pure): each broken promise
fed in fails, naming the case and entry point (a victim answered wrong, a hostile request got a 5xx or
hung, a KV block held, a process died); a clear 4xx refusal and a right answer pass; a case that could
not be sent is NOT RUN in the table, not a pass of its own. Also the connector specs' client
parameters, the bending of a transfer's parameters, and the known issues the check reproduces."""

from __future__ import annotations

import time

from pd_sessions.checks import hostile_clients as hc
from pd_sessions.checks.completions import Completion
from pd_sessions.core import check_registry, connectors, known_issues
from pd_sessions.core.results import FAIL, NOT_RUN, PASS, XFAIL

DEADLINE = 8.0
OK_COMPLETION = Completion("text", (1, 2), 5, 8, "length", (9, 9, 9))


def ok() -> hc.Sent:
    return hc.Sent(200, 0.1, completion=OK_COMPLETION)


def idle() -> hc.Aftermath:
    return hc.Aftermath({"prefill-0": "ok", "decode-0": "ok", "router": "ok"}, 0.3, 5.0, {})


def verdict(*outcomes: hc.Outcome, after: hc.Aftermath | None = None):
    return hc.evaluate(list(outcomes), after or idle(), deadline_s=DEADLINE)


def test_a_clear_4xx_refusal_and_right_answers_pass():
    r = verdict(
        hc.Outcome("not_an_object", "decode", hc.Sent(400, 0.01, "Input should be a valid dictionary")),
        hc.Outcome("live_id", "router", ok(), ok()),
        hc.Outcome("replayed", "decode", ok(), ok()),
    )
    assert r.verdict == PASS, r.message
    assert r.details["failures"] == []
    assert r.details["router_params"] == "replaced"
    assert [row["verdict"] for row in r.details["table"]] == ["pass", "pass", "pass"]
    assert r.tables and r.tables[0].rows[0][:3] == ("not_an_object", "decode", "400")


def test_a_victim_answered_wrong_fails_naming_the_case_and_entry_point():
    r = verdict(hc.Outcome("live_id", "decode", ok(), ok(), victim_wrong="tokens differ at position 0"))
    assert r.verdict == FAIL
    assert "live_id via decode: victim wrong answer" in r.message
    assert r.details["failures"] == ["live_id@decode: victim wrong answer"]
    assert r.details["failed_cases"] == ["live_id@decode"]


def test_a_victim_that_hangs_or_errs_fails():
    r = verdict(
        hc.Outcome("live_id", "decode", ok(), hc.Sent(None, DEADLINE, "no answer within 8 s")),
        hc.Outcome("duplicate_own", "prefill", ok(), hc.Sent(500, 0.1, "Internal server error")),
    )
    assert r.verdict == FAIL
    assert "live_id via decode: victim hang" in r.message
    assert "duplicate_own via prefill: victim HTTP 500" in r.message


def test_a_hostile_5xx_fails():
    r = verdict(hc.Outcome("unknown_engine", "decode", hc.Sent(500, 0.03, "Internal server error")))
    assert r.verdict == FAIL
    assert "unknown_engine via decode: HTTP 500" in r.message
    assert r.details["failures"] == ["unknown_engine@decode: HTTP 500"]


def test_a_hostile_hang_fails():
    r = verdict(hc.Outcome("oversized", "decode", hc.Sent(None, DEADLINE, "no answer within 8 s")))
    assert r.verdict == FAIL
    assert "oversized via decode: hang (no answer within 8 s)" in r.message


def test_a_4xx_without_a_message_and_a_wrong_200_fail():
    r = verdict(
        hc.Outcome("wrong_types", "prefill", hc.Sent(400, 0.01, "")),
        hc.Outcome("replayed", "decode", ok(), ok(), hostile_wrong="tokens differ"),
    )
    assert r.verdict == FAIL
    assert "wrong_types via prefill: HTTP 400 without a message" in r.message
    assert "replayed via decode: wrong answer" in r.message


def test_a_kv_block_held_after_the_cases_fails_naming_the_instance():
    held = hc.Aftermath(
        {"prefill-0": "ok", "decode-0": "ok", "router": "ok"},
        None,
        5.0,
        {"prefill-0": {"vllm:kv_cache_usage_perc": 0.002}},
    )
    r = verdict(hc.Outcome("duplicate_own", "prefill", ok(), ok()), after=held)
    assert r.verdict == FAIL
    assert "prefill-0 not idle 5 s after the cases (KV block held): kv_cache_usage_perc 0.002" in r.message
    assert r.details["failures"] == r.details["failed_cases"] == ["KV held on prefill-0"]


def test_a_process_that_died_fails_naming_it():
    dead = hc.Aftermath({"prefill-0": "ok", "decode-0": "connection refused", "router": "ok"}, 0.1, 5.0, {})
    r = verdict(
        hc.Outcome("wrong_types", "decode", hc.Sent(500, 0.01, "EngineCore encountered an issue")), after=dead
    )
    assert r.verdict == FAIL
    assert "decode-0 /health: connection refused" in r.message
    assert "decode-0 unhealthy" in r.details["failures"]


def test_a_case_not_sent_is_recorded_not_run_and_nothing_sent_is_not_run():
    one = hc.Outcome("block_ids_out_of_range", "decode", not_sent="no block ids")
    r = verdict(one, hc.Outcome("replayed", "decode", ok(), ok()))
    assert r.verdict == PASS
    assert "not sent: block_ids_out_of_range via decode" in r.message
    assert r.details["table"][0]["verdict"] == "not run"
    assert verdict(one).verdict == NOT_RUN


def test_the_router_passing_client_params_on_shows():
    r = verdict(hc.Outcome("unknown_engine", "router", hc.Sent(500, 0.1, "x")))
    assert r.details["router_params"] == "not replaced: unknown_engine"


def test_bent_parameters_change_one_key_or_say_why_not():
    mc, nx = connectors.MOONCAKE.client_params, connectors.NIXL.client_params
    assert mc is not None and nx is not None
    base = {"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "e"}
    assert hc._bent("unknown_engine", base, mc) == {**base, "remote_engine_id": hc.NO_ENGINE}
    assert isinstance(hc._bent("block_ids_out_of_range", base, mc), hc.Cannot)
    assert hc._bent("block_ids_out_of_range", base, nx)["remote_block_ids"] == hc.OUT_OF_RANGE
    assert len(hc._bent("oversized", base, mc)["transfer_id"]) == hc.OVERSIZED
    assert hc._bent("not_an_object", base, mc) == "not-an-object"
    assert hc._bent("replayed", base, mc) == base


def test_every_connector_names_its_client_params_and_what_it_does_not_send():
    for spec in connectors.ALL:
        cp = spec.client_params
        assert cp is not None, spec.name
        for case, entry, why in cp.not_sent:
            assert case in (*hc.DECODE_CASES, *hc.PREFILL_CASES) and entry in hc.ENTRIES
            issue = known_issues.get(why.rsplit("known issue ", 1)[-1].split()[0])  # an entry of the registry
            # about this connector, or one whose client parameters it shares (push mode: pull's)
            assert connectors.get(issue.connector).client_params == cp, (spec.name, issue.id)
            assert not issue.check and issue.handled  # not judged by a check: handled by not sending it


def test_registered_last_with_bounded_options():
    assert check_registry.NAMES[-1] == "hostile_clients"
    assert check_registry.BY_NAME["hostile_clients"].options == {"deadline_s": 6.0, "idle_s": 4.0}
    assert not check_registry.BY_NAME["hostile_clients"].default


def test_the_known_issues_judge_the_failures_seen_as_xfail_and_another_failure_as_fail():
    """Each entry whose check is hostile_clients turns the failures it describes into XFAIL, all
    of them or some (each case reproduces most, not all, of the time); one failure beside them (a
    case through the router) is a FAIL that names the entry."""
    entries = [e for e in known_issues.load() if e.check == "hostile_clients"]
    assert entries
    for e in entries:
        r = hc.evaluate([], idle(), deadline_s=DEADLINE)
        r.verdict = FAIL
        for c in e.fails_when:
            r.details[c.detail] = list(c.subset_of) if c.subset_of is not None else c.equals
        assert known_issues.judge(r, e, "0.32.0").verdict == XFAIL
        r.details["failed_cases"] = r.details["failed_cases"][1:]
        assert known_issues.judge(r, e, "0.32.0").verdict == XFAIL
        r.details["failed_cases"] = [*r.details["failed_cases"], "replayed@router"]
        other = known_issues.judge(r, e, "0.32.0")
        assert other.verdict == FAIL and e.id in other.message


def test_the_router_cases_are_sent_before_any_case_straight_to_an_instance(monkeypatch):
    """A forged pull straight to a Mooncake decode can block the pulls after it, the router's too:
    the router's phase ends before the direct one starts, and the table keeps its order."""
    seen: list[str] = []

    def case(entry: str, c: str) -> hc.Outcome:
        if entry == "router":  # slower than the direct cases: sent together, they would end first
            time.sleep(0.2)
        seen.append(entry)
        return hc.Outcome(c, entry)

    monkeypatch.setattr(hc, "decode_case", lambda s, cp, c, e, consumed: case(e, c))
    monkeypatch.setattr(hc, "prefill_case", lambda s, cp, c: case("prefill", c))
    out = hc.send_all(None, connectors.MOONCAKE.client_params, {})  # type: ignore[arg-type]
    n = len(hc.DECODE_CASES)
    assert seen[:n] == ["router"] * n and "router" not in seen[n:]
    assert [(o.case, o.entry) for o in out] == [(c, "router") for c in hc.DECODE_CASES] + [
        (c, "decode") for c in hc.DECODE_CASES
    ] + [(c, "prefill") for c in hc.PREFILL_CASES]
