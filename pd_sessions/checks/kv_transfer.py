"""Proof that KV really moved: decode instances' /metrics deltas plus evidence that
the transfers succeeded.

vLLM counts each prompt token a request did not compute itself by source in
``vllm:prompt_tokens_by_source_total``; ``source="external_kv_transfer"`` is
KV that came through the connector. Over a window in which only router
(P/D) requests reached the decode instances, the delta must cover the prompt
tokens of those requests. A connector that silently recomputes leaves it flat.

That counter counts when a request is *scheduled* with external tokens, not when
the transfer succeeds, so the proof also requires success evidence (connector metrics,
"KV Transfer metrics" log lines, no failure lines): see :mod:`pd_sessions.checks.evidence`.

Pure: :func:`evaluate`. :func:`run` is the gatherer: it closes the check window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pd_sessions.checks import instances, kv_link
from pd_sessions.checks.evidence import Evidence, evidence_wait, success_verdict
from pd_sessions.checks.instances import METRIC, SOURCE
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import connectors
from pd_sessions.core.connectors.base import MetricEvidence
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting

# A connector may recompute the last prompt token locally; allow that much per request.
SLACK_PER_REQUEST = 1
CONTROL_PROMPT = "A request sent straight to the decode instance, not through the router:"


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the router requests and their prompt tokens, the tokens the decodes
    received by KV transfer (needed and per decode), and the connector's success evidence."""
    out: list[Figure | Table] = [
        *pick(
            details,
            ("router_requests", ""),
            ("router_prompt_tokens", "tokens"),
            ("required", "tokens"),
            ("delta", "tokens"),
        )
    ]
    success = details.get("success") or {}
    # what the connector's evidence counted (checks/evidence.py): completed transfers and their
    # bytes from metrics, or successful and failed transfers from the stats lines
    out += pick(
        success,
        ("transfers", ""),
        ("transfer_bytes", "bytes"),
        ("successful_transfers", ""),
        ("failed_transfers", ""),
    )
    before, after = details.get("before") or {}, details.get("after") or {}
    if before:
        out.append(
            Table(
                "external KV tokens by decode",
                ("decode", "before", "after", "delta"),
                tuple((n, b, after.get(n), (after.get(n) or 0.0) - b) for n, b in before.items()),
            )
        )
    return out


@reporting(numbers)
def evaluate(
    before: Mapping[str, float],
    after: Mapping[str, float],
    *,
    router_prompt_tokens: int,
    router_requests: int,
    control: tuple[str, float, float] | None = None,
    evidence: Evidence | None = None,
) -> CheckResult:
    """Verdict on the decode instances' external-KV counter deltas and the success evidence.

    before/after: decode name -> counter value. ``control`` is an optional
    (decode name, before, after) around a request sent straight to that decode
    instance, which must not count as transferred. ``evidence`` is required for a
    pass: without it the scheduling-time counter alone cannot tell a failed
    transfer from a good one.
    """
    deltas = {name: after[name] - before[name] for name in before}
    total = sum(deltas.values())
    need = router_prompt_tokens - SLACK_PER_REQUEST * router_requests
    details: dict[str, Any] = {
        "metric": f'{METRIC}{{source="{SOURCE}"}}',
        "before": dict(before),
        "after": dict(after),
        "delta_by_decode": deltas,
        "delta": total,
        "router_requests": router_requests,
        "router_prompt_tokens": router_prompt_tokens,
        "required": need,
    }
    if router_requests <= 0 or router_prompt_tokens <= 0:
        return CheckResult("kv_transfer", FAIL, "no router requests were made in the window", details)
    if total < need or total <= 0:
        return CheckResult(
            "kv_transfer",
            FAIL,
            f"decode instances received {total:g} prompt tokens by KV transfer, but "
            f"{router_requests} router requests carried {router_prompt_tokens} prompt "
            f"tokens (need >= {need}): KV did not move, the decode recomputed it "
            f"(deltas {deltas})",
            details,
        )
    msg = (
        f"decode received {total:g} prompt tokens by KV transfer for {router_requests} router "
        f"requests of {router_prompt_tokens} prompt tokens"
    )
    if evidence is None:
        return CheckResult(
            "kv_transfer",
            FAIL,
            msg + ", but no success evidence was gathered: the "
            "counter counts at scheduling time, not on success",
            details,
        )
    reason, ev_details = success_verdict(evidence, router_requests=router_requests)
    details["success"] = ev_details
    if reason:
        return CheckResult(
            "kv_transfer",
            FAIL,
            f"{reason} (the scheduling-time counter rose by "
            f"{total:g} of {router_prompt_tokens} prompt tokens)",
            details,
        )
    msg += f"; {ev_details['summary']}"
    if control is not None:
        name, c0, c1 = control
        details["control"] = {"decode": name, "before": c0, "after": c1}
        if c1 != c0:
            return CheckResult(
                "kv_transfer",
                FAIL,
                f"a request sent straight to {name} moved the external-KV counter by "
                f"{c1 - c0:g}: the counter does not tell transfers apart",
                details,
            )
        msg += f"; a direct request to {name} left it unchanged"
    return CheckResult("kv_transfer", PASS, msg, details)


