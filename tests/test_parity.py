"""Layout-aware parity: mode choice, exact and margin verdicts, failure messages."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import FIXTURES
from helpers.builders import cfg

from pd_sessions.checks import parity
from pd_sessions.checks.completions import Completion
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import ConfigError

# A real vLLM 0.32 (CPU) answer to prompt [5, 6, 7, 8, 9] with prompt logprobs (top-1):
# none of tokens 6..9 is the random tiny model's own choice there (ranks 709, 456, 429, 595).
REAL = json.loads((FIXTURES / "prompt_logprobs_response.json").read_text())


MOE = {"model": "tiny-mixtral", "moe": True}


@pytest.mark.parametrize(
    "kw, mode",
    [
        ({}, "exact"),
        ({"prefill_tp": 2, "decode_tp": 2}, "exact"),
        ({"prefill_tp": 2, "decode_tp": 1}, "margin"),
        ({"decode_dp": 2}, "margin"),
        ({"expert_parallel": True}, "margin"),
        ({"prefill_tp": 2, "decode_dp": 2, "expert_parallel": True, "dtype": "bfloat16"}, "margin"),
        ({"parity_mode": "margin"}, "margin"),
        ({"prefill_tp": 2, "parity_mode": "exact"}, "exact"),
    ],
)
def test_mode_follows_the_layouts(kw, mode):
    got, why = parity.choose_mode(cfg(**MOE, **kw))
    assert got == mode and why


def test_mode_reason_names_both_layouts():
    _, why = parity.choose_mode(cfg(**MOE, prefill_tp=2, decode_dp=2, expert_parallel=True, dtype="bfloat16"))
    assert "TP2 bfloat16" in why and "TP1 DP2 EP bfloat16" in why


def test_config_rejects_bad_parity_fields():
    with pytest.raises(ConfigError, match=r"parity_mode.*allowed: auto, exact, margin"):
        cfg(**MOE, parity_mode="loose")
    with pytest.raises(ConfigError, match="parity_margin"):
        cfg(**MOE, parity_margin=-1)
    with pytest.raises(ConfigError, match=r"decode_weights_seed.*only for the generated tiny models"):
        ClusterConfig(name="c", model="Qwen/Qwen3-0.6B", decode_weights_seed=1)


def test_teacher_force_payload_forces_the_pd_tokens():
    p = parity.teacher_force_payload("m", [1, 2], [3, 4])
    assert p["prompt"] == [1, 2, 3, 4] and p["prompt_logprobs"] == 1 and p["max_tokens"] == 1


def test_real_response_tokens_far_below_top1_fail_with_names_and_logprobs():
    toks = parity.forced_tokens(REAL, 1, [6, 7, 8, 9])
    assert [t.rank for t in toks] == [709, 456, 429, 595]
    assert toks[0].top_token == 740 and toks[0].top_text == " 951"
    r = parity.evaluate_margin(
        [("Row prompt", toks)], margin=parity.DEFAULT_MARGIN, baseline="prefill-0 direct"
    )
    assert not r.passed
    assert (
        "prompt 'Row prompt' position 0: P/D token 6 '$' (logprob -7.7697, rank 709) vs reference "
        "top-1 740 ' 951' (logprob -4.1133): gap 3.6564 > margin 1 (+3 more beyond the margin)"
    ) in r.message
    assert r.details["mode"] == "margin" and r.details["margin"] == 1.0


def test_config_default_margin_is_the_evidenced_one():
    assert cfg(**MOE).parity_margin == parity.DEFAULT_MARGIN


def entry(tok, lp, top=None, top_lp=None, rank=1):
    d = {str(tok): {"logprob": lp, "rank": rank, "decoded_token": f"t{tok}"}}
    if top is not None:
        d[str(top)] = {"logprob": top_lp, "rank": 1, "decoded_token": f"t{top}"}
    return d


def resp(entries):
    return {"choices": [{"prompt_logprobs": [None, *entries]}]}


def test_top1_and_near_ties_pass_and_are_counted():
    r_ = resp([entry(10, -1.0), entry(11, -2.0, top=12, top_lp=-1.9, rank=2)])
    toks = parity.forced_tokens(r_, 1, [10, 11])
    r = parity.evaluate_margin([("p", toks)], margin=0.25, baseline="ref", why="layouts differ")
    assert r.passed, r.message
    assert "all 2 P/D tokens" in r.message and "1 near-ties" in r.message and "layouts differ" in r.message
    assert r.details["max_gap"] == pytest.approx(0.1)
    assert r.details["prompts"][0]["not_top1"][0]["ref_token"] == 12


def test_margin_is_a_bound_not_a_pass():
    toks = parity.forced_tokens(resp([entry(11, -2.0, top=12, top_lp=-1.5, rank=2)]), 1, [11])
    assert not parity.evaluate_margin([("p", toks)], margin=0.25, baseline="ref").passed
    assert parity.evaluate_margin([("p", toks)], margin=0.6, baseline="ref").passed


def test_margin_empty_completion_or_no_prompts_fail():
    assert not parity.evaluate_margin([("p", [])], margin=1, baseline="ref").passed
    assert not parity.evaluate_margin([], margin=1, baseline="ref").passed


def test_missing_prompt_logprobs_is_an_error():
    with pytest.raises(ValueError, match="no prompt_logprobs"):
        parity.forced_tokens({"choices": [{"text": "x"}]}, 3, [1])


def test_exact_mode_records_its_reason():
    c = Completion("abc", (1, 2), 3, 2, "length")
    r = parity.evaluate_exact([("p", c, c)], baseline="ref", why="same layout")
    assert r.passed and r.details["mode"] == "exact" and "same layout" in r.message
    r = parity.evaluate_exact([("p", c, dataclasses.replace(c, token_ids=(1, 3)))], baseline="ref")
    assert not r.passed and "differ at token 1" in r.message
