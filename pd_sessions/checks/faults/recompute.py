"""fault_partial_recompute: the decode loads only part of a prompt's KV and computes the rest
itself. Its answer is right; it silently does the prefill's work (a feature lost without a sign:
the disaggregation's point is that the decode computes no prompt).

The injector (pd_sessions/core/faults.py, mode ``recompute``) makes the decode's scheduler take
``tokens`` back from what the wrapped connector would load (at most the prompt's last block but
one, so the load covers the same blocks), as a connector with a wrong backoff does: vLLM then
loads the rest and schedules those tokens as its own compute. The answer stays right (the
decode recomputes the same KV), so no comparison of output can see it; the KV accounting must:
each request's prompt tokens by source on the decode (``vllm:prompt_tokens_by_source_total``)
against the connector's identity (core/kv_identity.py, as checks/kv_transfer.py judges a window).
The scenario sends its requests one at a time, so each request's counts are its own, and passes
only when the accounting caught every one, naming the request and its token counts.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pd_sessions.checks import instances, kv_transfer
from pd_sessions.checks.faults.promise import (
    Outcome,
    Recovery,
    counts,
    counts_table,
    injector_count,
    not_passing,
    proven,
    said,
)
from pd_sessions.checks.faults.scenario import POLL_S, Scenario, gatherer
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.kv_identity import Counts
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting

NAME = "fault_partial_recompute"
# How long the decode's by-source counters may take to count a request after its answer.
COUNTED_S = 10.0


@dataclass(frozen=True)
class Accounted:
    """One request under the fault: how it ended and what the decode counted for it."""

    outcome: Outcome
    prompt_tokens: int
    seen: Counts  # the decodes' prompt tokens by source for this request
    wrong: str | None  # why they break the identity (None: they keep it)

    def to_dict(self) -> dict[str, Any]:
        return {**self.outcome.to_dict(), "prompt_tokens": self.prompt_tokens, "seen": self.seen.as_dict(),
                "accounting": self.wrong}  # fmt: skip


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the requests, those partly recomputed, those the accounting caught."""
    return [
        *pick(details, ("requests", ""), ("recomputed", ""), ("detected", ""), ("recovery_s", "s")),
        *([counts_table(details["counts"])] if "counts" in details else []),
    ]


@reporting(numbers)
@proven(lambda d: [injector_count(d.get("injected") or {}, "recompute")])
def evaluate(
    rows: Sequence[Accounted], injected: Mapping[str, int], recovery: Recovery, *, identity: str
) -> CheckResult:
    """The verdict.

    the injector took no token back                  -> NOT RUN "invalid" (promise.proven)
    an answer not correct (partial recompute must not change it) -> fail, naming it
    a request whose counts keep the identity         -> fail: the accounting missed it, naming the
                                                        request and its counts
    the cluster not whole again                      -> fail, naming what
    otherwise                                        -> pass: every request caught, the first
                                                        named with its token counts
    """
    c = counts([r.outcome for r in rows])
    caught = [r for r in rows if r.wrong]
    details: dict[str, Any] = {
        "requests": len(rows),
        "recomputed": injected.get("recompute", 0),
        "injected": dict(injected),
        "detected": len(caught),
        "identity": identity,
        "counts": c,
        "rows": [r.to_dict() for r in rows],
        "recovery_s": round(recovery.seconds, 3),
        "recovery": recovery.to_dict(),
    }
    problems = [
        not_passing([r.outcome for r in rows], "a partly recomputed prompt still gives the right answer")
    ]
    problems += [
        f"{r.outcome.label!r}: the accounting missed it ({r.prompt_tokens} prompt tokens: {r.seen})"
        for r in rows
        if not r.wrong
    ]
    if not rows:
        problems.append("no request was sent")
    if not recovery.ok:
        problems.append(recovery.line())
    found = [p for p in problems if p]
    if found:
        return CheckResult(NAME, FAIL, f"partial recompute ({said(c)}): " + "; ".join(found), details)
    first = caught[0]
    return CheckResult(
        NAME,
        PASS,
        f"{injected.get('recompute', 0)} requests partly recomputed on the decode, every answer correct; "
        f"the KV accounting caught {len(caught)}/{len(rows)}, e.g. {first.outcome.label!r}: "
        f"{first.wrong}; {recovery.line()}",
        details,
    )


def counted(window: CheckWindow, before: Mapping[str, Counts], prompt_tokens: int) -> Counts:
    """The decodes' prompt tokens by source since ``before``, once they count ``prompt_tokens``
    (or what they count after COUNTED_S)."""
    t0 = time.monotonic()
    while True:
        after = instances.scrape_decode_counts(window.plan)
        seen = sum((after[n] - before.get(n, Counts()) for n in after), Counts())
        if seen.total >= prompt_tokens or time.monotonic() - t0 > COUNTED_S:
            return seen
        time.sleep(POLL_S)


@gatherer(NAME)
def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    s = Scenario(window, NAME)
    idle = s.gauges()
    config = window.plan.config
    max_tokens = int(options["max_tokens"])
    rows = []
    identity = ""
    s.inject("recompute", tokens=int(options["tokens"]))
    try:
        for i in range(int(options["requests"])):
            prompt = f"Partly recomputed {i}: the beekeeper counted {i + 4} hives along the orchard wall and"
            before = instances.scrape_decode_counts(window.plan)
            a = s.ask(window.plan.router.url, prompt, max_tokens=max_tokens)
            n = a.completion.prompt_tokens if a.completion else 0
            seen = counted(window, before, n) if n else Counts()
            d: dict[str, Any] = {}
            wrong = kv_transfer.counters_verdict(seen, {}, d, prompt_tokens=n, requests=1,
                                                 connector=config.connector, ssm=config.hybrid)  # fmt: skip
            outcome = s.judged(
                a, reference=window.plan.prefill[0], max_tokens=max_tokens, bound_s=window.timeout_s
            )
            rows.append(Accounted(outcome, n, seen, wrong if n else None))
            identity = str(d.get("identity", ""))
    finally:
        s.off()
    return evaluate(rows, s.injected(), s.recover(idle), identity=identity)
