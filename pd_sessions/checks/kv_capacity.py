"""kv_capacity: no P/D instance holds materially less KV than the reference of the same model and
settings, prefill-0 (the instance parity and perf use as the prefill-direct, colocated reference).

The bug class (vllm#42024): a P/D instance silently runs with less KV capacity than the same
model served colocated, e.g. when the hybrid KV cache manager is switched off on a hybrid model
(every sliding-window layer then holds the whole context). Nothing fails; the instance only
preempts sooner and serves fewer requests at once.

vLLM exposes its cache configuration as a gauge (``vllm:cache_config_info``, one sample per
engine, the values as labels): ``kv_cache_size_tokens`` (the group-aware capacity in tokens,
right for hybrid models), else ``num_gpu_blocks`` x ``block_size``; and ``kv_cache_memory_bytes``
where the size was given in bytes. An instance's capacity is its smallest engine's.

Judged: every instance but prefill-0 whose per-engine shape equals prefill-0's (same TP); an
instance of another shape (decode_tp != prefill_tp) holds other amounts by design and is not
judged. What it cannot see: a loss that hits prefill-0 as much as every other instance (then the
reference is as small; docs/hop-faults.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.plan import ClusterPlan
from pd_sessions.core.results import FAIL, NOT_RUN, PASS, CheckResult, Figure, Table, reporting
from pd_sessions.runtime import http

METRIC = "vllm:cache_config_info"
REFERENCE = "prefill-0"


def capacity(metrics_text: str) -> dict[str, float | None]:
    """One scrape -> {"tokens": the smallest engine's KV capacity in tokens, "memory_bytes": its
    kv_cache_memory_bytes} (None where not exposed)."""
    tokens: list[float] = []
    memory: list[float] = []
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name != METRIC:
                continue
            t = _number(s.labels.get("kv_cache_size_tokens"))
            if t is None:
                blocks, size = _number(s.labels.get("num_gpu_blocks")), _number(s.labels.get("block_size"))
                t = blocks * size if blocks is not None and size is not None else None
            if t is not None:
                tokens.append(t)
            m = _number(s.labels.get("kv_cache_memory_bytes"))
            if m is not None:
                memory.append(m)
    return {"tokens": min(tokens) if tokens else None, "memory_bytes": min(memory) if memory else None}


def _number(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "", "None") else None
    except ValueError:
        return None


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    rows = details.get("instances", {})
    return [
        Figure("min_ratio", details.get("min_ratio")),
        Table(
            "KV capacity per instance",
            ("instance", "tokens", "kv_cache_memory_bytes", "vs reference", "judged"),
            tuple((n, r["tokens"], r["memory_bytes"], r.get("ratio"), r["judged"]) for n, r in rows.items()),
        ),
    ]


@reporting(numbers)
def evaluate(
    measured: Mapping[str, Mapping[str, float | None]], shapes: Mapping[str, int], *, min_ratio: float
) -> CheckResult:
    """``measured``: instance -> :func:`capacity`; ``shapes``: instance -> its TP.

    the reference's capacity not exposed            -> NOT RUN naming the metric
    no other instance of the reference's shape      -> NOT RUN (nothing to compare)
    an instance of that shape below min_ratio of it -> FAIL naming it and both numbers
    otherwise                                       -> PASS
    """
    ref = measured.get(REFERENCE, {}).get("tokens")
    rows: dict[str, dict[str, Any]] = {}
    for name, m in measured.items():
        same = name != REFERENCE and shapes.get(name) == shapes.get(REFERENCE)
        t = m.get("tokens")
        ratio = round(t / ref, 3) if same and t is not None and ref else None
        how = "reference" if name == REFERENCE else "yes" if same else "no: another TP than the reference"
        mem = m.get("memory_bytes")
        rows[name] = {
            "tokens": t,
            "memory_bytes": None if mem is None else int(mem),
            "ratio": ratio,
            "judged": how,
        }
    details: dict[str, Any] = {"min_ratio": min_ratio, "reference": REFERENCE, "instances": rows}
    if not ref:
        return CheckResult("kv_capacity", NOT_RUN, f"{REFERENCE} exposes no KV capacity ({METRIC})", details)
    judged = {n: r for n, r in rows.items() if r["judged"] == "yes"}
    unseen = [n for n, r in judged.items() if r["tokens"] is None]
    if not judged or unseen:
        why = (
            f"{', '.join(unseen)} expose(s) no KV capacity ({METRIC})"
            if unseen
            else "no instance shares its TP"
        )
        return CheckResult("kv_capacity", NOT_RUN, f"nothing to compare with {REFERENCE}: {why}", details)
    small = {n: r for n, r in judged.items() if r["ratio"] < min_ratio}
    if small:
        said = "; ".join(
            f"{n} holds {r['tokens']:.0f} tokens of KV (kv_cache_memory_bytes {r['memory_bytes']}) against "
            f"{REFERENCE}'s {ref:.0f} ({rows[REFERENCE]['memory_bytes']}): {r['ratio']:.0%}, "
            f"{cause(r, rows[REFERENCE])}"
            for n, r in small.items()
        )
        return CheckResult(
            "kv_capacity",
            FAIL,
            f"{said}; below {min_ratio:.0%} of the reference of the same model and settings: a silent KV "
            "capacity loss",
            details,
        )
    return CheckResult(
        "kv_capacity",
        PASS,
        f"{len(judged)} instance(s) hold {min(r['ratio'] for r in judged.values()):.0%} or more of "
        f"{REFERENCE}'s {ref:.0f} tokens of KV",
        details,
    )


def cause(row: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    """Where an instance's loss comes from: less KV memory (tokens per byte as the reference's),
    or fewer tokens in the same memory (another layout, e.g. the hybrid KV cache manager off on a
    hybrid model, or a capped block count); unknown without both memories."""
    mem, ref_mem = row.get("memory_bytes"), ref.get("memory_bytes")
    if not mem or not ref_mem:
        return "its KV cache memory is not exposed (cause unknown)"
    per_byte = (row["tokens"] / mem) / (ref["tokens"] / ref_mem)
    if per_byte >= 0.99:
        return f"the same tokens per byte as the reference: its KV cache memory is {mem / ref_mem:.0%} of it"
    return (
        f"{per_byte:.0%} of the reference's tokens per byte: its KV cache memory laid out otherwise or "
        "its blocks capped (e.g. the hybrid KV cache manager off on a hybrid model, "
        "--num-gpu-blocks-override)"
    )


def shapes(plan: ClusterPlan) -> dict[str, int]:
    """instance name -> its TP (the per-engine shape its KV capacity depends on)."""
    c = plan.config
    return {**{s.name: c.prefill_tp for s in plan.prefill}, **{s.name: c.decode_tp for s in plan.decode}}


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    """Gatherer: one /metrics scrape per instance."""
    plan = window.plan
    measured = {s.name: capacity(http.get_text(f"{s.url}/metrics")) for s in plan.instances}
    return evaluate(measured, shapes(plan), min_ratio=float(options["min_ratio"]))
