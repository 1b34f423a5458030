"""cache_paths and burst compare P/D outputs the way parity does: token for token when prefill
and decode share a numeric layout, teacher-forced within the margin when they do not."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from helpers.builders import comp

from pd_sessions.checks import burst, cache_paths, parity
from pd_sessions.checks.completions import Completion
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.results import PASS, CheckResult

MARGIN = parity.Judge("margin", "numeric layouts differ: TP2 bfloat16 vs TP1 bfloat16", 1.0)
EXACT = parity.Judge("exact", "same layout", 1.0)
KV_OK = CheckResult("kv_transfer", PASS, "decode instances received 10 of 10 prompt tokens", {"delta": 10})


PD = comp((5, 6), "x", prompt_ids=(1, 2, 3))  # a P/D answer: tokens 5, 6 after the prompt 1, 2, 3


def forced(*gaps):
    """Forced scores of tokens 5, 6, ...: gap 0 = the reference's own top-1."""
    return tuple(
        parity.ForcedToken(
            i, 5 + i, -1.0 - g, 1 if g == 0 else 2, f"t{5 + i}", 5 + i if g == 0 else 99, -1.0, "top"
        )
        for i, g in enumerate(gaps)
    )


def situations(primed_ref, partial_ref):
    return [
        cache_paths.Situation("short", 64, 128, "prefill-0 direct", PD, forced(0, 0)),
        cache_paths.Situation("primed", 320, 128, "decode-0 direct", PD, primed_ref),
        cache_paths.Situation("partial", 512, 128, "prefill-0 direct", PD, partial_ref),
    ]


def test_judge_follows_the_config_like_parity():
    assert parity.Judge.for_config(ClusterConfig(name="c", model="tiny-llama")).mode == "exact"
    j = parity.Judge.for_config(
        ClusterConfig(name="c", model="tiny-llama", prefill_tp=2, dtype="bfloat16", parity_margin=0.5)
    )
    assert j.mode == "margin" and j.margin == 0.5 and "TP2 bfloat16" in j.why


def test_cache_paths_margin_mode_passes_near_ties_and_says_so():
    r = cache_paths.evaluate(situations(forced(0, 0.4), forced(0.9, 0)), judge=MARGIN, max_tokens=2)
    assert r.passed, r.message
    assert "within 1 nats" in r.message and "margin mode" in r.message
    assert r.details["mode"] == "margin" and r.details["situations"][2]["comparison"][
        "max_gap"
    ] == pytest.approx(0.9)


def test_cache_paths_margin_mode_fails_beyond_the_margin_naming_situation_and_position():
    r = cache_paths.evaluate(situations(forced(0, 0), forced(0, 2.5)), judge=MARGIN, max_tokens=2)
    assert not r.passed
    assert "1/3 situations differ: partial (512 tokens, block 128)" in r.message
    assert "position 1: P/D token 6" in r.message and "gap 2.5000 > margin 1" in r.message


def test_cache_paths_exact_mode_is_unchanged():
    r = cache_paths.evaluate(
        [
            cache_paths.Situation(n, 64, 128, "prefill-0 direct", PD, PD)
            for n in ("short", "primed", "partial")
        ]
    )
    assert r.passed and "identical token for token" in r.message and r.details["mode"] == "exact"
    bad = cache_paths.evaluate(
        [
            cache_paths.Situation(
                n,
                64,
                128,
                "prefill-0 direct",
                PD,
                comp((5, 7) if n == "primed" else (5, 6), "x", prompt_ids=(1, 2, 3)),
            )
            for n in ("short", "primed", "partial")
        ]
    )
    assert not bad.passed and "primed" in bad.message and "differ at token 1" in bad.message


def test_a_reference_of_the_wrong_kind_is_a_programming_error():
    with pytest.raises(TypeError, match="margin mode needs forced scores"):
        cache_paths.evaluate(situations(PD, forced(0, 0)), judge=MARGIN)
    with pytest.raises(TypeError, match="exact mode needs"):
        parity.judge(EXACT, [("p", PD, forced(0, 0))], baseline="ref", max_tokens=2)


