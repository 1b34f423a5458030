"""Gathers the inputs of every check from a ready cluster, in one order:

1. scrape decode /metrics (before)
2. smoke: one completion through the router
3. parity: each prompt through the router, then straight to prefill-0
4. scrape decode /metrics (after): the window held only router requests
5. control: one request straight to decode-0 must leave the counter still

Results are appended to ``results`` as they come, so a run cut short by a
dying process still reports the checks that finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pd_sessions import http
from pd_sessions.checks import kv_transfer
from pd_sessions.checks.base import FAIL, CheckResult
from pd_sessions.checks.completions import (MAX_TOKENS, PARITY_PROMPTS, SMOKE_PROMPT, Completion,
                                            evaluate_parity, evaluate_smoke)
from pd_sessions.cluster import Cluster

CONTROL_PROMPT = "A request sent straight to the decode instance, not through the router:"


def _complete(base_url: str, model: str, prompt: str) -> Completion:
    return Completion.from_response(http.completion(base_url, model, prompt, max_tokens=MAX_TOKENS))


def _timed(name: str, results: list[CheckResult], fn: Callable[[], CheckResult]) -> None:
    t0 = time.monotonic()
    try:
        r = fn()
    except (http.HttpError, kv_transfer.MetricMissing) as e:
        r = CheckResult(name, FAIL, f"could not run: {e}")
    r.seconds = time.monotonic() - t0
    results.append(r)


def run_checks(cluster: Cluster, results: list[CheckResult]) -> None:
    plan = cluster.plan
    model = plan.served_model_name
    router = plan.router.url
    baseline = plan.prefill[0]
    ledger = {"tokens": 0, "requests": 0}

    def via_router(prompt: str) -> Completion:
        c = _complete(router, model, prompt)
        ledger["tokens"] += c.prompt_tokens
        ledger["requests"] += 1
        return c

    def scrape() -> dict[str, float]:
        return {s.name: kv_transfer.external_tokens(http.get_text(f"{s.url}/metrics"))
                for s in plan.decode}

    before_err: list[str] = []
    try:
        before = scrape()
    except (http.HttpError, kv_transfer.MetricMissing) as e:
        before, before_err = {}, [str(e)]

    _timed("smoke", results, lambda: evaluate_smoke(via_router(SMOKE_PROMPT)))

    def parity() -> CheckResult:
        pairs = [(p, via_router(p), _complete(baseline.url, model, p)) for p in PARITY_PROMPTS]
        return evaluate_parity(pairs, baseline=f"{baseline.name} direct (no disaggregation)")

    _timed("parity", results, parity)

    def kv() -> CheckResult:
        if before_err:
            return CheckResult("kv_transfer", FAIL, f"could not read decode metrics: {before_err[0]}")
        after = scrape()
        d0 = plan.decode[0]
        _complete(d0.url, model, CONTROL_PROMPT)
        control_after = scrape()[d0.name]
        return kv_transfer.evaluate(before, after, router_prompt_tokens=ledger["tokens"],
                                    router_requests=ledger["requests"],
                                    control=(d0.name, after[d0.name], control_after))

    _timed("kv_transfer", results, kv)
