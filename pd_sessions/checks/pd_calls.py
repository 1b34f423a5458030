"""pd_calls: the P/D path makes exactly one prefill call and one decode call per request, unless
the config declares retries (``declared_retries``: then up to 1 + that many calls per hop).

A retry between the router and an instance (a proxy or load balancer that retries a failing
decode, the router's own retries) can make a failing hop look healthy: the client gets its
answer, and only the instance saw two calls. The instances count what they are sent: vLLM's
API server counts every HTTP call by handler (``http_requests_total``, prometheus-fastapi-
instrumentator, whatever its status) and its engine every request it finished, aborted ones
included (``vllm:request_success_total`` by finished_reason). Requests are sent through the
router one at a time and every instance is scraped around each, so each request's calls per
hop are known exactly: the largest of the two counters' growth on each role.

Evaluation is pure (:func:`evaluate`); :func:`measure` gathers (fault_hop_retry uses it too,
through its own router and fault proxy).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.plan import ClusterPlan
from pd_sessions.core.results import FAIL, NOT_RUN, PASS, CheckResult, Figure, Table, reporting
from pd_sessions.runtime import http

HTTP_METRIC = "http_requests_total"
HANDLERS = ("/v1/completions", "/v1/chat/completions")
ENGINE_METRIC = "vllm:request_success_total"
ROLES = ("prefill", "decode")
PROMPT = "pd_calls request {i}: count the calls each hop makes for"
MAX_TOKENS = 4
# How long a scrape after an answer may wait for an instance's counters to show its call (the
# API server counts a call as its answer's last bytes go out, a moment after the client has them).
SETTLE_S = 2.0


@dataclass(frozen=True)
class Calls:
    """One instance's counters: HTTP calls to the completion handlers, and finished engine
    requests (None: not exposed)."""

    http: float | None
    engine: float | None


def parse(metrics_text: str) -> Calls:
    """The two counters from one /metrics scrape, each summed over its label sets."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == HTTP_METRIC and s.labels.get("handler") in HANDLERS:
                sums[HTTP_METRIC] = sums.get(HTTP_METRIC, 0.0) + s.value
            elif s.name == ENGINE_METRIC:
                sums[ENGINE_METRIC] = sums.get(ENGINE_METRIC, 0.0) + s.value
    return Calls(sums.get(HTTP_METRIC), sums.get(ENGINE_METRIC))


def calls_between(before: Calls, after: Calls) -> int | None:
    """The calls one instance got between two scrapes: the larger growth of its two counters
    (a call cut before it reached the engine shows in the HTTP counter, one the API server
    counts late in the engine's); None when neither counter is exposed."""
    pairs = ((before.http, after.http), (before.engine, after.engine))
    grown = [a - b for b, a in pairs if b is not None and a is not None]
    return round(max(grown)) if grown else None


@dataclass(frozen=True)
class RequestCalls:
    """One request: whether its client got HTTP 200, and each instance's calls (None: unmeasured)."""

    index: int
    ok: bool
    answer: str  # the answer's text, or the error
    calls: Mapping[str, int | None]  # instance name -> calls during this request

    def role(self, role: str) -> int | None:
        mine = [v for k, v in self.calls.items() if k.rsplit("-", 1)[0] == role]
        return None if not mine or None in mine else sum(v for v in mine if v is not None)


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    rows = details.get("requests", [])
    out: list[Figure | Table] = [Figure("declared_retries", details.get("declared_retries"))]
    if rows:
        cols = ("request", "client", "prefill calls", "decode calls")
        out.append(
            Table(
                "calls per request",
                cols,
                tuple((r["index"], r["client"], r["prefill"], r["decode"]) for r in rows),
            )
        )
    return out


