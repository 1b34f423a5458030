"""The perf check's figures, from what it gathered (pure: no request, no process).

Three sources, each read by one function here:

- ``vllm bench serve``'s JSON result file (``--save-result``; never its console text):
  :func:`bench_figures` -> TTFT, ITL, TPOT (p50, p99, mean, in ms) and throughput. These are
  **per request** figures: percentiles over the run's requests, as vLLM's tool computes them.
- the instances' ``/metrics`` before and after a run: :func:`hist_deltas` -> for each vLLM
  histogram the sum and count it gained, so :func:`window_means` gives **means over the
  window** (sum / count of the requests that finished inside it): the prefill's queue and
  compute time, its whole request, the decode's queue time and its own TTFT, NIXL's transfer
  and post times, bytes and descriptors per transfer.
- Mooncake's "KV Transfer metrics" log lines (vLLM exposes no Mooncake metrics):
  :func:`mooncake_transfers` -> the same transfer totals from the prefill logs' lines added in
  the window (each line holds an interval's count and averages: count x average = total).

:func:`ttft_split` puts them together per concurrency level (where TTFT goes), and
:func:`link_ratio` sets the effective KV bandwidth against the transport's own, :func:`limit_ratio`
against the physical limit the probe measured, and :func:`link_finding` says when the transport
alone is under 10 % of that limit (a finding, reported, never a verdict).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pd_sessions.core.connectors.base import MetricEvidence
from pd_sessions.core.errors import PerfError

# vLLM's histograms (seconds unless named otherwise), by a short key.
HISTOGRAMS: dict[str, str] = {
    "ttft": "vllm:time_to_first_token_seconds",  # arrival at this instance -> its first token
    "queue": "vllm:request_queue_time_seconds",  # waiting before first scheduled
    "prefill": "vllm:request_prefill_time_seconds",  # first scheduled -> first token
    "e2e": "vllm:e2e_request_latency_seconds",  # arrival -> finished
}
# A connector's transfer histograms join these under "kv_" + the key of its spec's evidence
# (MetricEvidence.histograms: kv_xfer, kv_bytes, kv_post, kv_descs): transfer_histograms().
KV = "kv_"
# The bench result's latency figures: what vLLM's tool calls them, and the percentiles asked for.
LATENCIES = ("ttft", "itl", "tpot", "e2el")
PERCENTILES = (50, 99)
_MB = 2**20


def bench_figures(result: Mapping[str, Any], *, source: str = "bench result") -> dict[str, float]:
    """The figures of one ``vllm bench serve`` result (its JSON file, parsed).

    -> {"ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", ... for ttft, itl, tpot, e2el;
        "output_tok_s", "request_s", "completed", "failed", "duration_s"}
    A missing key raises PerfError naming it and ``source``.
    """
    out: dict[str, float] = {}

    def take(key: str, name: str) -> None:
        value = result.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise PerfError(f"{source}: no number under {key!r} (has: {', '.join(sorted(result)[:40])})")
        out[name] = float(value)

    for m in LATENCIES:
        take(f"mean_{m}_ms", f"{m}_mean_ms")
        for p in PERCENTILES:
            take(f"p{p}_{m}_ms", f"{m}_p{p}_ms")
    take("output_throughput", "output_tok_s")
    take("request_throughput", "request_s")
    take("completed", "completed")
    take("duration", "duration_s")
    out["failed"] = float(result.get("failed") or 0)
    return out


def pd_over_colocated(pd: Mapping[str, float], colocated: Mapping[str, float]) -> dict[str, float | None]:
    """P/D / colocated for every latency percentile and the throughputs (None where colocated
    is 0: nothing to divide by)."""
    keys = [f"{m}_p{p}_ms" for m in ("ttft", "itl", "tpot") for p in PERCENTILES]
    keys += ["output_tok_s", "request_s"]
    return {k: (pd[k] / colocated[k] if colocated.get(k) else None) for k in keys}


# ---------------------------------------------------------------- /metrics windows


def transfer_histograms(evidence: MetricEvidence) -> dict[str, str]:
    """The connector's transfer histograms, keyed as :func:`metric_transfers` reads them."""
    return {KV + k: name for k, name in evidence.histograms.items()}


