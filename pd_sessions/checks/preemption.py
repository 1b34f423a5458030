"""preemption: a burst through the router onto a decode whose KV cache holds fewer blocks than the
burst needs (the ``preemption`` sweep gives its decode ``--num-gpu-blocks-override``). vLLM then
preempts running requests on the decode and recomputes them later (their KV came by transfer;
the recompute is local). Every request must still succeed and equal the same request sent alone
to prefill-direct (parity's mode), the decodes' ``vllm:num_preemptions_total`` must have risen
(else the config did not test what it is for), and the KV proof over the burst holds exactly
(vLLM counts a request's prompt tokens by source at its first scheduling only, so a preempted
request's recompute does not change the identity: core/kv_identity.py).

Not a default check: a sweep selects it (pd_sessions/configs/preemption.toml). Pure:
:func:`evaluate`; :func:`run` is the gatherer (the burst is checks/burst.py's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pd_sessions.checks import burst, instances, parity
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting
from pd_sessions.runtime import http

PREEMPTIONS = "vllm:num_preemptions_total"


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the burst's requests and the decodes' preemptions over it."""
    return [*pick(details, ("requests", ""), ("preemptions", ""))]


@reporting(numbers)
def evaluate(burst_verdict: CheckResult, preempted: float | None, *, requests: int) -> CheckResult:
    """The burst's verdict (every request served, each equal to prefill-direct, the KV proof) and
    the decodes' preemptions over it.

    the decodes do not expose PREEMPTIONS   -> fail
    no preemption                           -> fail: the decode's KV cache was big enough
    the burst failed                        -> fail with its message
    otherwise                               -> pass
    """
    details = {"preemptions": preempted, "requests": requests, "burst": burst_verdict.details}
    if preempted is None:
        return CheckResult("preemption", FAIL, f"the decodes expose no {PREEMPTIONS}", details)
    problems = []
    if preempted <= 0:
        problems.append(
            f"no request was preempted on the decodes ({PREEMPTIONS} unchanged): their KV cache held "
            "the whole burst; give the decode fewer blocks (decode_extra_args "
            '["--num-gpu-blocks-override", "N"]) or the burst more tokens'
        )
    if not burst_verdict.passed:
        problems.append(burst_verdict.message)
    if problems:
        return CheckResult("preemption", FAIL, "; ".join(problems), details)
    return CheckResult(
        "preemption",
        PASS,
        f"the decodes preempted {preempted:g} times during {burst_verdict.message}",
        details,
    )


def preemptions(plan: Any) -> float | None:
    """The decodes' PREEMPTIONS summed (None when a decode does not expose it)."""
    total = 0.0
    for d in plan.decode:
        got = instances.sample_sums(http.get_text(f"{d.url}/metrics"), (PREEMPTIONS,))
        if PREEMPTIONS not in got:
            return None
        total += got[PREEMPTIONS]
    return total


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    n, max_tokens = int(options["requests"]), int(options["max_tokens"])
    before = preemptions(window.plan)
    fired = burst.fire(window, burst.prompts(n), max_tokens)
    after = preemptions(window.plan)
    j = parity.Judge.for_config(window.plan.config)
    pairs = burst.references(window, fired, max_tokens, j)
    verdict = burst.evaluate(
        pairs, fired.errors, fired.kv, requests=n, seconds=fired.seconds, max_tokens=max_tokens, judge=j
    )
    delta = None if before is None or after is None else after - before
    return evaluate(verdict, delta, requests=n)
