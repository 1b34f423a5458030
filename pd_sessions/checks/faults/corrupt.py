"""fault_zero and fault_swap: the decode's received KV blocks are overwritten after the transfer
completes, before the decode uses them: with zeros, or with another request's blocks (the
"another prompt's answer" of vllm-project/vllm#52234). The client then gets HTTP 200 with
text computed from the wrong KV. Nothing inside vLLM notices; the harness must, from outside:
the burst check (32 concurrent requests through the router, each compared with the same request
sent alone to prefill-direct) runs under the fault and must FAIL, naming the requests whose
output differs. The detection rate is the share of corrupted requests it caught.

Why some corruption can pass: the comparison is of greedy tokens. A corrupted KV block changes
the logits, but the argmax can stay the same when one token dominates (the tiny generated
models, with random weights, often have such tokens), and then the output is, token for token,
what prefill-direct says. Comparing the logprobs themselves (as margin mode's teacher forcing
reads them) would catch those too; :func:`evaluate` says how many passed and why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pd_sessions.checks import burst, parity
from pd_sessions.checks.faults.promise import (
    BROKEN,
    CORRECT,
    FAILED_CLEARLY,
    HUNG,
    REQUEST_BOUND_S,
    WRONG,
    Recovery,
    classify,
    counts_table,
    injector_count,
    proven,
    said,
)
from pd_sessions.checks.faults.scenario import Scenario, gatherer
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import connectors
from pd_sessions.core.connectors.base import DetectionRate
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting

UNDETECTED_WHY = (
    "their greedy tokens equal prefill-direct's: the corrupted KV moved the logits but not the "
    "argmax (the tiny model's random weights favour a few tokens whatever the context). "
    "Comparing logprobs instead of tokens (teacher-forced, as margin mode scores them) raises the rate"
)


def detection(check: CheckResult) -> tuple[int, int, list[str]]:
    """(requests compared, requests that differ, the prompts that differ) from a burst result."""
    rows = ((check.details.get("parity") or {}).get("prompts")) or []
    differ = [str(r.get("prompt", "")) for r in rows if not r.get("same")]
    return len(rows), len(differ), differ


def sort_failed(failures: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """The burst's failed requests (its details "failures": burst.Failure records), by kind,
    every kind present: each sorted by the one classifier (promise.classify) from its recorded
    HTTP status, seconds and bound: an HTTP error status is failed clearly, no answer within the
    bound hung, no HTTP answer (a reset, a closed connection) broken."""
    out: dict[str, list[str]] = {k: [] for k in (FAILED_CLEARLY, HUNG, BROKEN)}
    for f in failures:
        error = str(f.get("error") or "failed")
        kind = classify(
            str(f.get("prompt", ""))[:60],
            seconds=float(f.get("seconds") or 0.0),
            status=f.get("status"),
            error=error,
            bound_s=float(f.get("bound_s") or REQUEST_BOUND_S),
        ).kind
        out.setdefault(kind, []).append(f"{str(f.get('prompt', ''))[:30]!r}: {error}")
    return out


def required_said(required: DetectionRate | None, where: str) -> str:
    """The rate a passing scenario met, as its message says it."""
    if required is None:
        return f" (no rate written for {where} in this parity mode: at least one detection required)"
    return f" (required: {required.needed}/{required.of}, measured {required.measured})"


def rate_problem(differ: int, corrupted: int, required: DetectionRate | None, where: str) -> str | None:
    """Why the detection rate is not the one written for this connector and parity mode (None:
    it is); without one written, at least one detection is required (the caller's rule)."""
    if required is None or not corrupted or differ * required.of >= required.needed * corrupted:
        return None
    return (
        f"detected {differ}/{corrupted}, below the {required.needed}/{required.of} written for "
        f"{where} in {required.parity_mode} mode (measured {required.measured})"
    )


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: how many requests were corrupted, how many the checks caught."""
    return [
        *pick(
            details,
            ("requests", ""),
            ("corrupted", ""),
            ("detected", ""),
            ("detection_rate", ""),
            ("recovery_s", "s"),
        ),
        *(
            [counts_table(details["counts"], "requests under the fault, as the burst saw them")]
            if "counts" in details
            else []
        ),
    ]


@reporting(numbers)
@proven(lambda d: [injector_count(d.get("injected") or {}, d.get("mode", "?"))])
def evaluate(
    mode: str,
    check: CheckResult,
    injected: Mapping[str, int],
    recovery: Recovery,
    *,
    requests: int,
    required: DetectionRate | None = None,
    where: str = "this connector",
) -> CheckResult:
    """The verdict of fault_<mode> from the burst check that ran under it.

    the injector applied no <mode>                         -> NOT RUN "invalid" (promise.proven)
    the burst check passed (or compared nothing)           -> fail: the checks missed every
                                                              corrupted request
    a request hung or got no HTTP answer (a reset: broken) -> fail, naming it
    fewer detected than the rate ``required`` (the connector's, for this parity mode) -> fail
    the cluster not whole again                            -> fail, naming what
    otherwise                                              -> pass, with the detection rate
                                                              (differing / corrupted) and why
                                                              the rest passed unnoticed
    """
    name = f"fault_{mode}"
    compared, differ, prompts = detection(check)
    by_kind = sort_failed(check.details.get("failures") or [])
    hung, broken = by_kind[HUNG], by_kind[BROKEN]
    applied = injected.get(mode, 0)
    corrupted = min(applied, compared) if applied else 0
    rate = differ / corrupted if corrupted else None
    c = {
        CORRECT: compared - differ,
        FAILED_CLEARLY: len(by_kind[FAILED_CLEARLY]),
        WRONG: differ,
        HUNG: len(hung),
        BROKEN: len(broken),
    }
    details: dict[str, Any] = {
        "mode": mode,
        "requests": requests,
        "recovery_s": round(recovery.seconds, 3),
        "counts": c,
        "injected": dict(injected),
        "detected": differ,
        "corrupted": corrupted,
        "detection_rate": None if rate is None else round(rate, 4),
        "required": None if required is None else dataclasses.asdict(required),
        "differing_prompts": prompts,
        "check": check.to_dict(),
        "recovery": recovery.to_dict(),
    }
    problems: list[str] = []
    if check.passed or not differ:
        problems.append(
            f"the checks missed every corrupted request: burst {check.verdict.upper()} with "
            f"{differ} of {compared} compared requests differing ({check.message[:200]})"
        )
    problems += [
        f"{len(fs)} request(s) {said_as}: {fs[0][:160]}"
        for fs, said_as in ((hung, "hung"), (broken, "got no HTTP answer (broken)"))
        if fs
    ]
    problems += [p for p in (rate_problem(differ, corrupted, required, where),) if p]
    if not recovery.ok:
        problems.append(recovery.line())
    if problems:
        return CheckResult(name, FAIL, f"{mode} ({said(c)}): " + "; ".join(problems), details)
    passed_unnoticed = corrupted - differ
    why = f"; {passed_unnoticed} passed unnoticed: {UNDETECTED_WHY}" if passed_unnoticed > 0 else ""
    why += required_said(required, where)
    details["undetected_why"] = UNDETECTED_WHY if passed_unnoticed > 0 else None
    return CheckResult(
        name,
        PASS,
        f"{applied} loads corrupted ({mode}); the burst check failed as it must, naming "
        f"{', '.join(repr(p[:30]) for p in prompts[:2])}{' ...' if len(prompts) > 2 else ''}: "
        f"detected {differ}/{corrupted} ({(rate or 0) * 100:.0f} %){why}; {recovery.line()}",
        details,
    )


def scenario(mode: str, window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    s = Scenario(window, f"fault_{mode}")
    idle = s.gauges()
    n = int(options["requests"])
    s.inject(mode)
    try:
        if mode == "swap":  # a first load whose blocks the burst's first request can take
            s.ask(window.plan.router.url, "Swap donor: the clockmaker wound every clock", max_tokens=4)
        check = burst.run(window, {"requests": n, "max_tokens": int(options["max_tokens"])})
    finally:
        s.off()
    injected = s.injected()
    config = window.plan.config
    spec = connectors.get(config.connector)
    required = spec.detection_rate(mode, parity.Judge.for_config(config).mode)
    return evaluate(mode, check, injected, s.recover(idle), requests=n, required=required, where=spec.title)


@gatherer("fault_zero")
def run_zero(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    return scenario("zero", window, options)


@gatherer("fault_swap")
def run_swap(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    return scenario("swap", window, options)