def hist_totals(metrics_text: str, extra: Mapping[str, str] | None = None) -> dict[str, tuple[float, float]]:
    """key of :data:`HISTOGRAMS` (and of ``extra``: key -> histogram) -> (sum, count) in one
    scrape, summed over label sets (engines, models); histograms the instance does not expose
    are left out."""
    names = {**HISTOGRAMS, **(extra or {})}
    wanted = {f"{name}_{part}": (key, part) for key, name in names.items() for part in ("sum", "count")}
    sums: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            hit = wanted.get(s.name)
            if hit:
                pair = sums.setdefault(hit[0], [0.0, 0.0])
                pair[0 if hit[1] == "sum" else 1] += s.value
    return {k: (v[0], v[1]) for k, v in sums.items()}


def hist_deltas(
    before: Mapping[str, str],
    after: Mapping[str, str],
    names: Sequence[str],
    extra: Mapping[str, str] | None = None,
) -> dict[str, tuple[float, float]]:
    """What the instances ``names`` gained over a window: key -> (sum, count), from their
    /metrics texts before and after (instance name -> text); ``extra`` as in :func:`hist_totals`."""
    out: dict[str, list[float]] = {}
    for n in names:
        b, a = hist_totals(before.get(n, ""), extra), hist_totals(after.get(n, ""), extra)
        for key, (s, c) in a.items():
            s0, c0 = b.get(key, (0.0, 0.0))
            pair = out.setdefault(key, [0.0, 0.0])
            pair[0] += s - s0
            pair[1] += c - c0
    return {k: (v[0], v[1]) for k, v in out.items()}