# ---------------------------------------------------------------- gatherer (edge)


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    """Close the check window: decode /metrics after (the window held only router requests),
    the success evidence, then one control request straight to decode-0, which must leave the
    counter still; every instance must have served some of the window's router requests."""
    served_before = window.served_start()
    if window.errors:
        return CheckResult("kv_transfer", FAIL, f"could not read decode metrics: {window.errors[0]}")
    before, after = window.decode_before, instances.scrape_decode(window.plan)
    evidence = (
        window.evidence.close(router_requests=window.router_requests, wait_s=evidence_wait(before, after))
        if window.evidence
        else None
    )
    d0 = window.plan.decode[0]
    window.complete(d0.url, CONTROL_PROMPT)
    control_after = instances.scrape_decode(window.plan)[d0.name]
    r = evaluate(
        before,
        after,
        router_prompt_tokens=window.router_tokens,
        router_requests=window.router_requests,
        control=(d0.name, after[d0.name], control_after),
        evidence=evidence,
    )
    if window.link_before is not None and r.passed:
        r = with_link(window, r, evidence)
    # the control request went to decode-0 only, after the window: compare up to `after`
    served_after = {**instances.scrape_served(window.plan), **after}
    return window.count_served(
        r, served_before, served_after, requests=window.router_requests, direct=window.direct
    )


def link_bytes(plan: Any, r: CheckResult, log_text: Mapping[str, str]) -> tuple[float, str]:
    """(the KV bytes the connector reports for the window, where from): its metric evidence's bytes
    (the success verdict's ``transfer_bytes``), or for log evidence the prefill logs' "KV Transfer
    metrics" lines (successes x their mean size)."""
    spec = connectors.get(plan.config.connector)
    ev = spec.evidence
    if isinstance(ev, MetricEvidence):
        nbytes = float(r.details.get("success", {}).get("transfer_bytes", 0.0))
        return nbytes, f"{spec.title} reported ({ev.role} {ev.bytes})"
    if ev.mean_mib is None:
        return 0.0, f"{spec.title} reports no transfer sizes"
    total = sum(kv_link.logged_bytes(log_text.get(s.name, ""), ev.success, ev.mean_mib) for s in plan.prefill)
    return total, f'{spec.title} logged ("KV Transfer metrics": {ev.success} x {ev.mean_mib})'


def with_link(window: CheckWindow, r: CheckResult, ev: Evidence | None) -> CheckResult:
    """Across hosts, ``r`` judged also on the link (checks/kv_link.py): the interface counters
    of the prefill and decode hosts over the window against the KV bytes the connector reports."""
    plan, before = window.plan, window.link_before
    after = window.cluster.launcher.link_counters(plan)
    if before is None or after is None or ev is None:
        return r
    kv_bytes, source = link_bytes(plan, r, window.evidence.window_text() if window.evidence else {})
    reason, details = kv_link.evaluate(
        before,
        after,
        prefill_hosts=sorted({s.node for s in plan.prefill if s.node}),
        decode_hosts=sorted({s.node for s in plan.decode if s.node}),
        kv_bytes=kv_bytes,
        source=source,
    )
    r.details["link"] = details
    if reason:
        return CheckResult("kv_transfer", FAIL, f"{reason} ({r.message})", r.details)
    r.message += "; " + kv_link.said(details)
    return r
