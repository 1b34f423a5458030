"""pd_sessions.checks.window (the check window) and the runner's order, on a fake 1P1D cluster
whose HTTP side is our own fake: no server runs."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pd_sessions.checks import accuracy as acc
from pd_sessions.checks import instances, runner
from pd_sessions.checks.parity import PARITY_PROMPTS
from pd_sessions.checks.smoke import SMOKE_PROMPT
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import check_registry as registry
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import ConfigError
from pd_sessions.core.kv_identity import Counts
from pd_sessions.core.results import FAIL, PASS, XPASS, CheckResult
from pd_sessions.runtime import http
from pd_sessions.runtime.launcher import LOCAL

ROUTER, P0, D0 = "http://router", "http://prefill-0", "http://decode-0"
STATS = "INFO KV Transfer metrics: Num successful transfers=1, Num failed transfers=0\n"


class FakeStack:
    """A 1P1D Mooncake cluster's HTTP side. Through the router a request's prompt tokens are
    computed on prefill-0 and arrive on decode-0 by KV transfer (prefill-0 logs a stats line);
    a request straight to an instance is computed there. Each prompt word is one token. Every
    request is logged in ``calls`` ("GET decode-0", "POST router", ...)."""

    def __init__(self, run_dir):
        def spec(name):
            return SimpleNamespace(
                name=name, url=f"http://{name}", log_name=f"{name}.log", host="127.0.0.1", bootstrap_port=4242
            )

        self.run_dir = run_dir
        self.calls: list[str] = []
        self.external = 0.0  # decode-0's external-KV prompt tokens
        self.computed = 0.0  # prefill-0's computed prompt tokens
        self.router_hangs = False
        self.decode_lacks_the_metric = False
        p0, d0 = spec("prefill-0"), spec("decode-0")
        plan = SimpleNamespace(
            prefill=(p0,),
            decode=(d0,),
            instances=(p0, d0),
            router=SimpleNamespace(name="router", url=ROUTER),
            served_model_name="m",
            config=ClusterConfig(name="c", model="tiny-llama", connector="mooncake"),
            platform="cpu",
        )
        self.cluster = SimpleNamespace(plan=plan, run_dir=run_dir, launcher=LOCAL)

    def get_text(self, url, *, timeout=5.0):
        name = url.split("/")[2]
        self.calls.append(f"GET {name}")
        if name == "decode-0" and self.decode_lacks_the_metric:
            return '# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{engine="0"} 0.0\n'
        counter = self.external if name == "decode-0" else 0.0
        return (
            "# TYPE vllm:prompt_tokens_by_source counter\n"
            f'vllm:prompt_tokens_by_source_total{{engine="0",source="external_kv_transfer"}} {counter}\n'
            "# TYPE vllm:prompt_tokens counter\n"
            f'vllm:prompt_tokens_total{{engine="0"}} {self.computed if name == "prefill-0" else 0.0}\n'
        )

    def completion(self, base_url, model, prompt, *, max_tokens, timeout=120.0):
        self.calls.append(f"POST {base_url.split('/')[2]}")
        n = len(prompt.split())
        if base_url == ROUTER:
            if self.router_hangs:
                raise http.HttpError(f"{ROUTER}/v1/completions", f"no answer within {timeout:g} s")
            self.external += n
            with open(self.run_dir / "prefill-0.log", "a") as f:
                f.write(STATS)
        if base_url in (ROUTER, P0):
            self.computed += n
        return {
            "choices": [{"text": "abc", "token_ids": list(range(max_tokens)), "finish_reason": "length"}],
            "usage": {"prompt_tokens": n, "completion_tokens": max_tokens},
        }


@pytest.fixture
def fake(tmp_path, monkeypatch):
    stack = FakeStack(tmp_path)
    monkeypatch.setattr(http, "get_text", stack.get_text)
    monkeypatch.setattr(http, "completion", stack.completion)
    return stack


def recorder(fake, seen):
    """A gatherer that records its name, its options and how many requests came before it."""

    def gather(name):
        def run(window, options):
            seen.append((name, dict(options), len(fake.calls)))
            return CheckResult(name, PASS, "recorded")

        return run

    return gather


def words(*prompts):
    return sum(len(p.split()) for p in prompts)


# ---------------------------------------------------------------- the window


def test_open_scrapes_the_decodes_and_starts_the_evidence(fake):
    fake.external = 7.0
    w = CheckWindow.open(fake.cluster, [], timeout_s=2.0)
    assert w.decode_before == {"decode-0": Counts(external=7.0)} and w.errors == []
    assert w.evidence is not None and w.evidence.connector == "mooncake"
    assert fake.calls == ["GET decode-0"]


def test_open_records_a_failed_scrape_and_the_checks_still_run(fake):
    fake.decode_lacks_the_metric = True
    w = CheckWindow.open(fake.cluster, [], timeout_s=2.0)
    assert w.decode_before == {} and w.evidence is None
    assert len(w.errors) == 1 and "not exposed" in w.errors[0]


def test_router_requests_are_in_the_ledger_direct_ones_are_not(fake):
    w = CheckWindow.open(fake.cluster, [], timeout_s=2.0)
    c = w.via_router("one two three")
    assert c.prompt_tokens == 3 and c.completion_tokens == 16
    w.complete(D0, "four five")
    assert (w.router_requests, w.router_tokens) == (1, 3)
    w.sent_direct("prefill-0", 5)
    w.sent_direct("prefill-0", 2.5)
    assert w.direct == {"prefill-0": 7.5}


def test_served_counters_are_read_once_when_first_asked(fake):
    w = CheckWindow.open(fake.cluster, [], timeout_s=2.0)
    fake.computed = 4.0
    assert w.served_start() == {"prefill-0": 4.0, "decode-0": 0.0}
    fake.computed = 9.0
    assert w.served_start() == {"prefill-0": 4.0, "decode-0": 0.0}
    assert fake.calls == ["GET decode-0", "GET prefill-0", "GET decode-0"]


def test_a_failed_served_scrape_is_one_of_the_windows_errors(fake):
    w = CheckWindow.open(fake.cluster, [], timeout_s=2.0)
    fake.decode_lacks_the_metric = True
    assert w.served_start() == {} and "not exposed" in w.errors[0]


def test_timed_records_each_result_with_its_seconds(fake):
    results = []
    w = CheckWindow.open(fake.cluster, results, timeout_s=2.0)

    def slow():
        time.sleep(0.05)
        return CheckResult("a", PASS, "ok")

    def broken():
        raise ValueError("a bug")

    def metric_missing():
        raise instances.MetricMissing("vllm:x not exposed")

    def refused():
        raise http.HttpError(P0, "connection refused")

    def misconfigured():
        raise ConfigError("f", "bad")

    w.timed("a", slow)
    w.timed("b", broken)
    w.timed("c", metric_missing)
    w.timed("d", refused)
    assert [r.name for r in results] == ["a", "b", "c", "d"]
    assert results[0].passed and results[0].seconds >= 0.05
    assert results[1].message == "crashed: ValueError: a bug (traceback in checks.log)"
    assert results[2].message == "could not run: vllm:x not exposed"
    assert results[3].message == f"could not run: {P0}: connection refused"
    assert w.stuck is None  # no failure above was a timeout
    with pytest.raises(ConfigError):
        w.timed("e", misconfigured)  # a PdError: the config errs, not the check


def test_a_request_with_no_answer_makes_the_path_stuck_and_fails_the_rest_at_once(fake):
    results = []
    w = CheckWindow.open(fake.cluster, results, timeout_s=2.0)
    fake.router_hangs = True
    w.timed("smoke", lambda: runner.GATHERERS["smoke"](w, {}))
    assert results[0].verdict == FAIL and "no answer within 2 s; stuck: " in results[0].message
    assert results[0].details["stuck"] == "no instance reports a running or deferred request"
    assert w.stuck == "smoke got no answer within 2 s: no instance reports a running or deferred request"
    w.timed("parity", lambda: pytest.fail("a check is not called once the path is stuck"))
    assert results[1].message == f"not run: the P/D path is stuck ({w.stuck})"


def test_a_known_bugs_hang_judged_xfail_does_not_make_the_path_stuck(fake):
    """Issue 40, part 2: Mooncake's pull from a dead prefill hangs (XFAIL); fault_restart after it
    must still run to reproduce its own known bug. A hang judged FAIL still makes the path stuck."""
    from pd_sessions.core.results import XFAIL

    def hang() -> CheckResult:
        return CheckResult("fault_peer_death", FAIL, "hung after 60.1 s: 'no answer within 60 s'")

    def xfail(r: CheckResult) -> CheckResult:
        return CheckResult(r.name, XFAIL, f"still broken upstream: LINK: {r.message}", r.details)

    results: list[CheckResult] = []
    w = CheckWindow.open(fake.cluster, results, timeout_s=2.0)
    w.timed("fault_peer_death", hang, judge=xfail)
    assert results[0].verdict == XFAIL and w.stuck is None and "stuck" not in results[0].details
    w.timed("fault_peer_death", hang, judge=lambda r: r)  # judged FAIL: stuck, as before
    assert results[1].verdict == FAIL and w.stuck is not None and "; stuck: " in results[1].message


# ---------------------------------------------------------------- the runner's order


def test_the_runner_runs_every_check_in_order_around_one_window(fake, monkeypatch):
    seen = []
    gather = recorder(fake, seen)
    for name in (
        "pd_calls",  # their own gatherers: tests/test_hop_faults.py
        "kv_capacity",
        "request_features",
        "cache_paths",
        "too_long",
        "burst",
        "abort_frees_kv",
        "accuracy",
        "preemption",
        "perf",
        *registry.FAULTS,
        *registry.WIRE,
        "kv_digest",
        "hostile_clients",
    ):
        monkeypatch.setitem(runner.GATHERERS, name, gather(name))
    results = []
    # conservation's probes after every check: tests/test_conservation.py, on a fake of their own;
    # the soak's restarts: tests/test_soak.py
    selected = tuple(n for n in registry.NAMES if n not in ("conservation", "soak"))
    runner.run_checks(
        fake.cluster,
        results,
        acc.AccuracyOptions(task="t"),
        selected=selected,
        options={"burst": {"requests": 6}},
    )
    assert [r.name for r in results] == list(selected)
    # the fake cluster's connector has known upstream bugs (configs/known_issues.toml) reproduced
    # by four checks: passing, they read XPASS (fixed: retire the entry); the rest pass
    known = {"request_features", "fault_peer_death", "fault_restart", "hostile_clients"}
    assert {r.name: r.verdict for r in results if r.name in known} == dict.fromkeys(known, XPASS)
    assert all(r.passed for r in results if r.name not in known), [r.message for r in results]
    served = ["GET prefill-0", "GET decode-0"]
    assert fake.calls == [
        "GET decode-0",  # the window opens
        "POST router",  # smoke
        *served,  # the window's per-instance start
        *served,  # parity's own
        *["POST router", "POST prefill-0"] * len(PARITY_PROMPTS),
        *served,
        "GET decode-0",  # kv_transfer: the window closes
        "POST decode-0",  # the control request
        "GET decode-0",
        *served,
    ]
    kv = results[2].details
    assert (kv["router_requests"], kv["router_prompt_tokens"]) == (5, words(SMOKE_PROMPT, *PARITY_PROMPTS))
    assert kv["control"] == {
        "decode": "decode-0",
        "before": kv["after"]["decode-0"]["external_kv_transfer"],
        "after": kv["after"]["decode-0"]["external_kv_transfer"],
    }
    # prefill-0's direct baselines are not the router's: it served parity's router requests only
    assert kv["served_by_instance"]["prefill-0"] == words(*PARITY_PROMPTS)
    # the edge checks and accuracy after the window, in order, with their options
    n = len(fake.calls)
    assert seen == [
        ("pd_calls", {"requests": 3}, n),
        ("kv_capacity", {"min_ratio": 0.9}, n),
        ("request_features", {}, n),
        ("cache_paths", {}, n),
        ("too_long", {"bound_s": 10.0}, n),
        ("burst", {"requests": 6, "max_tokens": 8}, n),
        ("abort_frees_kv", {"requests": 4, "bound_s": 15.0, "first_token_s": 150.0}, n),
        ("accuracy", acc.as_options(acc.AccuracyOptions(task="t")), n),
        ("preemption", {"requests": 8, "max_tokens": 48}, n),
        # perf, with the registry's options and --record-baseline (the accuracy check's flag)
        ("perf", {**registry.BY_NAME["perf"].options, "record_baseline": False}, n),
        # the fault scenarios last (opt-in): they corrupt, stall, kill and restart
        ("fault_hop_retry", {"requests": 3}, n),
        ("fault_drop", {"requests": 4}, n),
        ("fault_zero", {"requests": 32, "max_tokens": 8}, n),
        ("fault_swap", {"requests": 32, "max_tokens": 8}, n),
        ("fault_mixup", {"requests": 4, "max_tokens": 8}, n),
        ("fault_truncate", {"requests": 2, "max_tokens": 8, "cut_to": 2}, n),
        ("fault_partial_recompute", {"requests": 2, "max_tokens": 4, "tokens": 8}, n),
        ("fault_stall_abort", {"requests": 2, "stall_s": 8.0, "abort_bound_s": 4.0, "free_slack_s": 5.0}, n),
        ("fault_strand", {"requests": 2, "stall_s": 3.0, "free_slack_s": 3.0}, n),
        ("fault_peer_death", {"stall_s": 5.0, "bound_s": 60.0}, n),
        ("fault_restart", {"deadline_s": 600.0, "bound_s": 120.0}, n),
        ("wire_loss", {"rates": (2, 20), "requests": 3, "bound_s": 60.0}, n),
        ("wire_partition", {"requests": 4, "partition_s": 3.0, "bound_s": 60.0}, n),
        ("wire_cap", {"requests": 3, "rate_kbit": 4000, "bound_s": 60.0}, n),
        ("wire_delay", {"requests": 3, "delay_ms": 20, "bound_s": 60.0}, n),
        ("kv_digest", {}, n),  # it compares the KV of every request before it
        ("hostile_clients", {"deadline_s": 6.0, "idle_s": 4.0}, n),  # last: it may leave KV held
    ]


def test_unselected_and_skipped_checks_do_not_run(fake, monkeypatch):
    seen = []
    monkeypatch.setitem(runner.GATHERERS, "burst", recorder(fake, seen)("burst"))
    results = []
    runner.run_checks(fake.cluster, results, skip=("burst",), selected=("kv_transfer", "burst"))
    assert [r.name for r in results] == ["kv_transfer"] and seen == []
    # without smoke and parity the window held no router request
    assert results[0].message == "no router requests were made in the window"


def test_a_window_that_could_not_open_fails_kv_transfer_only(fake):
    fake.decode_lacks_the_metric = True
    results = []
    runner.run_checks(fake.cluster, results, selected=("smoke", "kv_transfer"))
    assert [r.verdict for r in results] == [PASS, FAIL]
    assert results[1].message.startswith("could not read decode metrics: vllm:prompt_tokens_by_source_total")


def test_a_stuck_path_fails_every_later_check_without_running_it(fake, monkeypatch):
    monkeypatch.setattr(runner, "CHECK_REQUEST_TIMEOUT_S", 2.0)
    seen = []
    gather = recorder(fake, seen)
    for name in (
        "request_features",
        "cache_paths",
        "too_long",
        "burst",
        "abort_frees_kv",
        "accuracy",
        "preemption",
        "perf",
        *registry.FAULTS,
        *registry.WIRE,
        "kv_digest",
        "hostile_clients",
    ):
        monkeypatch.setitem(runner.GATHERERS, name, gather(name))
    fake.router_hangs = True
    results = []
    runner.run_checks(fake.cluster, results, selected=registry.NAMES)
    assert [r.name for r in results] == list(registry.NAMES) and seen == []
    assert "no answer within 2 s; stuck: " in results[0].message
    assert all(
        r.message.startswith("not run: the P/D path is stuck (smoke got no answer") for r in results[1:]
    )
