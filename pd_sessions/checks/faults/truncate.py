"""fault_truncate: the decode ends a request early and the client still gets HTTP 200 (truncated
or empty 200s, as users report them: a short answer, ``finish_reason: "error"``, missing content).

The injector (pd_sessions/core/faults.py, mode ``truncate``) lowers each selected request's
``max_tokens`` in the decode's scheduler when it first schedules it: vLLM's scheduler then ends
the request after ``cut_to`` tokens, and the client gets HTTP 200 with ``cut_to`` tokens (and, the
worst case, finish_reason "length", as if it had asked for that few). Each answer is judged the way
the checks judge every answer: smoke's rule (exactly the tokens asked, some text, finish_reason
"length") and parity against prefill-direct in the config's mode (exact: token for token and
the finish_reason; margin: the tokens within the margin AND the answer's length and finish_reason,
as exact mode's reference would have them). Both must fail every truncated answer: a truncation
that passes either is a hole in the harness, and fails the scenario.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pd_sessions.checks import smoke
from pd_sessions.checks.faults.promise import (
    CORRECT,
    KEPT,
    Outcome,
    Recovery,
    counts,
    counts_table,
    injector_count,
    proven,
    said,
)
from pd_sessions.checks.faults.scenario import Scenario, gatherer
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting

NAME = "fault_truncate"


@dataclass(frozen=True)
class Judged:
    """One answer under the fault, as the checks judged it."""

    outcome: Outcome  # the parity judge's view (correct: equal to prefill-direct)
    tokens: int | None  # completion tokens the client got (None: no 200)
    finish_reason: str | None
    smoke: str | None  # smoke's failure message (None: smoke passed it)

    def to_dict(self) -> dict[str, Any]:
        return {**self.outcome.to_dict(), "tokens": self.tokens, "finish_reason": self.finish_reason,
                "smoke": self.smoke}  # fmt: skip


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the answers cut, how many each check caught."""
    return [
        *pick(
            details,
            ("requests", ""),
            ("truncated", ""),
            ("parity_detected", ""),
            ("smoke_detected", ""),
            ("recovery_s", "s"),
        ),
        *([counts_table(details["counts"])] if "counts" in details else []),
    ]


@reporting(numbers)
@proven(lambda d: [injector_count(d.get("injected") or {}, "truncate")])
def evaluate(
    answers: Sequence[Judged],
    injected: Mapping[str, int],
    recovery: Recovery,
    *,
    max_tokens: int,
    parity_mode: str,
) -> CheckResult:
    """The verdict.

    the injector truncated nothing                       -> NOT RUN "invalid" (promise.proven)
    an answer hung or got no HTTP answer                 -> fail, naming it
    a 200 that parity passed (equal to prefill-direct) or smoke passed -> fail: the hole, naming
                                                            the request, its tokens and finish_reason
    the cluster not whole again                          -> fail, naming what
    otherwise                                            -> pass: every truncated 200 caught by both
    """
    c = counts([a.outcome for a in answers])
    ok = [a for a in answers if a.tokens is not None]  # the 200s
    by_parity = [a for a in ok if a.outcome.kind != CORRECT]
    by_smoke = [a for a in ok if a.smoke]
    details: dict[str, Any] = {
        "requests": len(answers),
        "truncated": injected.get("truncate", 0),
        "injected": dict(injected),
        "max_tokens": max_tokens,
        "parity_mode": parity_mode,
        "parity_detected": len(by_parity),
        "smoke_detected": len(by_smoke),
        "counts": c,
        "answers": [a.to_dict() for a in answers],
        "recovery_s": round(recovery.seconds, 3),
        "recovery": recovery.to_dict(),
    }
    problems = [
        f"{a.outcome.label!r}: {a.outcome.kind} after {a.outcome.seconds:.1f} s"
        for a in answers
        if a.tokens is None and a.outcome.kind not in KEPT
    ]
    problems += [
        f"{a.outcome.label!r}: a 200 with {a.tokens} of {max_tokens} tokens, finish_reason "
        f"{a.finish_reason!r} passed "
        + " and ".join(
            w for w, hole in (("parity", a.outcome.kind == CORRECT), ("smoke", not a.smoke)) if hole
        )
        for a in ok
        if a.outcome.kind == CORRECT or not a.smoke
    ]
    if not ok:
        problems.append(f"no request got a 200 to judge ({said(c)})")
    if not recovery.ok:
        problems.append(recovery.line())
    if problems:
        return CheckResult(NAME, FAIL, f"truncate ({said(c)}): " + "; ".join(problems), details)
    first = ok[0]
    return CheckResult(
        NAME,
        PASS,
        f"{injected.get('truncate', 0)} answers cut by the decode, each an HTTP 200 (e.g. "
        f"{first.outcome.label!r}: {first.tokens} of {max_tokens} tokens, finish_reason "
        f"{first.finish_reason!r}); parity ({parity_mode} mode) failed {len(by_parity)}/{len(ok)}, "
        f"smoke {len(by_smoke)}/{len(ok)}; {recovery.line()}",
        details,
    )


@gatherer(NAME)
def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    s = Scenario(window, NAME)
    idle = s.gauges()
    max_tokens = int(options["max_tokens"])
    answers = []
    s.inject("truncate", tokens=int(options["cut_to"]))
    try:
        for i in range(int(options["requests"])):
            prompt = f"Truncated answer {i}: the cartographer drew the {i + 3} rivers and"
            answers.append(s.ask(window.plan.router.url, prompt, max_tokens=max_tokens))
    finally:
        s.off()
    judged = []
    for a in answers:
        outcome = s.judged(
            a, reference=window.plan.prefill[0], max_tokens=max_tokens, bound_s=window.timeout_s
        )
        c = a.completion
        smoke_said = None if c is None else smoke.evaluate(c, max_tokens=max_tokens)
        judged.append(
            Judged(
                outcome,
                None if c is None else c.completion_tokens,
                None if c is None else c.finish_reason,
                None if smoke_said is None or smoke_said.passed else smoke_said.message,
            )
        )
    return evaluate(judged, s.injected(), s.recover(idle), max_tokens=max_tokens, parity_mode=s.judge.mode)
