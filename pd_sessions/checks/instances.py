"""Small gatherer helpers shared by the edge checks: tokenizing through an instance, the
block size an instance runs with, gauges from /metrics (prometheus_client's parser), health
of every process. Edges only: each makes one request or reads one plan field."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pd_sessions.checks.kv_transfer import sample_sums
from pd_sessions.core.plan import CPU_DEFAULT_BLOCK_SIZE, ClusterPlan, ProcessSpec
from pd_sessions.runtime import http

# vLLM's default --block-size on GPUs when a config leaves it unset.
GPU_DEFAULT_BLOCK_SIZE = 16
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
# How long one check request may take before it counts as stuck (a tiny model answers in
# well under a second even on 2 CPU cores; a KV pull that never completes never answers).
REQUEST_TIMEOUT_S = 60.0


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


def gauges(metrics_text: str, names: Sequence[str]) -> dict[str, float]:
    """Each named gauge summed over engines/models (absent ones are left out)."""
    return sample_sums(metrics_text, names)


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
