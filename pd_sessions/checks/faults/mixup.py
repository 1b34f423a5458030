"""fault_mixup: under concurrency a request gets ANOTHER request's KV for its whole prompt, so its
whole answer is computed from another prompt (HTTP 200 with another request's answer under load:
vllm-project/vllm#52234, reproduced on 0.29 with the failed-transfer counter at 0; #52627 the same
on Kimi-K3). The injector overwrites every block of each finished load with another concurrent
load's blocks (loads finishing together trade theirs crosswise; pd_sessions/core/faults.py, mode
``mixup``), after the transfer, before the decode computes: nothing inside vLLM notices.

The harness must, from outside: a small burst through the router under the fault, each answer
compared with the same prompt sent alone to prefill-direct (the burst check, in the config's
parity mode), and, where the KV digest observer runs (``kv_digest`` selected), every mixed-up
load's blocks compared with what its prefill sent. The scenario passes only when one of the two
caught every mixed-up request (detection N/N), and reports both rates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pd_sessions.checks import burst, kv_digest
from pd_sessions.checks.faults.corrupt import detection, sort_failed
from pd_sessions.checks.faults.promise import (
    BROKEN,
    CORRECT,
    FAILED_CLEARLY,
    HUNG,
    WRONG,
    Recovery,
    counts_table,
    injector_count,
    proven,
    said,
)
from pd_sessions.checks.faults.scenario import Scenario, gatherer
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import digest_records
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting

NAME = "fault_mixup"
MODE = "mixup"


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the requests mixed up, how many each comparison caught."""
    return [
        *pick(
            details,
            ("requests", ""),
            ("mixed_up", ""),
            ("parity_detected", ""),
            ("digest_detected", ""),
            ("recovery_s", "s"),
        ),
        *([counts_table(details["counts"], "requests under the fault")] if "counts" in details else []),
    ]


def rate(caught: int | None, of: int) -> str:
    return "not run (no KV digest observer)" if caught is None else f"{caught}/{of}"


@reporting(numbers)
@proven(lambda d: [injector_count({MODE: d.get("mixed_up", 0)}, MODE)])
def evaluate(
    check: CheckResult,
    mixed: Sequence[str],
    recovery: Recovery,
    *,
    requests: int,
    digest_caught: Sequence[str] | None,
) -> CheckResult:
    """The verdict from the burst that ran under the fault.

    ``mixed``: the decode requests the injector gave another's KV in the burst;
    ``digest_caught``: those of them whose loaded blocks differ from what their prefill sent (None:
    no KV digest observer in this cluster).

    no load mixed up                                  -> NOT RUN "invalid" (promise.proven)
    a request hung or got no HTTP answer              -> fail, naming it
    neither parity nor the digest caught all N        -> fail: what parity saw, both rates
    the cluster not whole again                       -> fail, naming what
    otherwise                                         -> pass: caught N/N, both rates reported
    """
    compared, differ, prompts = detection(check)
    by_parity = parity_matched(len(mixed), requests=requests, differ=differ)
    by_digest = None if digest_caught is None else len(set(digest_caught) & set(mixed))
    seen = (
        f"{differ} of {compared} compared differ; the burst names no request ids: of the {len(mixed)} "
        f"mixed-up requests, {by_parity} must be among them"
    )
    by_kind = sort_failed(check.details.get("failures") or [])
    c = {
        CORRECT: compared - differ,
        FAILED_CLEARLY: len(by_kind[FAILED_CLEARLY]),
        WRONG: differ,
        HUNG: len(by_kind[HUNG]),
        BROKEN: len(by_kind[BROKEN]),
    }
    details: dict[str, Any] = {
        "requests": requests,
        "mixed_up": len(mixed),
        "mixed_requests": list(mixed),
        "parity_detected": by_parity,
        "digest_detected": by_digest,
        "parity_compared": compared,
        "parity_differ": differ,
        "detection": {"parity": rate(by_parity, len(mixed)), "kv_digest": rate(by_digest, len(mixed))},
        "differing_prompts": prompts,
        "counts": c,
        "recovery_s": round(recovery.seconds, 3),
        "check": check.to_dict(),
        "recovery": recovery.to_dict(),
    }
    caught = bool(mixed) and (by_parity == len(mixed) or by_digest == len(mixed))
    problems = [f"{len(fs)} request(s) {w}: {fs[0][:160]}" for fs, w in ((by_kind[HUNG], "hung"),
                (by_kind[BROKEN], "got no HTTP answer (broken)")) if fs]  # fmt: skip
    if not caught:
        problems.append(
            f"{len(mixed) - by_parity} of {len(mixed)} requests answered from another request's KV not "
            f"shown caught by parity ({seen}; {check.verdict.upper()}: {check.message[:160]}) and the "
            "KV digest caught "
            f"{rate(by_digest, len(mixed))}: neither caught every one"
        )
    if not recovery.ok:
        problems.append(recovery.line())
    if problems:
        return CheckResult(NAME, FAIL, f"mixup ({said(c)}): " + "; ".join(problems), details)
    return CheckResult(
        NAME,
        PASS,
        f"{len(mixed)} requests answered from another concurrent request's KV (HTTP 200): caught "
        f"{len(mixed)}/{len(mixed)}; parity: {seen}"
        + (f" (e.g. {prompts[0][:30]!r})" if prompts else "")
        + f", the KV digest {rate(by_digest, len(mixed))}; {recovery.line()}",
        details,
    )


def parity_matched(mixed: int, *, requests: int, differ: int) -> int:
    """How many of the ``mixed`` mixed-up requests parity is known to have caught, request by
    request. The burst names no request ids (its rows are prompts; the injector names vLLM's
    request ids), so a differing prompt is not matched to a mixed-up request: only what the counts
    force is claimed. Of the burst's ``requests``, ``requests - differ`` were not seen to differ
    (answered the same, or not compared); the mixed-up ones, burst requests all, can hide among
    those, so at least ``mixed - (requests - differ)`` of them differ. A difference on a request
    that was not mixed up, next to a mixed-up one answered the same, counts for none."""
    return max(0, min(mixed, differ, mixed - (requests - differ)))


def digest_mismatches(window: CheckWindow) -> list[str] | None:
    """The decode requests whose loaded blocks differ from their prefill's send, from every
    instance's KV digest side file (None when the cluster runs no digest observer)."""
    files = {s.name: kv_digest.digest_settings(s.argv) for s in window.plan.instances}
    if any(f is None for f in files.values()):
        return None
    records = {
        n: digest_records.parse(Path(str(f)).read_text(errors="replace"))
        for n, f in files.items()
        if Path(str(f)).exists()
    }
    return [str(m["req"]) for m in kv_digest.pair(records).mismatches]


@gatherer(NAME)
def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    s = Scenario(window, NAME)
    idle = s.gauges()
    n = int(options["requests"])
    s.inject(MODE)
    try:
        # a first load whose blocks a burst request finishing alone can take
        s.ask(window.plan.router.url, "Mixup donor: the ferryman rowed the twelve travellers", max_tokens=4)
        before = len(s.events())
        check = burst.run(window, {"requests": n, "max_tokens": int(options["max_tokens"])})
    finally:
        s.off()
    events = s.events()[before:]
    mixed = [str(e["req"]) for e in events if e.get("mode") == MODE and e.get("applied", True)]
    recovery = s.recover(idle)  # its probe also steps the prefill, which then digests its last sends
    return evaluate(check, mixed, recovery, requests=n, digest_caught=digest_mismatches(window))
