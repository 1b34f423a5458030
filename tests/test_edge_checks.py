"""Unit tests of the edge checks' pure parts (issue 17): registry and selection, too_long,
cache_paths, burst, abort_frees_kv. Their gatherers run in test_faults.py (fake stack) and
test_e2e_cpu_lane.py (real vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import FIXTURES
from helpers.builders import comp

from pd_sessions.checks import abort_frees_kv, burst, cache_paths, too_long
from pd_sessions.checks.instances import KV_USAGE, RUNNING, gauges
from pd_sessions.core import check_registry as registry
from pd_sessions.core.config import load_sweep
from pd_sessions.core.errors import ConfigError
from pd_sessions.core.results import FAIL, PASS, CheckResult

# ---------------------------------------------------------------- registry and TOML selection


def test_defaults_are_every_check_in_running_order():
    assert registry.DEFAULTS == (
        "smoke",
        "parity",
        "kv_transfer",
        "pd_calls",
        "kv_capacity",
        "request_features",
        "cache_paths",
        "too_long",
        "burst",
        "abort_frees_kv",
        "accuracy",
        "conservation",
    )
    assert registry.resolve(None) == registry.DEFAULTS
    opt_in = ("preemption", "perf", *registry.FAULTS, *registry.WIRE, "soak")  # run when selected
    # kv_digest (a default on cpu only) then conservation: each judges the checks before it; then
    # hostile_clients (opt-in), after all: the KV it may leave held is its own verdict, not theirs
    assert (
        *registry.DEFAULTS[:-1],
        *opt_in,
        "kv_digest",
        "conservation",
        "hostile_clients",
    ) == registry.NAMES
    assert registry.defaults("cpu") == (*registry.DEFAULTS[:-1], "kv_digest", "conservation")
    assert registry.defaults("cuda") == (*registry.DEFAULTS[:-1], "perf", "conservation")


def test_selection_is_put_in_running_order():
    assert registry.resolve(["burst", "smoke"]) == ("smoke", "burst")


@pytest.mark.parametrize(
    "value,needle",
    [
        (["brust"], "unknown check 'brust' (did you mean \"burst\"?); known: smoke, parity"),
        ([], "an empty list runs no check"),
        (["smoke", "smoke"], "listed more than once"),
        ("smoke", "allowed: a list of check names"),
    ],
)
def test_selection_errors_name_the_field(value, needle):
    with pytest.raises(ConfigError) as e:
        registry.resolve(value, source="s.toml")
    assert needle in str(e.value) and e.value.field == "checks" and "s.toml" in str(e.value)


def test_options_defaults_and_overrides():
    opts = registry.resolve_options({"burst": {"requests": 8}})
    assert opts["burst"] == {"requests": 8, "max_tokens": 8}
    assert opts["too_long"]["bound_s"] == 10.0


@pytest.mark.parametrize(
    "raw,needle",
    [
        ({"brust": {}}, 'check_options.brust: unknown check (did you mean "burst"?)'),
        ({"burst": {"request": 3}}, 'check_options.burst.request: unknown option (did you mean "requests"?)'),
        ({"burst": {"requests": "32"}}, "check_options.burst.requests: got '32'; allowed: a positive int"),
        ({"burst": {"requests": 0}}, "allowed: a positive int"),
        ({"smoke": {"x": 1}}, "allowed: none (this check has no options)"),
    ],
)
def test_option_errors(raw, needle):
    with pytest.raises(ConfigError, match=None) as e:
        registry.resolve_options(raw)
    assert needle in str(e.value)


SWEEP = """name = "s"
{top}
[defaults]
model = "m"
[[config]]
name = "1x1"
{tail}
"""


def test_sweep_toml_selects_checks(tmp_path: Path):
    p = tmp_path / "s.toml"
    p.write_text(
        SWEEP.format(top='checks = ["too_long", "smoke"]', tail="[check_options.too_long]\nbound_s = 3")
    )
    sweep = load_sweep(p)
    assert sweep.checks == ("smoke", "too_long")
    assert sweep.check_options["too_long"] == {"bound_s": 3}


def test_sweep_toml_without_checks_gets_the_defaults(tmp_path: Path):
    p = tmp_path / "s.toml"
    p.write_text(SWEEP.format(top="", tail=""))
    assert load_sweep(p).checks == registry.DEFAULTS


def test_sweep_toml_typo_in_checks(tmp_path: Path):
    p = tmp_path / "s.toml"
    p.write_text(SWEEP.format(top='checks = ["cache_path"]', tail=""))
    with pytest.raises(ConfigError, match='did you mean "cache_paths"') as e:
        load_sweep(p)
    assert str(p) in str(e.value)


def test_builtin_sweeps_run_the_default_checks():
    from pd_sessions.core.config import builtin_sweep

    for name in ("mooncake_sweep", "nixl_sweep"):
        assert builtin_sweep(name).checks == registry.DEFAULTS


# ---------------------------------------------------------------- too_long

OK_HEALTH = {"prefill-0": "ok", "decode-0": "ok", "router": "ok"}


def tl(answer, health=OK_HEALTH, followup=None):
    return too_long.evaluate(
        answer, bound_s=10, prompt_tokens=2100, max_model_len=2048, health_after=health, followup=followup
    )


def test_too_long_4xx_in_time_passes():
    r = tl(too_long.Answer(400, 0.3, "maximum context length"))
    assert r.passed and "HTTP 400" in r.message and r.details["max_model_len"] == 2048


@pytest.mark.parametrize(
    "answer,needle",
    [
        (too_long.Answer(None, 10.0, "no answer within 10 s"), "got no answer within 10 s"),
        (too_long.Answer(400, 12.0), "only after 12.0 s"),
        (too_long.Answer(200, 0.5), "was accepted (HTTP 200)"),
        (too_long.Answer(500, 0.5, "Internal"), "got HTTP 500, expected a 4xx"),
    ],
)
def test_too_long_fails(answer, needle):
    r = tl(answer)
    assert not r.passed and needle in r.message


def test_too_long_unhealthy_instance_afterwards_fails_naming_it():
    r = tl(too_long.Answer(400, 0.2), health={**OK_HEALTH, "decode-0": "HTTP 503"})
    assert not r.passed and "decode-0 /health: HTTP 503" in r.message


def test_too_long_failed_followup_fails():
    r = tl(too_long.Answer(400, 0.2), followup="router: HTTP 500: boom")
    assert not r.passed and "a normal request through the router then failed" in r.message


# ---------------------------------------------------------------- cache_paths


def test_lengths_derive_from_the_block_size():
    assert cache_paths.lengths(128) == {"short": 64, "primed": 320, "partial": 512}
    assert cache_paths.lengths(16) == {"short": 8, "primed": 40, "partial": 64}
    for block in (16, 32, 128):
        want = cache_paths.lengths(block)
        assert cache_paths.situation_errors("short", want["short"], block) == []
        assert cache_paths.situation_errors("primed", want["primed"], block) == []
        assert (
            cache_paths.situation_errors("partial", want["partial"], block, primed_tokens=want["primed"])
            == []
        )


def test_situations_that_would_not_arise_are_named():
    assert "not fewer than one block" in cache_paths.situation_errors("short", 128, 128)[0]
    assert "fewer than two blocks" in cache_paths.situation_errors("primed", 200, 128)[0]
    errs = cache_paths.situation_errors("partial", 400, 128, primed_tokens=320, prefix_ok=False)
    assert len(errs) == 2 and "do not start with the primed" in errs[1]


def sit(name, pd=(1, 2), base=(1, 2)):
    return cache_paths.Situation(name, 10, 128, "x direct", comp(pd), comp(base))


def test_cache_paths_all_identical_passes():
    r = cache_paths.evaluate([sit("short"), sit("primed"), sit("partial")])
    assert r.passed and "3/3" in r.message


def test_cache_paths_full_hit_on_decode_differs_fails():
    r = cache_paths.evaluate([sit("short"), sit("primed", pd=(1, 9)), sit("partial")])
    assert not r.passed and "1/3 situations differ: primed" in r.message and "differ at token 1" in r.message


def test_cache_paths_missing_situation_or_build_error_fails():
    assert not cache_paths.evaluate([sit("short")]).passed
    r = cache_paths.evaluate([], ["short prompt has 130 tokens"])
    assert not r.passed and "could not build" in r.message


# ---------------------------------------------------------------- burst

KV_OK = CheckResult("kv_transfer", PASS, "decode received 320 prompt tokens", {"delta": 320})
KV_BAD = CheckResult(
    "kv_transfer", FAIL, "decode instances received 0 prompt tokens by KV transfer", {"delta": 0}
)


def test_burst_passes():
    pairs = [(f"p{i}", comp((i, 1)), comp((i, 1))) for i in range(4)]
    r = burst.evaluate(pairs, [], KV_OK, requests=4, seconds=1.0, max_tokens=2)
    assert r.passed and "4/4 concurrent requests succeeded" in r.message


def test_burst_one_wrong_under_concurrency_fails():
    pairs = [(f"p{i}", comp((i, 1)), comp((i, 1 if i else 2))) for i in range(4)]
    r = burst.evaluate(pairs, [], KV_OK, requests=4, seconds=1.0, max_tokens=2)
    assert not r.passed and "1/4 prompts differ" in r.message


def test_burst_failed_request_and_recompute_both_reported():
    pairs = [(f"p{i}", comp(), comp()) for i in range(3)]
    failed = [burst.Failure("p3", "http://x: HTTP 500", 500, 0.1, 60.0)]
    r = burst.evaluate(pairs, failed, KV_BAD, requests=4, seconds=1.0, max_tokens=2)
    assert (
        not r.passed
        and "1/4 requests failed" in r.message
        and "KV proof: decode instances received 0" in r.message
    )


def test_burst_prompts_are_distinct_from_the_first_word():
    ps = burst.prompts(32)
    assert len({p.split()[0] for p in ps}) == 32


# ---------------------------------------------------------------- abort_frees_kv

IDLE = {RUNNING: 0.0, KV_USAGE: 0.0}


@pytest.mark.parametrize(
    "now,needle",
    [
        ({RUNNING: 0.0, KV_USAGE: 0.0}, None),
        ({RUNNING: 2.0, KV_USAGE: 0.01}, "2 requests still running"),
        ({RUNNING: 0.0, KV_USAGE: 0.05}, "KV cache usage 0.0500 (idle 0.0000"),
        ({KV_USAGE: 0.0}, "metric vllm:num_requests_running not exposed"),
    ],
)
def test_settled(now, needle):
    got = abort_frees_kv.settled(IDLE, now)
    assert got == needle if needle is None else needle in got


def test_abort_pass_and_failure_naming_instance_and_value():
    ok = abort_frees_kv.evaluate(
        4, 4, [], {"prefill-0": None, "decode-0": None}, bound_s=15, waited_s=0.4, last={}
    )
    assert ok.passed
    bad = abort_frees_kv.evaluate(
        4,
        4,
        [],
        {"prefill-0": "KV cache usage 0.0100 (idle 0.0000, ...)", "decode-0": None},
        bound_s=15,
        waited_s=15,
        last={},
    )
    assert not bad.passed
    assert "15 s after 4 clients disconnected: prefill-0: KV cache usage 0.0100" in bad.message


def test_abort_streams_that_never_started_fail():
    r = abort_frees_kv.evaluate(2, 4, ["HTTP 500", "HTTP 500"], {}, bound_s=15, waited_s=0, last={})
    assert not r.passed and "only 2/4 streams" in r.message


def test_gauges_from_a_real_decode_scrape():
    g = gauges((FIXTURES / "decode_metrics_after.txt").read_text(), (RUNNING, KV_USAGE))
    assert g == {RUNNING: 0.0, KV_USAGE: 0.0}
    assert abort_frees_kv.settled(IDLE, g) is None


# ---------------------------------------------------------------- per-instance counting (xPyD)

from pd_sessions.checks import instances  # noqa: E402

ROLES_2P2D = {"prefill": 2, "decode": 2}


def test_every_instance_served_passes_and_counts_are_recorded():
    before = {"prefill-0": 0, "prefill-1": 0, "decode-0": 0, "decode-1": 0}
    after = {"prefill-0": 30, "prefill-1": 20, "decode-0": 25, "decode-1": 25}
    r = instances.apply_served(
        CheckResult("kv_transfer", PASS, "ok"), before, after, requests=5, roles=ROLES_2P2D
    )
    assert r.passed and r.details["served_by_instance"]["prefill-1"] == 20


def test_an_ignored_instance_fails_naming_it():
    before = {"prefill-0": 0, "prefill-1": 7, "decode-0": 0, "decode-1": 0}
    after = {"prefill-0": 50, "prefill-1": 7, "decode-0": 25, "decode-1": 25}
    r = instances.apply_served(
        CheckResult("parity", PASS, "4/4 identical"), before, after, requests=4, roles=ROLES_2P2D
    )
    assert not r.passed and r.message.startswith("prefill-1 served none of 4 router requests")
    assert "the router ignores it; 4/4 identical" in r.message


@pytest.mark.parametrize(
    "requests,roles,expect",
    [
        (5, {"prefill": 1, "decode": 1}, []),  # one instance per role: the KV proof covers it
        (1, {"prefill": 2, "decode": 1}, []),  # fewer requests than instances: not judged
        (2, {"prefill": 2, "decode": 1}, ["prefill-1"]),
    ],
)
def test_idle_instances_decision_table(requests, roles, expect):
    before = {"prefill-0": 0, "prefill-1": 0, "decode-0": 0}
    after = {"prefill-0": 9, "prefill-1": 0, "decode-0": 9}
    assert instances.idle_instances(before, after, requests=requests, roles=roles) == expect


def test_prefill_tokens_from_a_real_scrape():
    assert instances.prefill_tokens((FIXTURES / "decode_metrics_after.txt").read_text()) == 24.0


def test_tokens_sent_straight_to_a_prefill_do_not_count_as_served_by_the_router():
    # prefill-0 only got parity's direct baseline requests (30 tokens); the router ignored it
    before = {"prefill-0": 0, "prefill-1": 0, "decode-0": 0}
    after = {"prefill-0": 30, "prefill-1": 30, "decode-0": 30}
    r = instances.apply_served(
        CheckResult("parity", PASS, "ok"),
        before,
        after,
        requests=4,
        roles={"prefill": 2, "decode": 1},
        direct={"prefill-0": 30},
    )
    assert not r.passed and r.message.startswith("prefill-0 served none of 4 router requests")
    assert r.details["served_by_instance"] == {"prefill-0": 0, "prefill-1": 30, "decode-0": 30}
