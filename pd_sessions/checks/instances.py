"""What the checks read from the instances, and per-instance counting.

- /metrics: the external-KV prompt-token counter of a decode (:func:`external_tokens`), its prompt
  tokens by every source (:func:`prompt_counts`, for the KV accounting of core/kv_identity.py), the
  prompt tokens a prefill computed (:func:`prefill_tokens`), any sum of samples
  (:func:`sample_sums`, :func:`gauges`), parsed with prometheus_client;
- /tokenize, the block size an instance runs with, the /health of every process;
- per-instance counting for clusters with several instances per role (xPyD): over a window of
  router requests, every prefill must have computed prompt tokens (``vllm:prompt_tokens_total``)
  and every decode must have received some by KV transfer. A router that ignores an instance
  (a wrong bootstrap port, a dead worker it routes around) fails the KV proof and parity.

Parsing is pure; the scrapes and requests make one request each, or read one plan field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from pd_sessions.core.kv_identity import Counts
from pd_sessions.core.plan import CPU_DEFAULT_BLOCK_SIZE, ClusterPlan, ProcessSpec
from pd_sessions.core.results import FAIL, CheckResult, Table
from pd_sessions.runtime import http

# vLLM counts each prompt token a request did not compute itself by source;
# source="external_kv_transfer" is KV that came through the connector (see checks/kv_transfer.py).
METRIC = "vllm:prompt_tokens_by_source_total"
SOURCE = "external_kv_transfer"
PREFILL_METRIC = "vllm:prompt_tokens_total"
# vLLM's default --block-size on GPUs when a config leaves it unset.
GPU_DEFAULT_BLOCK_SIZE = 16
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
# How long one check request may take before it counts as stuck (a tiny model answers in
# well under a second even on 2 CPU cores; a KV pull that never completes never answers).
REQUEST_TIMEOUT_S = 60.0


class MetricMissing(Exception):
    pass


# ---------------------------------------------------------------- /metrics (pure)


def external_tokens(metrics_text: str) -> float:
    """Sum of METRIC{source=external_kv_transfer} over all engines/models in one scrape."""
    total, seen = 0.0, False
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == METRIC and s.labels.get("source") == SOURCE:
                total += s.value
                seen = True
    if not seen:
        names = sorted(
            {f.name for f in text_string_to_metric_families(metrics_text) if "prompt_tokens" in f.name}
        )
        raise MetricMissing(
            f'{METRIC}{{source="{SOURCE}"}} not exposed (prompt-token metrics seen: '
            f"{', '.join(names) or 'none'})"
        )
    return total


def prompt_counts(metrics_text: str) -> Counts:
    """METRIC by every source (external_kv_transfer, local_cache_hit, local_compute), each summed
    over engines/models in one scrape. MetricMissing when the external source is not exposed."""
    external_tokens(metrics_text)  # raises MetricMissing, naming what is there
    by_source: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == METRIC:
                src = s.labels.get("source", "")
                by_source[src] = by_source.get(src, 0.0) + s.value
    return Counts.from_sources(by_source)


def sample_sums(metrics_text: str, names: Iterable[str]) -> dict[str, float]:
    """name -> sum over label sets, for the sample names of ``names`` present in the scrape
    (absent names are left out: vLLM registers a connector's metrics only with that connector)."""
    wanted = set(names)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name in wanted:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def gauges(metrics_text: str, names: Sequence[str]) -> dict[str, float]:
    """Each named gauge summed over engines/models (absent ones are left out)."""
    return sample_sums(metrics_text, names)


def prefill_tokens(metrics_text: str) -> float:
    """Sum of PREFILL_METRIC over engines in one scrape (0 when absent)."""
    return sum(
        s.value
        for f in text_string_to_metric_families(metrics_text)
        for s in f.samples
        if s.name == PREFILL_METRIC
    )


# ---------------------------------------------------------------- requests (edge)


@dataclass(frozen=True)
class Tokenized:
    tokens: tuple[int, ...]
    max_model_len: int


def tokenize(url: str, model: str, prompt: str, *, timeout: float = 30.0) -> Tokenized:
    """vLLM's /tokenize on one instance: the prompt's token ids (as a completion sees them)."""
    resp = http.post_json(f"{url}/tokenize", {"model": model, "prompt": prompt}, timeout=timeout)
    return Tokenized(tuple(resp["tokens"]), int(resp["max_model_len"]))


def block_size(plan: ClusterPlan, spec: ProcessSpec | None = None) -> int:
    """The --block-size ``spec`` (default decode-0) runs with, from its argv."""
    argv = list((spec or plan.decode[0]).argv)
    if "--block-size" in argv:
        return int(argv[argv.index("--block-size") + 1])
    return CPU_DEFAULT_BLOCK_SIZE if plan.platform == "cpu" else GPU_DEFAULT_BLOCK_SIZE


def scrape_gauges(
    spec: ProcessSpec, names: Sequence[str] = (RUNNING, WAITING, KV_USAGE), timeout: float = 5.0
) -> dict[str, float]:
    return gauges(http.get_text(f"{spec.url}/metrics", timeout=timeout), names)


def health(specs: Sequence[ProcessSpec], timeout: float = 5.0) -> dict[str, str]:
    """name -> "ok" or why not, for each process's /health."""
    out = {}
    for s in specs:
        try:
            status, _ = http.request(s.health_url, timeout=timeout)
            out[s.name] = "ok" if status == 200 else f"HTTP {status}"
        except http.HttpError as e:
            out[s.name] = e.reason
    return out


def scrape_decode(plan: ClusterPlan) -> dict[str, float]:
    """decode name -> its external-KV prompt-token counter (:func:`external_tokens`)."""
    return {name: c.external for name, c in scrape_decode_counts(plan).items()}


def scrape_decode_counts(plan: ClusterPlan) -> dict[str, Counts]:
    """decode name -> its prompt tokens by source (:func:`prompt_counts`)."""
    return {s.name: prompt_counts(http.get_text(f"{s.url}/metrics")) for s in plan.decode}


# ---------------------------------------------------------------- per-instance counting (xPyD)


def scrape_served(plan: ClusterPlan) -> dict[str, float]:
    """name -> the counter that grows when that instance serves a P/D request."""
    out = {p.name: prefill_tokens(http.get_text(f"{p.url}/metrics")) for p in plan.prefill}
    out.update(scrape_decode(plan))
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


def apply_served(
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
    result.tables.append(
        Table(
            "served by instance", ("instance", "served"), tuple(result.details["served_by_instance"].items())
        )
    )
    idle = idle_instances(before, after, requests=requests, roles=roles, direct=direct)
    if idle and result.passed:
        return dataclasses.replace(
            result,
            verdict=FAIL,
            message=f"{', '.join(idle)} served none of {requests} router "
            f"requests (counter unchanged: {PREFILL_METRIC} on prefills, external KV "
            f"tokens on decodes): the router ignores it; {result.message}",
        )
    return result
