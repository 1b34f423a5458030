"""checks/preemption (pure verdict) and the preemption sweep's plan: a decode with fewer KV
blocks than its burst needs."""

from __future__ import annotations

from pd_sessions.checks import preemption
from pd_sessions.core import check_registry as registry
from pd_sessions.core.config import builtin_sweep
from pd_sessions.core.results import FAIL, PASS, CheckResult

BURST_OK = CheckResult(
    "burst", PASS, "8/8 concurrent requests succeeded in 3.1 s, each identical to prefill-direct"
)


def test_preemptions_with_a_passing_burst_pass():
    r = preemption.evaluate(BURST_OK, 5.0, requests=8)
    assert r.passed and r.message.startswith("the decodes preempted 5 times during 8/8 concurrent requests")
    assert {f.name: f.value for f in r.figures} == {"requests": 8, "preemptions": 5.0}


def test_no_preemption_fails_the_config_did_not_test_what_it_is_for():
    r = preemption.evaluate(BURST_OK, 0.0, requests=8)
    assert (
        r.verdict == FAIL
        and "no request was preempted" in r.message
        and "--num-gpu-blocks-override" in r.message
    )
    assert not preemption.evaluate(BURST_OK, None, requests=8).passed


def test_a_preempted_request_that_differs_fails():
    bad = CheckResult("burst", FAIL, "8 concurrent requests: 1/8 prompts differ: prompt '3 bisons' ...")
    r = preemption.evaluate(bad, 3.0, requests=8)
    assert not r.passed and "1/8 prompts differ" in r.message


def test_the_preemption_sweep_gives_the_decode_a_small_kv_cache_and_selects_the_check():
    sweep = builtin_sweep("preemption")
    assert sweep.checks == ("smoke", "preemption") and "preemption" not in registry.DEFAULTS
    (c, *_) = [e.config for e in sweep.entries("cpu")]
    assert c.decode_extra_args == ("--num-gpu-blocks-override", "8") and c.block_size == 32
    blocks, block = int(c.decode_extra_args[1]), c.block_size
    opts = sweep.check_options["preemption"]
    # each request needs ceil((about 25 prompt + max_tokens) / block) blocks: the burst needs more
    need = opts["requests"] * -(-(25 + opts["max_tokens"]) // block)
    assert need > 2 * blocks and c.max_model_len <= (blocks - 1) * block  # one is vLLM's null block
