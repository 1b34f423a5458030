"""burst: N concurrent requests through the router (32 by default). All must succeed, each
must equal, token for token, the same request sent alone to prefill-direct, and the KV proof
(decode instances' prompt tokens by source over the burst, exactly as the connector's identity
says: core/kv_identity.py) must count every one of them.
Outputs correct for one request can be wrong under concurrency (batching, block reuse, a
transfer mixed up between requests). Comparisons follow the parity check's mode
(checks/parity.py): where prefill and decode have different numeric layouts, each P/D output is
teacher-forced through prefill-0 and must stay within the margin of its top-1.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pd_sessions.checks import evidence, instances, kv_transfer, parity
from pd_sessions.checks.completions import Completion
from pd_sessions.checks.instances import REQUEST_TIMEOUT_S
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting
from pd_sessions.runtime import http


def prompts(n: int) -> list[str]:
    """Distinct prompts with distinct first words, so none hits another's cached prefix."""
    animals = ("otter", "heron", "lynx", "bison", "crane", "gecko", "moose", "panda")
    return [
        f"{i} {animals[i % len(animals)]}s crossed burst bridge number {i * 7 + 3} while the "
        f"{animals[(i + 3) % len(animals)]} counted to"
        for i in range(n)
    ]


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the requests, how many failed, how long the burst took."""
    return [
        *pick(details, ("requests", "")),
        Figure("failed", len(details.get("failed") or [])),
        *pick(details, ("burst_seconds", "s")),
    ]


@dataclass(frozen=True)
class Failure:
    """A request of the burst without a completion to compare: its HTTP status (None: no HTTP
    answer, e.g. a reset, or no request at all: the P/D tokens could not be scored), the error,
    its seconds and the bound it ran under (None: not a request). Structured, so a reader sorts it
    without parsing the text (checks/faults/corrupt.py: promise.classify)."""

    prompt: str
    error: str
    status: int | None = None
    seconds: float | None = None
    bound_s: float | None = None

    def line(self) -> str:
        return f"{self.prompt[:30]!r}: {self.error}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "error": self.error,
            "status": self.status,
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            "bound_s": self.bound_s,
        }


@reporting(numbers)
def evaluate(
    pairs: Sequence[tuple[str, Completion | None, parity.Reference]],
    errors: Sequence[Failure],
    kv: CheckResult,
    *,
    requests: int,
    seconds: float,
    max_tokens: int,
    judge: parity.Judge | None = None,
) -> CheckResult:
    """Verdict: no request failed, every pair matches (``judge``'s mode; exact by default), and
    the KV proof over the burst passed.

    ``pairs`` holds (prompt, P/D completion or None when it failed, prefill-direct's side: its
    completion alone in exact mode, its scores of the P/D tokens in margin mode); ``errors`` the
    requests that failed (details "failed": their lines; "failures": each one's record).
    """
    j = judge or parity.Judge("exact", "same numeric layout", parity.DEFAULT_MARGIN)
    ok_pairs = [(p, pd, base) for p, pd, base in pairs if pd is not None]
    verdict = (
        parity.judge(j, ok_pairs, baseline="prefill-direct, alone", max_tokens=max_tokens)
        if ok_pairs
        else None
    )
    details: dict[str, Any] = {
        "requests": requests,
        "failed": [e.line() for e in errors],
        "failures": [e.to_dict() for e in errors],
        "burst_seconds": round(seconds, 3),
        "parity": verdict.details if verdict else None,
        "kv": kv.details,
        "kv_verdict": kv.verdict,
    }
    problems = []
    if errors:
        problems.append(f"{len(errors)}/{requests} requests failed (first: {errors[0].line()})")
    if verdict is not None and not verdict.passed:
        problems.append(verdict.message)
    if not ok_pairs:
        problems.append("no request succeeded")
    if not kv.passed:
        problems.append(f"KV proof: {kv.message}")
    if problems:
        return CheckResult("burst", FAIL, f"{requests} concurrent requests: " + "; ".join(problems), details)
    return CheckResult(
        "burst",
        PASS,
        f"{requests}/{requests} concurrent requests succeeded in "
        f"{seconds:.1f} s, "
        + (
            "each identical to prefill-direct alone"
            if j.mode == "exact"
            else f"each within {j.margin:g} nats of prefill-direct's top-1 (margin mode: {j.why})"
        )
        + f"; {kv.message}",
        details,
    )


@dataclass
class Fired:
    """A burst through the router: each prompt's completion (None when it failed), the failures,
    its seconds, and the KV proof over it."""

    texts: list[str]
    results: list[Completion | None]
    errors: list[Failure]
    seconds: float
    kv: CheckResult


def fire(window: CheckWindow, texts: Sequence[str], max_tokens: int) -> Fired:
    """All of ``texts`` at once through the router, with the KV proof around them (the decodes'
    prompt tokens by source against the connector's identity, the success evidence, and every
    instance serving some of them)."""
    plan = window.plan
    model = plan.served_model_name

    def one(url: str, prompt: str) -> Completion | Failure:
        t = time.monotonic()
        try:
            return Completion.from_response(
                http.completion(url, model, prompt, max_tokens=max_tokens, timeout=REQUEST_TIMEOUT_S)
            )
        except http.HttpError as e:
            return Failure(prompt, str(e), e.status, time.monotonic() - t, REQUEST_TIMEOUT_S)

    before = instances.scrape_decode_counts(plan)
    ev_window = evidence.Window.for_cluster(window.cluster, http.get_text)
    served_before = instances.scrape_served(plan)
    t0 = time.monotonic()
    results: list[Completion | None] = []
    errors: list[Failure] = []
    with ThreadPoolExecutor(max_workers=len(texts)) as pool:
        for got in pool.map(lambda p: one(plan.router.url, p), texts):
            results.append(None if isinstance(got, Failure) else got)
            if isinstance(got, Failure):
                errors.append(got)
    seconds = time.monotonic() - t0
    after = instances.scrape_decode_counts(plan)
    ok = [c for c in results if c is not None]
    kv = kv_transfer.evaluate(
        before,
        after,
        router_prompt_tokens=sum(c.prompt_tokens for c in ok),
        router_requests=len(ok),
        connector=plan.config.connector,
        ssm=plan.config.hybrid,
        evidence=ev_window.close(
            router_requests=len(ok),
            wait_s=evidence.evidence_wait(
                {n: c.external for n, c in before.items()}, {n: c.external for n, c in after.items()}
            ),
        ),
    )
    kv = instances.apply_served(
        kv,
        served_before,
        instances.scrape_served(plan),
        requests=len(ok),
        roles={"prefill": len(plan.prefill), "decode": len(plan.decode)},
    )
    return Fired(list(texts), results, errors, seconds, kv)


def references(
    window: CheckWindow, fired: Fired, max_tokens: int, j: parity.Judge
) -> list[tuple[str, Completion | None, parity.Reference]]:
    """Prefill-0's side of each completed request of ``fired``, one at a time (each request alone);
    a P/D answer that cannot be scored adds to ``fired.errors``."""
    p0, model = window.plan.prefill[0], window.plan.served_model_name
    pairs: list[tuple[str, Completion | None, parity.Reference]] = []
    for p, c in zip(fired.texts, fired.results, strict=True):
        if c is None:
            continue
        try:
            ref = parity.reference(j, p0.url, model, p, c, max_tokens=max_tokens, timeout=REQUEST_TIMEOUT_S)
        except ValueError as e:
            fired.errors.append(Failure(p, f"could not score the P/D tokens: {e}"))
            continue
        pairs.append((p, c, ref))
    return pairs


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    n, max_tokens = int(options["requests"]), int(options["max_tokens"])
    fired = fire(window, prompts(n), max_tokens)
    j = parity.Judge.for_config(window.plan.config)
    pairs = references(window, fired, max_tokens, j)
    return evaluate(
        pairs, fired.errors, fired.kv, requests=n, seconds=fired.seconds, max_tokens=max_tokens, judge=j
    )