@reporting(numbers)
def evaluate(
    requests: Sequence[RequestCalls], *, declared_retries: int, name: str = "pd_calls"
) -> CheckResult:
    """Judge each request's calls per hop.

    a hop's calls unmeasured (no counter exposed)  -> NOT RUN naming the instances
    any request with 0 calls, or more than 1 + declared_retries, on a hop -> FAIL naming the
        request, the hop, each instance's calls and the fix (declared_retries)
    otherwise                                      -> PASS
    """
    allowed = 1 + declared_retries
    rows = [{"index": r.index, "client": "HTTP 200" if r.ok else r.answer[:80],
             "prefill": r.role("prefill"), "decode": r.role("decode"), "calls": dict(r.calls)}
            for r in requests]  # fmt: skip
    details: dict[str, Any] = {
        "declared_retries": declared_retries,
        "allowed_per_hop": allowed,
        "requests": rows,
    }
    unmeasured = sorted({k for r in requests for k, v in r.calls.items() if v is None})
    if not requests or unmeasured:
        why = f"{', '.join(unmeasured)} expose(s)" if unmeasured else "no request was counted:"
        return CheckResult(
            name,
            NOT_RUN,
            f"{why} neither {HTTP_METRIC} nor {ENGINE_METRIC}: calls per hop not counted",
            details,
        )
    bad = []
    for r in requests:
        for role in ROLES:
            n = r.role(role)
            if n is not None and not 1 <= n <= allowed:
                each = ", ".join(f"{k}: {v}" for k, v in r.calls.items() if k.rsplit("-", 1)[0] == role)
                bad.append(f"request {r.index} made {n} {role} call(s) ({each})")
    if bad:
        masked = [r.index for r in requests if r.ok and any((r.role(x) or 0) > allowed for x in ROLES)]
        details["masked"] = masked
        return CheckResult(
            name,
            FAIL,
            f"{'; '.join(bad)}; allowed 1 to {allowed} per hop (declared_retries = {declared_retries})"
            + (
                f"; the client got HTTP 200 for request(s) {masked}: a retry masked a failing hop"
                if masked
                else ""
            )
            + "; if the path retries on purpose, declare it: declared_retries = N in the config",
            details,
        )
    return CheckResult(
        name,
        PASS,
        f"{len(requests)} request(s), each made 1 prefill and 1 decode call"
        + (f" (up to {allowed} allowed: declared_retries = {declared_retries})" if declared_retries else ""),
        details,
    )


def scrape(plan: ClusterPlan) -> dict[str, Calls]:
    """instance name -> its counters, one /metrics each."""
    return {s.name: parse(http.get_text(f"{s.url}/metrics")) for s in plan.instances}


def measure(
    plan: ClusterPlan,
    router_url: str,
    requests: int,
    *,
    timeout_s: float,
    scrape_all: Callable[[ClusterPlan], dict[str, Calls]] = scrape,
) -> list[RequestCalls]:
    """``requests`` greedy completions through ``router_url``, one at a time, every instance
    scraped before and after each (after: again until each role shows a call, within SETTLE_S)."""
    out = []
    for i in range(1, requests + 1):
        before = scrape_all(plan)
        try:
            resp = http.completion(
                router_url,
                plan.served_model_name,
                PROMPT.format(i=i),
                max_tokens=MAX_TOKENS,
                timeout=timeout_s,
            )
            ok, answer = True, str(resp["choices"][0].get("text", ""))
        except http.HttpError as e:
            ok, answer = False, str(e)
        deadline = time.monotonic() + SETTLE_S
        while True:
            after = scrape_all(plan)
            calls = {n: calls_between(before[n], after[n]) for n in before}
            r = RequestCalls(i, ok, answer, calls)
            if all((r.role(x) or 0) >= 1 for x in ROLES) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        out.append(r)
    return out


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    """Gatherer: ``requests`` requests through the cluster's router, calls per hop judged against
    the config's declared_retries."""
    plan = window.plan
    got = measure(plan, plan.router.url, int(options["requests"]), timeout_s=window.timeout_s)
    return evaluate(got, declared_retries=plan.config.declared_retries)