def window_means(deltas: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """key -> mean per observation over the window (sum / count), for keys observed at least once."""
    return {k: s / c for k, (s, c) in deltas.items() if c > 0}


# ---------------------------------------------------------------- KV transfers


@dataclass(frozen=True)
class Transfers:
    """KV transfers over a window, from the connector's own figures."""

    source: str  # where they come from (a role's /metrics and histograms, or its log lines)
    count: float
    seconds: float  # summed transfer time
    bytes: float
    descriptors: float
    post_seconds: float | None = None  # summed time to post the transfers, where measured
    post_source: str = ""  # where post_seconds comes from

    @property
    def mean_ms(self) -> float:
        return 1000 * self.seconds / self.count if self.count else 0.0

    @property
    def bytes_per_transfer(self) -> float:
        return self.bytes / self.count if self.count else 0.0

    @property
    def descriptor_bytes(self) -> float:
        """The mean size of one descriptor (block-sized pieces: what the raw transfer copies)."""
        return self.bytes / self.descriptors if self.descriptors else 0.0

    @property
    def gb_s(self) -> float:
        """Effective bandwidth: bytes / transfer time (GB = 1e9 bytes)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def metric_transfers(deltas: Mapping[str, tuple[float, float]], evidence: MetricEvidence) -> Transfers | None:
    """The transfers of a window from the connector's histograms (the deltas of ``evidence.role``'s
    instances, keyed as :func:`transfer_histograms`); None when none completed."""
    count = deltas.get(KV + "xfer", (0.0, 0.0))[1]
    if count <= 0:
        return None
    h = evidence.histograms
    post = deltas.get(KV + "post")
    return Transfers(
        source=f"{evidence.role} /metrics ({h['xfer']}, {h['bytes']})",
        count=count,
        seconds=deltas[KV + "xfer"][0],
        bytes=deltas.get(KV + "bytes", (0.0, 0.0))[0],
        descriptors=deltas.get(KV + "descs", (0.0, 0.0))[0],
        post_seconds=None if post is None else post[0],
        post_source=f"{evidence.role} {h['post']}" if "post" in h else "",
    )


_STATS_RE = re.compile(r"KV Transfer metrics: (.*)$")


def mooncake_transfers(log_texts: Sequence[str]) -> Transfers | None:
    """Mooncake's sends of a window, from the "KV Transfer metrics: Num successful transfers=N,
    Avg xfer time (ms)=T, Avg MB per transfer=M, ..., Avg number of descriptors=D" lines the
    prefills logged in it (count x average per line; MB = 2**20 bytes, as vLLM logs them).
    None when no line reports a successful transfer."""
    count = seconds = nbytes = descs = 0.0
    for text in log_texts:
        for line in text.splitlines():
            m = _STATS_RE.search(line)
            if not m:
                continue
            fields = {}
            for part in m.group(1).split(", "):
                key, _, value = part.partition("=")
                try:
                    fields[key.strip()] = float(value)
                except ValueError:
                    continue
            n = fields.get("Num successful transfers", 0.0)
            if n <= 0:
                continue
            count += n
            seconds += n * fields.get("Avg xfer time (ms)", 0.0) / 1000
            nbytes += n * fields.get("Avg MB per transfer", 0.0) * _MB
            descs += n * fields.get("Avg number of descriptors", 0.0)
    if count <= 0:
        return None
    return Transfers(
        source='prefill logs ("KV Transfer metrics" lines)',
        count=count,
        seconds=seconds,
        bytes=nbytes,
        descriptors=descs,
    )


# ---------------------------------------------------------------- where TTFT goes


@dataclass(frozen=True)
class SplitRow:
    figure: str
    ms: float | None  # None: not measured (the reason is in ``kind``)
    kind: str  # "per request (bench): ..." or "window mean: ..."


def ttft_split(
    bench: Mapping[str, float],
    prefill: Mapping[str, float],
    decode: Mapping[str, float],
    transfers: Transfers | None,
) -> list[SplitRow]:
    """Where the P/D TTFT of one run goes. ``bench``: :func:`bench_figures` of the router run;
    ``prefill``/``decode``: :func:`window_means` of the prefill / decode instances over it.

    client TTFT p50, mean      per request (the bench)
    prefill: queue, compute    window means on the prefills (request_queue_time,
                               request_prefill_time)
    prefill request, whole     window mean of the prefills' e2e_request_latency: the prefill
                               hop (vllm-router sends the decode hop once it answered)
    KV transfer                window mean per transfer (NIXL: decode's nixl_xfer_time, and
                               its post time; Mooncake: the prefill's send time)
    decode: queue, own TTFT    window means on the decodes (arrival -> first token there,
                               which holds the KV wait)
    handover                   client TTFT mean - prefill request mean: from the prefill done
                               to the client's first token (router hop, KV transfer, the
                               decode's queue and first step), derived from the two means
    """

    def ms(means: Mapping[str, float], key: str) -> float | None:
        return 1000 * means[key] if key in means else None

    rows = [
        SplitRow("client TTFT p50", bench.get("ttft_p50_ms"), "per request (bench): p50"),
        SplitRow("client TTFT mean", bench.get("ttft_mean_ms"), "per request (bench): mean"),
        SplitRow("prefill queue", ms(prefill, "queue"), "window mean: prefill request_queue_time"),
        SplitRow("prefill compute", ms(prefill, "prefill"), "window mean: prefill request_prefill_time"),
        SplitRow("prefill request", ms(prefill, "e2e"), "window mean: prefill e2e_request_latency"),
    ]
    if transfers is not None:
        kind = f"window mean per transfer: {transfers.source}"
        rows.append(SplitRow("KV transfer", transfers.mean_ms, kind))
        if transfers.post_seconds is not None:
            rows.append(
                SplitRow(
                    "KV transfer post",
                    1000 * transfers.post_seconds / transfers.count,
                    f"window mean per transfer: {transfers.post_source}",
                )
            )
    else:
        rows.append(SplitRow("KV transfer", None, "not measured: the connector reported no transfer"))
    rows += [
        SplitRow("decode queue", ms(decode, "queue"), "window mean: decode request_queue_time"),
        SplitRow("decode TTFT", ms(decode, "ttft"), "window mean: decode time_to_first_token"),
    ]
    mean, hop = bench.get("ttft_mean_ms"), ms(prefill, "e2e")
    rows.append(
        SplitRow(
            "handover",
            mean - hop if mean is not None and hop is not None else None,
            "derived: client TTFT mean - prefill request mean",
        )
    )
    return rows


# ---------------------------------------------------------------- bandwidth against the link


def _median(seconds: Sequence[float]) -> float:
    s = sorted(seconds)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


@dataclass(frozen=True)
class LinkLimit:
    """What the hardware moves: the same bytes copied on the same devices (the probe's ``limit``)."""

    name: str  # "device-to-device copy on GPU 0", "shared-memory copy between two processes"
    bytes: int
    seconds: tuple[float, ...]

    @property
    def gb_s(self) -> float:
        return self.bytes / _median(self.seconds) / 1e9 if self.seconds and _median(self.seconds) > 0 else 0.0


@dataclass(frozen=True)
class LinkProbe:
    """What the transport alone moved between the same two endpoints (pd_sessions.vllm_side.link_probe),
    which lanes it used, and the physical limit of the same bytes there."""

    transport: str  # "NIXL (UCX)", "Mooncake transfer engine (tcp)"
    bytes: int  # per transfer
    descriptors: int  # per transfer
    seconds: tuple[float, ...]  # each timed transfer
    transports: tuple[str, ...] = ()  # the lanes used ("cma/memory", "tcp/lo"; Mooncake: "tcp")
    transports_source: str = "not reported"  # where the lanes were read, or why they are unknown
    advice: str | None = None  # the probe's: what it used instead of the fast lane, what to set
    limit: LinkLimit | None = None
    nic: Mapping[str, Any] | None = None  # {"interface", "gb_s", "note"}
    op: str = ""  # the operation timed: "READ", "WRITE" ("": an older probe's, which did not say)

    @property
    def median_s(self) -> float:
        return _median(self.seconds)

    @property
    def gb_s(self) -> float:
        return self.bytes / self.median_s / 1e9 if self.seconds and self.median_s > 0 else 0.0


def link_probe_from(doc: Mapping[str, Any]) -> LinkProbe:
    """A LinkProbe from the probe's JSON output (PerfError naming what is missing); the lanes, the
    limit and the NIC are optional (an older probe's output has none)."""
    try:
        limit = doc.get("limit")
        return LinkProbe(
            transport=str(doc["transport"]),
            bytes=int(doc["bytes"]),
            descriptors=int(doc["descriptors"]),
            seconds=tuple(float(s) for s in doc["seconds"]),
            transports=tuple(str(t) for t in doc.get("transports") or ()),
            transports_source=str(doc.get("transports_source") or "not reported"),
            advice=None if doc.get("advice") is None else str(doc["advice"]),
            limit=None
            if not limit
            else LinkLimit(str(limit["name"]), int(doc["bytes"]), tuple(float(s) for s in limit["seconds"])),
            nic=dict(doc["nic"]) if doc.get("nic") else None,
            op=str(doc.get("op") or ""),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise PerfError(f"link probe output lacks {e}: {dict(doc)}") from None


def link_ratio(effective_gb_s: float, raw: LinkProbe) -> float | None:
    """Effective KV bandwidth / what the transport itself moves here (None without a raw figure)."""
    return effective_gb_s / raw.gb_s if raw.gb_s > 0 else None


def limit_ratio(gb_s: float, raw: LinkProbe) -> float | None:
    """``gb_s`` / the physical limit the probe measured (None without one)."""
    return gb_s / raw.limit.gb_s if raw.limit is not None and raw.limit.gb_s > 0 else None


FINDING_BELOW = 0.10  # the transport alone under this share of the physical limit is a finding


def link_finding(raw: LinkProbe) -> str | None:
    """A finding, for people, when the transport alone moves under FINDING_BELOW of the physical
    limit of the same bytes: how much it moved, what share of what, the lanes it used and (the
    probe's advice) what to set. None at or above it, or without a limit. A finding is reported
    (message, details), never a verdict: a slow transport is the host's configuration, which
    the connector under test did not choose (the link ratio judges the connector against it)."""
    share = limit_ratio(raw.gb_s, raw)
    if share is None or raw.limit is None or share >= FINDING_BELOW:
        return None
    if raw.advice:
        why = raw.advice
    elif raw.transports:
        why = f"it used {', '.join(raw.transports)}"
    else:
        why = f"its lanes are unknown ({raw.transports_source})"
    return (
        f"{raw.transport} moved {raw.gb_s:.3g} GB/s, {percent(share)} of the {raw.limit.name} "
        f"({raw.limit.gb_s:.3g} GB/s, under {100 * FINDING_BELOW:g} %): {why}"
    )


def percent(share: float) -> str:
    """A share as a percentage with the digits a small one needs (0.02 %, 3.4 %, 45 %)."""
    pct = 100 * share
    return f"{pct:.2g} %" if pct < 10 else f"{pct:.0f} %"


def probe_size(transfers: Transfers, *, max_bytes: int = 1 << 30) -> tuple[int, int]:
    """(bytes per transfer, descriptors) for the raw transfer: the window's mean transfer in its
    mean descriptor size, at least one descriptor, capped at ``max_bytes``."""
    desc = max(1, round(transfers.descriptor_bytes))
    n = max(1, round(transfers.bytes_per_transfer / desc))
    n = min(n, max(1, max_bytes // desc))
    return desc * n, n
