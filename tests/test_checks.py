from __future__ import annotations

import json

import pytest
from conftest import FIXTURES
from helpers import comp

from pd_sessions.checks import evidence, instances, kv_transfer, smoke
from pd_sessions.checks.completions import Completion
from pd_sessions.checks.parity import evaluate_exact as evaluate_parity


def test_completion_from_recorded_router_response():
    c = Completion.from_response(json.loads((FIXTURES / "router_completion.json").read_text()))
    assert c.completion_tokens == 16 and len(c.token_ids) == 16 and c.prompt_tokens > 5
    assert smoke.evaluate(c).passed


def test_smoke_wrong_length_fails():
    r = smoke.evaluate(comp(ids=(1, 2)), max_tokens=16)
    assert not r.passed and "returned 2 tokens, expected 16" in r.message


def test_smoke_empty_text_fails():
    assert not smoke.evaluate(comp(ids=range(16), text=""), max_tokens=16).passed


def test_parity_identical_passes():
    r = evaluate_parity([("p1", comp(), comp()), ("p2", comp((4, 5)), comp((4, 5)))], baseline="prefill-0")
    assert r.passed and "2/2 prompts identical" in r.message


def test_parity_reports_first_differing_token():
    r = evaluate_parity(
        [("p1", comp((1, 2, 3)), comp((1, 9, 3))), ("p2", comp(), comp())], baseline="prefill-0"
    )
    assert not r.passed
    assert "1/2 prompts differ" in r.message and "differ at token 1" in r.message


def test_parity_falls_back_to_text_without_ids():
    r = evaluate_parity([("p", comp(None, "hello"), comp(None, "help"))], baseline="b")
    assert not r.passed and "differ at char 3" in r.message


def test_parity_empty_output_is_not_a_pass():
    assert not evaluate_parity([("p", comp(()), comp(()))], baseline="b").passed
    assert not evaluate_parity([], baseline="b").passed


def test_external_tokens_from_real_scrapes():
    before = instances.external_tokens((FIXTURES / "decode_metrics_before.txt").read_text())
    after = instances.external_tokens((FIXTURES / "decode_metrics_after.txt").read_text())
    resp = json.loads((FIXTURES / "router_completion.json").read_text())
    # one router request between the scrapes: its whole prompt arrived by transfer
    assert after - before == resp["usage"]["prompt_tokens"]


def test_external_tokens_missing_metric():
    text = '# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{engine="0"} 3.0\n'
    with pytest.raises(instances.MetricMissing, match="not exposed"):
        instances.external_tokens(text)


def test_external_tokens_sums_engines():
    text = (
        "# TYPE vllm:prompt_tokens_by_source counter\n"
        'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 5.0\n'
        'vllm:prompt_tokens_by_source_total{engine="1",source="external_kv_transfer"} 7.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 100.0\n'
    )
    assert instances.external_tokens(text) == 12.0


# success evidence for the tests of the counter rules: a Mooncake stats line of 5 transfers
OK = evidence.Evidence("mooncake", log_stats={"prefill-0": {"Num successful transfers": 5}})


def test_kv_pass_and_control():
    r = kv_transfer.evaluate(
        {"decode-0": 10},
        {"decode-0": 110},
        router_prompt_tokens=100,
        router_requests=5,
        control=("decode-0", 110, 110),
        evidence=OK,
    )
    assert r.passed and "left it unchanged" in r.message


def test_kv_silent_recompute_fails_with_values():
    r = kv_transfer.evaluate({"decode-0": 10}, {"decode-0": 10}, router_prompt_tokens=100, router_requests=5)
    assert not r.passed
    assert "received 0 prompt tokens" in r.message and "100 prompt tokens" in r.message
    assert r.details["before"] == {"decode-0": 10} and r.details["after"] == {"decode-0": 10}


def test_kv_one_missed_request_fails():
    # 5 requests of 20 tokens; one recomputed locally -> 80 < 100 - 5
    r = kv_transfer.evaluate({"d": 0}, {"d": 80}, router_prompt_tokens=100, router_requests=5)
    assert not r.passed


def test_kv_slack_of_one_token_per_request():
    assert kv_transfer.evaluate(
        {"d": 0}, {"d": 95}, router_prompt_tokens=100, router_requests=5, evidence=OK
    ).passed


def test_kv_sums_decode_instances():
    r = kv_transfer.evaluate(
        {"d0": 0, "d1": 0}, {"d0": 60, "d1": 40}, router_prompt_tokens=100, router_requests=4, evidence=OK
    )
    assert r.passed and r.details["delta"] == 100


def test_kv_control_moving_fails():
    r = kv_transfer.evaluate(
        {"d": 0},
        {"d": 100},
        router_prompt_tokens=100,
        router_requests=4,
        control=("d", 100, 130),
        evidence=OK,
    )
    assert not r.passed and "does not tell transfers apart" in r.message


def test_kv_no_requests_fails():
    assert not kv_transfer.evaluate({"d": 0}, {"d": 0}, router_prompt_tokens=0, router_requests=0).passed
