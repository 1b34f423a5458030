"""Proof that KV really moved: decode instances' /metrics deltas, checked against the identity
the connector's code implies, plus evidence that the transfers succeeded.

vLLM counts each prompt token a decode schedules by source in
``vllm:prompt_tokens_by_source_total``; ``source="external_kv_transfer"`` is KV that came through
the connector. Over a window in which only router (P/D) requests reached the decode instances,
the deltas must match, exactly and with no slack, what core/kv_identity.py states per connector:
external_kv_transfer = prompt - backoff - the decode's own cache hits, local_compute = backoff
per request (backoff: 0 for attention-only models, 1 for models with SSM layers). A connector that
silently recomputes, or loads part of a prompt, moves local_compute and fails.

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
from pd_sessions.core import connectors, kv_identity
from pd_sessions.core.connectors.base import MetricEvidence
from pd_sessions.core.kv_identity import Counts
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting

CONTROL_PROMPT = "A request sent straight to the decode instance, not through the router:"


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the router requests and their prompt tokens, the tokens the decodes
    received by KV transfer (seen, what the connector's identity expects, per decode), the other
    sources, and the connector's success evidence."""
    out: list[Figure | Table] = [
        *pick(
            details,
            ("router_requests", ""),
            ("router_prompt_tokens", "tokens"),
            ("delta", "tokens"),
        )
    ]
    want = details.get("expected") or {}
    if kv_identity.EXTERNAL in want:
        out.append(Figure("expected", want[kv_identity.EXTERNAL], "tokens"))
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
    by_source = details.get("by_source") or {}
    out += pick(
        by_source,
        (kv_identity.LOCAL_CACHE_HIT, "tokens"),
        (kv_identity.LOCAL_COMPUTE, "tokens"),
    )
    before, after = details.get("before") or {}, details.get("after") or {}
    if before:
        ext = kv_identity.EXTERNAL
        rows = []
        for n, b in before.items():
            b0 = b.get(ext, 0.0)
            a1 = (after.get(n) or {}).get(ext)
            rows.append((n, b0, a1, (a1 or 0.0) - b0))
        out.append(Table("external KV tokens by decode", ("decode", "before", "after", "delta"), tuple(rows)))
    return out


@reporting(numbers)
def evaluate(
    before: Mapping[str, Counts],
    after: Mapping[str, Counts],
    *,
    router_prompt_tokens: int,
    router_requests: int,
    connector: str,
    ssm: bool = False,
    control: tuple[str, float, float] | None = None,
    evidence: Evidence | None = None,
) -> CheckResult:
    """Verdict on the decode instances' prompt-token deltas by source and the success evidence.

    before/after: decode name -> its prompt tokens by source. ``connector`` and ``ssm`` (the
    model has SSM layers: the config's ``hybrid``) choose the identity (core/kv_identity.py).
    ``control`` is an optional (decode name, external before, after) around a request sent
    straight to that decode instance, which must not count as transferred. ``evidence`` is
    required for a pass: without it the scheduling-time counter alone cannot tell a failed
    transfer from a good one.

    no router requests                     -> fail
    no external tokens at all              -> fail: KV did not move, the decode recomputed it
    deltas != the identity (any source)    -> fail, naming each source, seen and expected
    no / failing success evidence          -> fail
    the control request moved the counter  -> fail
    otherwise                              -> pass
    """
    deltas = {name: after[name] - before[name] for name in before}
    total = sum(deltas.values(), Counts())
    details = counter_details(before, after, deltas, router_requests, router_prompt_tokens)
    wrong = counters_verdict(
        total,
        deltas,
        details,
        prompt_tokens=router_prompt_tokens,
        requests=router_requests,
        connector=connector,
        ssm=ssm,
    )
    if wrong:
        return CheckResult("kv_transfer", FAIL, wrong, details)
    rule = details["identity"]
    msg = (
        f"decode received {total.external:g} of {router_prompt_tokens} prompt tokens by KV transfer "
        f"for {router_requests} router requests, exactly as the identity says (local_cache_hit "
        f"{total.local_cache_hit:g}, local_compute {total.local_compute:g}; {rule})"
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
            f"{total.external:g} of {router_prompt_tokens} prompt tokens)",
            details,
        )
    msg += f"; {ev_details['summary']}"
    if control is not None:
        moved = control_verdict(control, details)
        if moved:
            return CheckResult("kv_transfer", FAIL, moved, details)
        msg += f"; a direct request to {control[0]} left it unchanged"
    return CheckResult("kv_transfer", PASS, msg, details)


