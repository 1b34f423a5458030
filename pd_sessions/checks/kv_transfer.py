"""Proof that KV really moved: decode instances' /metrics deltas.

vLLM counts each prompt token a request did not compute itself by source in
``vllm:prompt_tokens_by_source_total``; ``source="external_kv_transfer"`` is
KV that came through the connector. Over a window in which only router
(P/D) requests reached the decode instances, the delta must cover the prompt
tokens of those requests. A connector that silently recomputes leaves it flat.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from pd_sessions.checks.base import FAIL, PASS, CheckResult

METRIC = "vllm:prompt_tokens_by_source_total"
SOURCE = "external_kv_transfer"
# A connector may recompute the last prompt token locally; allow that much per request.
SLACK_PER_REQUEST = 1


class MetricMissing(Exception):
    pass


def external_tokens(metrics_text: str) -> float:
    """Sum of METRIC{source=external_kv_transfer} over all engines/models in one scrape."""
    total, seen = 0.0, False
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == METRIC and s.labels.get("source") == SOURCE:
                total += s.value
                seen = True
    if not seen:
        names = sorted({f.name for f in text_string_to_metric_families(metrics_text)
                        if "prompt_tokens" in f.name})
        raise MetricMissing(f"{METRIC}{{source=\"{SOURCE}\"}} not exposed (prompt-token metrics seen: "
                            f"{', '.join(names) or 'none'})")
    return total


def evaluate(before: Mapping[str, float], after: Mapping[str, float], *, router_prompt_tokens: int,
             router_requests: int, control: tuple[str, float, float] | None = None) -> CheckResult:
    """Verdict on the decode instances' external-KV counter deltas.

    before/after: decode name -> counter value. ``control`` is an optional
    (decode name, before, after) around a request sent straight to that decode
    instance, which must not count as transferred.
    """
    deltas = {name: after[name] - before[name] for name in before}
    total = sum(deltas.values())
    need = router_prompt_tokens - SLACK_PER_REQUEST * router_requests
    details = {"metric": f'{METRIC}{{source="{SOURCE}"}}', "before": dict(before), "after": dict(after),
               "delta_by_decode": deltas, "delta": total, "router_requests": router_requests,
               "router_prompt_tokens": router_prompt_tokens, "required": need}
    if router_requests <= 0 or router_prompt_tokens <= 0:
        return CheckResult("kv_transfer", FAIL, "no router requests were made in the window", details)
    if total < need or total <= 0:
        return CheckResult("kv_transfer", FAIL,
                           f"decode instances received {total:g} prompt tokens by KV transfer, but "
                           f"{router_requests} router requests carried {router_prompt_tokens} prompt "
                           f"tokens (need >= {need}): KV did not move, the decode recomputed it "
                           f"(deltas {deltas})", details)
    msg = (f"decode received {total:g} prompt tokens by KV transfer for {router_requests} router "
           f"requests of {router_prompt_tokens} prompt tokens")
    if control is not None:
        name, c0, c1 = control
        details["control"] = {"decode": name, "before": c0, "after": c1}
        if c1 != c0:
            return CheckResult("kv_transfer", FAIL,
                               f"a request sent straight to {name} moved the external-KV counter by "
                               f"{c1 - c0:g}: the counter does not tell transfers apart", details)
        msg += f"; a direct request to {name} left it unchanged"
    return CheckResult("kv_transfer", PASS, msg, details)
