"""too_long: a prompt longer than the model length, sent through the router, must get an
HTTP error (4xx) within a bounded time, not a hang; afterwards every instance and the router
are healthy and a normal request still succeeds.

Seen in P/D harnesses: the prefill rejects the request, and the decode side or the router
then waits forever for KV that never comes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pd_sessions.checks.instances import REQUEST_TIMEOUT_S, health, tokenize
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting
from pd_sessions.runtime import http

WORD = " hello"


@dataclass(frozen=True)
class Answer:
    """What the router did with the too-long prompt."""

    status: int | None  # HTTP status; None = no answer (timeout or connection error)
    seconds: float
    body: str = ""  # the error body (first 300 characters) or why there was none


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the answer's status and time against the bound, the prompt's length."""
    return [
        *pick(
            details,
            ("status", ""),
            ("seconds", "s"),
            ("bound_s", "s"),
            ("prompt_tokens", "tokens"),
            ("max_model_len", "tokens"),
        )
    ]


@reporting(numbers)
def evaluate(
    answer: Answer,
    *,
    bound_s: float,
    prompt_tokens: int,
    max_model_len: int,
    health_after: Mapping[str, str],
    followup: str | None,
) -> CheckResult:
    """Verdict.

    no answer within bound_s           -> fail: a hang (names the bound)
    answered after bound_s             -> fail: too slow
    2xx                                -> fail: a too-long prompt was accepted
    5xx or another non-4xx status      -> fail: the wrong kind of error
    4xx within the bound, but a process
      unhealthy afterwards             -> fail naming it
    ... or the follow-up request failed -> fail with its error
    4xx within the bound, all healthy,
      follow-up ok                     -> pass
    """
    details: dict[str, Any] = {
        "status": answer.status,
        "seconds": round(answer.seconds, 3),
        "bound_s": bound_s,
        "body": answer.body,
        "prompt_tokens": prompt_tokens,
        "max_model_len": max_model_len,
        "health_after": dict(health_after),
        "followup_error": followup,
    }
    what = f"a {prompt_tokens}-token prompt (max_model_len {max_model_len})"
    problem = answer_problem(answer, what, bound_s) or aftermath_problem(answer, what, health_after, followup)
    if problem:
        return CheckResult("too_long", FAIL, problem, details)
    return CheckResult(
        "too_long",
        PASS,
        f"{what} got HTTP {answer.status} through the router in "
        f"{answer.seconds:.2f} s; every process healthy and a normal request "
        "succeeded afterwards",
        details,
    )


def answer_problem(answer: Answer, what: str, bound_s: float) -> str | None:
    """Why the router's answer to ``what`` (the too-long prompt) fails the check: a hang, an
    answer after ``bound_s``, an acceptance, an error that is not a 4xx; None for a 4xx in time."""
    if answer.status is None:
        return (
            f"{what} through the router got no answer within "
            f"{bound_s:g} s ({answer.body}): the P/D path hangs on a prompt the "
            "prefill rejects"
        )
    if answer.seconds > bound_s:
        return f"{what} got HTTP {answer.status} only after {answer.seconds:.1f} s (bound {bound_s:g} s)"
    if 200 <= answer.status < 300:
        return f"{what} was accepted (HTTP {answer.status}); expected a 4xx error"
    if not 400 <= answer.status < 500:
        return f"{what} got HTTP {answer.status}, expected a 4xx error: {answer.body[:200]}"
    return None


def aftermath_problem(
    answer: Answer, what: str, health_after: Mapping[str, str], followup: str | None
) -> str | None:
    """Why the cluster after the 4xx fails the check: a process unhealthy (named), or the normal
    request that followed failed (its error); None when all is well."""
    sick = {n: h for n, h in health_after.items() if h != "ok"}
    if sick:
        return f"{what} got HTTP {answer.status}, but afterwards " + ", ".join(
            f"{n} /health: {h}" for n, h in sick.items()
        )
    if followup is not None:
        return (
            f"{what} got HTTP {answer.status}, but a normal request "
            f"through the router then failed: {followup}"
        )
    return None


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    """Gatherer: build a prompt one block past the model length, send it, look around."""
    plan = window.plan
    model = plan.served_model_name
    bound = float(options["bound_s"])
    probe = tokenize(plan.prefill[0].url, model, WORD)
    n_words = probe.max_model_len + 16
    prompt = WORD * n_words
    counted = len(tokenize(plan.prefill[0].url, model, prompt).tokens)
    if counted <= probe.max_model_len:
        return CheckResult(
            "too_long",
            FAIL,
            f"could not run: a prompt of {n_words} words is only "
            f"{counted} tokens, not over max_model_len {probe.max_model_len}",
        )
    t0 = time.monotonic()
    try:
        http.completion(plan.router.url, model, prompt, max_tokens=4, timeout=bound)
        answer = Answer(200, time.monotonic() - t0)
    except http.HttpError as e:
        answer = Answer(e.status, time.monotonic() - t0, e.reason[:300])
    followup = None
    try:
        http.completion(
            plan.router.url,
            model,
            "After the long prompt, a short one:",
            max_tokens=2,
            timeout=REQUEST_TIMEOUT_S,
        )
    except http.HttpError as e:
        followup = str(e)
    return evaluate(
        answer,
        bound_s=bound,
        prompt_tokens=counted,
        max_model_len=probe.max_model_len,
        health_after=health(plan.processes),
        followup=followup,
    )