def counter_details(
    before: Mapping[str, Counts],
    after: Mapping[str, Counts],
    deltas: Mapping[str, Counts],
    router_requests: int,
    router_prompt_tokens: int,
) -> dict[str, Any]:
    """The details every verdict of :func:`evaluate` starts from: the counters per decode before,
    after and their deltas, the total delta by source, and the router requests."""
    total = sum(deltas.values(), Counts())
    return {
        "metric": f'{METRIC}{{source="{SOURCE}"}}',
        "before": {n: c.as_dict() for n, c in before.items()},
        "after": {n: c.as_dict() for n, c in after.items()},
        "delta_by_decode": {n: c.as_dict() for n, c in deltas.items()},
        "delta": total.external,
        "by_source": total.as_dict(),
        "router_requests": router_requests,
        "router_prompt_tokens": router_prompt_tokens,
    }


def control_verdict(control: tuple[str, float, float], details: dict[str, Any]) -> str | None:
    """None when the request sent straight to a decode (``control``: its name, the external-KV
    counter before and after) left the counter still, else why that fails the check; the control
    is recorded in ``details`` either way."""
    name, c0, c1 = control
    details["control"] = {"decode": name, "before": c0, "after": c1}
    if c1 != c0:
        return (
            f"a request sent straight to {name} moved the external-KV counter by "
            f"{c1 - c0:g}: the counter does not tell transfers apart"
        )
    return None


def counters_verdict(
    total: Counts,
    deltas: Mapping[str, Counts],
    details: dict[str, Any],
    *,
    prompt_tokens: int,
    requests: int,
    connector: str,
    ssm: bool,
) -> str | None:
    """Why the decodes' prompt tokens by source (``total``, summed over ``deltas``) for
    ``requests`` router requests of ``prompt_tokens`` break the connector's identity, or None.
    Adds the identity and the expected counts to ``details``.

    no router requests                     -> "no router requests were made in the window"
    no external tokens at all              -> "... KV did not move, the decode recomputed it ..."
    deltas != the identity (any source)    -> each source, seen and expected
    """
    want = kv_identity.expected_sum(
        connector,
        ssm=ssm,
        prompt_tokens=prompt_tokens,
        requests=requests,
        local_cache_hit=total.local_cache_hit,
    )
    rule = kv_identity.describe(connector, ssm=ssm)
    details.update(identity=rule, expected=want.as_dict())
    if requests <= 0 or prompt_tokens <= 0:
        return "no router requests were made in the window"
    if total.external <= 0:
        return (
            f"decode instances received {total.external:g} prompt tokens by KV transfer, but "
            f"{requests} router requests carried {prompt_tokens} prompt tokens "
            f"(expected {want.external:g}): KV did not move, the decode recomputed it "
            f"(local_compute {total.local_compute:g}; deltas "
            f"{ {n: c.external for n, c in deltas.items()} })"
        )
    wrong = kv_identity.mismatches(total, want)
    if wrong:
        return (
            f"the decodes' prompt tokens for {requests} router requests of {prompt_tokens} prompt "
            f"tokens break the identity: {'; '.join(wrong)} ({rule}; seen {total})"
        )
    return None


# ---------------------------------------------------------------- gatherer (edge)


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    """Close the check window: decode /metrics after (the window held only router requests),
    the success evidence, then one control request straight to decode-0, which must leave the
    counter still; every instance must have served some of the window's router requests."""
    served_before = window.served_start()
    if window.errors:
        return CheckResult("kv_transfer", FAIL, f"could not read decode metrics: {window.errors[0]}")
    before, after = window.decode_before, instances.scrape_decode_counts(window.plan)
    external = {n: c.external for n, c in after.items()}
    evidence = (
        window.evidence.close(
            router_requests=window.router_requests,
            wait_s=evidence_wait({n: c.external for n, c in before.items()}, external),
        )
        if window.evidence
        else None
    )
    d0 = window.plan.decode[0]
    window.complete(d0.url, CONTROL_PROMPT)
    control_after = instances.scrape_decode(window.plan)[d0.name]
    config = window.plan.config
    r = evaluate(
        before,
        after,
        router_prompt_tokens=window.router_tokens,
        router_requests=window.router_requests,
        connector=config.connector,
        ssm=config.hybrid,
        control=(d0.name, external[d0.name], control_after),
        evidence=evidence,
    )
    if window.link_before is not None and r.passed:
        r = with_link(window, r, evidence)
    # the control request went to decode-0 only, after the window: compare up to `after`
    served_after = {**instances.scrape_served(window.plan), **external}
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