def test_burst_margin_mode():
    good = [(f"p{i}", PD, forced(0, 0.3)) for i in range(4)]
    r = burst.evaluate(good, [], KV_OK, requests=4, seconds=1.0, max_tokens=2, judge=MARGIN)
    assert r.passed and "each within 1 nats of prefill-direct's top-1" in r.message
    bad = [*good[:3], ("p3", PD, forced(3.0, 0))]
    r = burst.evaluate(bad, [], KV_OK, requests=4, seconds=1.0, max_tokens=2, judge=MARGIN)
    assert not r.passed and "1/4 prompts diverge" in r.message and "'p3' position 0" in r.message


class _Scorer(BaseHTTPRequestHandler):
    """Answers /v1/completions like vLLM with prompt_logprobs: every forced token is the top-1
    except token 6, which sits 2 nats below token 99."""

    seen: ClassVar[list[dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        if body.get("prompt_logprobs"):
            plp: list = [None]
            for tok in body["prompt"][1:]:
                if tok == 6:
                    plp.append({"6": {"logprob": -3.0, "rank": 2}, "99": {"logprob": -1.0, "rank": 1}})
                else:
                    plp.append({str(tok): {"logprob": -0.5, "rank": 1}})
            out = {"choices": [{"text": "", "prompt_logprobs": plp}]}
        else:
            out = {"choices": [{"text": "ab", "token_ids": [5, 6]}], "usage": {"prompt_tokens": 3}}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def scorer():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Scorer)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _Scorer.seen = []
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_reference_requests_by_mode(scorer):
    pd = PD
    ref = parity.reference(MARGIN, scorer, "m", "prompt", pd, max_tokens=2, timeout=5)
    assert _Scorer.seen[-1]["prompt"] == [1, 2, 3, 5, 6] and _Scorer.seen[-1]["max_tokens"] == 1
    assert isinstance(ref, tuple) and [t.gap for t in ref] == [0.0, 2.0]
    assert parity.prompt_tokens_sent(pd, ref) == 5
    r = parity.judge(MARGIN, [("prompt", pd, ref)], baseline="prefill-0 direct", max_tokens=2)
    assert not r.passed and "position 1: P/D token 6" in r.message

    own = parity.reference(EXACT, scorer, "m", "prompt", pd, max_tokens=2, timeout=5)
    assert _Scorer.seen[-1]["prompt"] == "prompt" and isinstance(own, Completion)
    assert own.token_ids == (5, 6) and parity.prompt_tokens_sent(pd, own) == 3
    assert parity.judge(EXACT, [("prompt", pd, own)], baseline="prefill-0 direct", max_tokens=2).passed


def test_margin_reference_without_token_ids_says_why(scorer):
    with pytest.raises(ValueError, match="return_token_ids unsupported"):
        parity.reference(
            MARGIN, scorer, "m", "p", Completion("x", None, 3, 2, "length"), max_tokens=2, timeout=5
        )


# ------------------------------------------------------------------ issue 40, hole 2c


def test_margin_mode_fails_a_truncated_answer_whose_tokens_are_top1():
    """A 200 with 1 token where 8 were asked with ignore_eos: every token it has is the
    reference's top-1, yet exact mode would have compared 8 tokens ending in 'length'. Before
    issue 40 this passed (margin mode looked at the tokens only)."""
    short = comp((5,), "x", prompt_ids=(1, 2, 3))
    r = parity.judge(MARGIN, [("p", short, forced(0))], baseline="prefill-0 direct", max_tokens=8)
    assert not r.passed
    assert "the P/D answer has 1 of the 8 tokens asked with ignore_eos" in r.message, r.message
    assert parity.judge(MARGIN, [("p", PD, forced(0, 0))], baseline="ref", max_tokens=2).passed


def test_margin_mode_fails_an_answer_that_stopped_for_another_reason():
    stopped = Completion("x", (5, 6), 3, 2, "stop", (1, 2, 3))  # as long as asked, but it stopped
    r = parity.judge(MARGIN, [("p", stopped, forced(0, 0))], baseline="ref", max_tokens=2)
    assert not r.passed and "finish_reason 'stop', not 'length'" in r.message, r.message


def test_a_truncated_burst_answer_fails_in_margin_mode():
    short = comp((5,), "x", prompt_ids=(1, 2, 3))
    pairs = [*((f"p{i}", PD, forced(0, 0)) for i in range(3)), ("p3", short, forced(0))]
    r = burst.evaluate(pairs, [], KV_OK, requests=4, seconds=1.0, max_tokens=2, judge=MARGIN)
    assert not r.passed and "'p3': the P/D answer has 1 of the 2 tokens" in r.message, r.message
