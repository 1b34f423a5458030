"""fault_drop: every KV load the decode completes is reported as failed (the injector adds it to
vLLM's ``failed_recving``, as a connector does when its transfer fails). vLLM then recomputes the
prompt on the decode (``kv_load_failure_policy = "recompute"``) or ends the request with an error
(``"fail"``, vLLM's default). Either keeps the promise; which one happened is recorded per policy.
A 200 with other text, a hang or a request cut without an HTTP answer breaks it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pd_sessions.checks.faults.promise import (
    CORRECT,
    FAILED_CLEARLY,
    Outcome,
    Recovery,
    broken_promise,
    counts,
    counts_table,
    injector_count,
    proven,
    said,
)
from pd_sessions.checks.faults.scenario import Scenario, gatherer
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting

NAME = "fault_drop"
MAX_TOKENS = 8


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the requests, the drops applied, the recovery; how they ended."""
    return [
        *pick(
            details,
            ("requests", ""),
            ("drops_applied", ""),
            ("kv_load_failure_policy", ""),
            ("recovery_s", "s"),
        ),
        *([counts_table(details["counts"])] if "counts" in details else []),
    ]


@reporting(numbers)
@proven(lambda d: [injector_count(d.get("injected") or {}, "drop")])
def evaluate(
    outcomes: Sequence[Outcome], injected: Mapping[str, int], recovery: Recovery, *, policy: str
) -> CheckResult:
    """The verdict.

    the injector applied no drop            -> NOT RUN "invalid" (promise.proven)
    a request wrong, hung or cut            -> fail, naming it
    the cluster not whole again             -> fail, naming what
    otherwise                               -> pass; how the requests ended, per policy
    """
    c = counts(outcomes)
    how = (
        "recomputed on the decode"
        if c[CORRECT] and not c[FAILED_CLEARLY]
        else "failed with an HTTP error"
        if c[FAILED_CLEARLY] and not c[CORRECT]
        else "recomputed or failed with an HTTP error"
    )
    details: dict[str, Any] = {
        "requests": len(outcomes),
        "drops_applied": injected.get("drop", 0),
        "recovery_s": round(recovery.seconds, 3),
        "counts": c,
        "injected": dict(injected),
        "kv_load_failure_policy": policy,
        "outcome_under_policy": how,
        "outcomes": [o.to_dict() for o in outcomes],
        "recovery": recovery.to_dict(),
    }
    problems = [p for p in (broken_promise(outcomes),) if p]
    if not recovery.ok:
        problems.append(recovery.line())
    if problems:
        return CheckResult(NAME, FAIL, f"drop ({said(c)}): " + "; ".join(problems), details)
    return CheckResult(
        NAME,
        PASS,
        f"{injected.get('drop', 0)} KV loads reported failed; {said(c)}: each {how} "
        f"(kv_load_failure_policy {policy}); {recovery.line()}",
        details,
    )


def policy(window: CheckWindow) -> str:
    """The config's kv_load_failure_policy, or vLLM's default said as such."""
    p = window.plan.config.kv_load_failure_policy
    return p if p is not None else "fail (vLLM's default)"


@gatherer(NAME)
def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    s = Scenario(window, NAME)
    idle = s.gauges()
    prefill = window.plan.prefill[0]
    answers = []
    s.inject("drop")
    try:
        for i in range(int(options["requests"])):
            prompt = f"Dropped load {i}: the lighthouse keeper counted the {i + 2} ships and"
            answers.append(s.ask(window.plan.router.url, prompt, max_tokens=MAX_TOKENS))
    finally:
        s.off()
    outcomes = [
        s.judged(a, reference=prefill, max_tokens=MAX_TOKENS, bound_s=s.window.timeout_s) for a in answers
    ]
    return evaluate(outcomes, s.injected(), s.recover(idle), policy=policy(window))
