"""Per-instance counting for clusters with several instances per role (xPyD): over a window of
router requests, every prefill must have computed prompt tokens (``vllm:prompt_tokens_total``)
and every decode must have received some by KV transfer. A router that ignores an instance
(a wrong bootstrap port, a dead worker it routes around) fails the KV proof and parity.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from pd_sessions.checks import kv_transfer
from pd_sessions.core.plan import ClusterPlan
from pd_sessions.core.results import FAIL, CheckResult
from pd_sessions.runtime import http

PREFILL_METRIC = "vllm:prompt_tokens_total"


def prefill_tokens(metrics_text: str) -> float:
    """Sum of PREFILL_METRIC over engines in one scrape (0 when absent)."""
    return sum(
        s.value
        for f in text_string_to_metric_families(metrics_text)
        for s in f.samples
        if s.name == PREFILL_METRIC
    )


def scrape(plan: ClusterPlan) -> dict[str, float]:
    """name -> the counter that grows when that instance serves a P/D request."""
    out = {p.name: prefill_tokens(http.get_text(f"{p.url}/metrics")) for p in plan.prefill}
    out.update({d.name: kv_transfer.external_tokens(http.get_text(f"{d.url}/metrics")) for d in plan.decode})
    return out


def idle_instances(
    before: Mapping[str, float],
    after: Mapping[str, float],
    *,
    requests: int,
    roles: Mapping[str, int],
    direct: Mapping[str, float] | None = None,
) -> list[str]:
    """Instances whose counter did not move over ``requests`` router requests, not counting
    ``direct`` (tokens sent straight to an instance in the window, e.g. parity's baselines).

        a role with one instance          -> not judged (the KV proof itself covers it)
        requests < instances of that role -> not judged (round robin cannot reach them all)
        otherwise                         -> every instance of the role must have moved
    """
    idle = []
    for name in before:
        role = name.rsplit("-", 1)[0]
        n = roles.get(role, 1)
        moved = after.get(name, 0.0) - before[name] - (direct or {}).get(name, 0.0)
        if n > 1 and requests >= n and moved <= 0:
            idle.append(name)
    return idle


def apply(
    result: CheckResult,
    before: Mapping[str, float],
    after: Mapping[str, float],
    *,
    requests: int,
    roles: Mapping[str, int],
    direct: Mapping[str, float] | None = None,
) -> CheckResult:
    """``result`` with the per-instance counts added; a pass becomes a fail when an instance idled."""
    direct = direct or {}
    result.details["served_by_instance"] = {
        n: after.get(n, 0.0) - before[n] - direct.get(n, 0.0) for n in before
    }
    idle = idle_instances(before, after, requests=requests, roles=roles, direct=direct)
    if idle and result.passed:
        return CheckResult(
            result.name,
            FAIL,
            f"{', '.join(idle)} served none of {requests} router "
            f"requests (counter unchanged: {PREFILL_METRIC} on prefills, external KV "
            f"tokens on decodes): the router ignores it; {result.message}",
            result.details,
        )
    return result
