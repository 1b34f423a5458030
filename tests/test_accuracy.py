from __future__ import annotations

import json

import pytest
from helpers import FIXTURES

from pd_sessions.checks import accuracy as acc
from pd_sessions.core.errors import ConfigError

QWEN = acc.Baseline(model="Qwen/Qwen3-0.6B", task="gsm8k", value=0.41, samples=1319, rtol=0.05)


def test_baselines_file_is_seeded_with_upstream_values():
    bs = acc.load_baselines()
    values = {b.model: b.value for b in bs}
    assert values["Qwen/Qwen3-0.6B"] == 0.41 and values["google/gemma-4-E2B-it"] == 0.485
    assert values["deepseek-ai/DeepSeek-V4-Flash"] == 0.95 and len(bs) == 11
    assert all(b.task == "gsm8k" and b.key == "exact_match,strict-match" and b.rtol == 0.05 for b in bs)
    assert all(b.source for b in bs)
    assert acc.find_baseline(bs, "google/gemma-4-E2B-it", "gsm8k").endpoint == "chat"


def test_missing_baseline_fails_with_how_to_record():
    assert acc.find_baseline(acc.load_baselines(), "moonshotai/Kimi-Linear-48B-A3B-Instruct", "gsm8k") is None
    msg = acc.missing_baseline_message("moonshotai/Kimi-Linear-48B-A3B-Instruct", "gsm8k")
    assert "--record-baseline" in msg and "cannot pass" in msg and "--accuracy=warn" in msg


@pytest.mark.parametrize(
    "measured,ok",
    [(0.41, True), (0.3895, True), (0.4305, True), (0.389, False), (0.431, False), (0.2, False)],
)
def test_two_sided_tolerance(measured, ok):
    r = acc.compare(measured, 1319, QWEN)
    assert r.passed is ok, r.message


def test_wilson_gate_on_fixed_numbers():
    assert acc.wilson_lower(50, 100) == pytest.approx(0.4038, abs=1e-4)
    assert acc.wilson_lower(0, 10) == pytest.approx(0.0, abs=1e-12)
    # 0.41 measured on 1319 samples: lower bound ~0.384 >= 0.41*0.95=0.3895? no -> fail
    assert not acc.compare(0.41, 1319, QWEN, rule="wilson").passed
    # 0.45 measured on 1319: lower bound ~0.423 >= 0.3895 -> pass
    r = acc.compare(0.45, 1319, QWEN, rule="wilson")
    assert r.passed and r.details["wilson_lower"] == pytest.approx(0.4233, abs=1e-3)


def test_sample_limit_mismatch_refused_unless_allowed():
    r = acc.compare(0.41, 200, QWEN)
    assert not r.passed and "refused" in r.message and "1319" in r.message
    assert acc.compare(0.41, 200, QWEN, allow_sample_mismatch=True).passed


def test_warn_mode_passes_but_says_so():
    r = acc.compare(0.2, 1319, QWEN, mode="warn")
    assert r.passed and r.message.startswith("WARNING (--accuracy=warn)")
    assert r.details["verdict_without_warn"] == "fail"


def test_unknown_rule():
    with pytest.raises(ConfigError, match="allowed: tolerance, wilson"):
        acc.compare(0.4, 1319, QWEN, rule="bayes")


def test_model_args_completions_chat_remote_code():
    assert acc.model_args(model="Qwen/Qwen3-0.6B", base_url="http://127.0.0.1:9000") == (
        "model=Qwen/Qwen3-0.6B,base_url=http://127.0.0.1:9000/v1/completions,num_concurrent=100,"
        "tokenized_requests=False"
    )
    chat = acc.model_args(model="google/gemma-4-E2B-it", base_url="http://h:1", endpoint="chat")
    assert "base_url=http://h:1/v1/chat/completions" in chat and "tokenizer_backend=huggingface" in chat
    assert acc.lm_eval_model("chat") == "local-chat-completions"
    trc = acc.model_args(
        model="m", base_url="http://h:1", trust_remote_code=True, revision="abc", num_concurrent=8
    )
    assert trc.endswith("num_concurrent=8,tokenized_requests=False,trust_remote_code=True,revision=abc")


def test_read_recorded_lm_eval_output():
    """Recorded from lm_eval 0.4.13 local-completions through a CPU-lane P/D router (tiny model)."""
    doc = json.loads((FIXTURES / "lm_eval_pd_arith_results.json").read_text())
    value, n = acc.read_result(doc, "pd_arith", "exact_match,strict-match")
    assert value == 0.0 and n == 24
    with pytest.raises(KeyError, match="has no pd_arith/exact_match,flexible"):
        acc.read_result(doc, "pd_arith", "exact_match,flexible")


def test_sample_identity():
    assert acc.compare_samples(
        {0: [["a"]], 1: [["b"]]}, {0: [["a"]], 1: [["b"]]}, baseline="prefill-0"
    ).passed
    r = acc.compare_samples({0: [["a"]], 1: [["b"]]}, {0: [["a"]], 1: [["c"]]}, baseline="prefill-0")
    assert not r.passed and "1/2 samples differ" in r.message and r.details["differing_doc_ids"] == [1]
    assert not acc.compare_samples({}, {}, baseline="x").passed


def test_record_baseline_round_trips_any_value_through_a_toml_writer(tmp_path):
    path = tmp_path / "baselines.toml"
    path.write_text('# kept comment\n[[baseline]]\nmodel = "a"\ntask = "gsm8k"\nvalue = 0.5\n')
    odd = acc.Baseline(model='org/we"ird\\name', task="gsm8k", value=0.123456, samples=None, rtol=0.1)
    acc.record_baseline(path, odd, command="nox -s x -- --set 'a=\"b\"'", date="2026-11-29")
    got = acc.find_baseline(acc.load_baselines(path), odd.model, "gsm8k")
    assert got is not None and got.value == 0.1235 and got.samples is None and got.rtol == 0.1
    assert got.source == "recorded 2026-11-29 by: nox -s x -- --set 'a=\"b\"'"
    assert path.read_text().startswith("# kept comment") and len(acc.load_baselines(path)) == 2
    with pytest.raises(ConfigError, match="already has a baseline"):
        acc.record_baseline(path, odd, command="c", date="d")
