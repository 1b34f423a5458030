"""perf: how fast P/D is, not only whether it works.

vLLM's own ``vllm bench serve`` (random dataset, fixed input and output lengths) runs at each
concurrency level (options ``concurrency``, ``requests``, ``input_len``, ``output_len``) twice:
through the router (P/D) and against prefill-0 directly (colocated: one instance does prefill
and decode). Its JSON result file gives TTFT, ITL, TPOT (p50, p99) and throughput for both, and
the P/D / colocated ratios. Around each P/D run the instances' /metrics (and, for Mooncake, the
prefills' "KV Transfer metrics" log lines) give where TTFT goes (:func:`perf_figures.ttft_split`)
and the effective KV bandwidth; then the transport alone moves a transfer of the same size in
the same descriptor size between two processes on the same devices, by the connector's own
operation in its direction (its spec's ``transfer_op``: a READ started on decode-0's device for NIXL's
pull, a WRITE started on prefill-0's for NIXL push and Mooncake; :func:`probe_command`)
(``python -m pd_sessions.vllm_side.link_probe``): "x GB/s = y % of what the transport itself moves here",
over the lanes it used (UCX's own report for NIXL, the protocol for Mooncake), and both against
the physical limit: the same bytes copied on the same devices (a shared-memory copy between two
processes on the CPU lane, a device-to-device or peer copy on a GPU; the NIC's line rate when the
probe's address is on one). The transport alone under 10 % of that limit is a finding, reported
with the lanes and the setting to try, never a verdict.
Last, P/D against colocated is judged by the lane's expectations (``[[expectation]]`` in
perf_baselines.toml: e.g. on the CPU lane ITL p50 P/D / colocated <= 2.5 and TTFT p50 P/D -
colocated within the handover's budget, at concurrency 1), and the figures are compared with
the perf baseline of this (model, connector, config, hardware class) (:mod:`perf_baselines`),
or recorded with ``--record-baseline`` (``pd-sessions perf-baseline``: from N runs).

Verdict (:func:`evaluate`): a request that failed in any run, a P/D run in which the connector
reported no transfer, a transport probe that failed, an expectation broken or a regression
beyond a baseline's tolerance on the same hardware fails the check, naming the figure, the
value and the bound. Otherwise a missing baseline (or a lane without expectations) makes it NOT
RUN, its reason first, what was judged after: the comparison that did not happen never reads as
a PASS. PASS only when both were judged and held.

Files: ``<run dir>/perf/`` holds every bench result (``pd-c1.json``...), the driver's and the
probe's logs and the probe's output.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_sessions.checks import perf_baselines
from pd_sessions.checks.perf_figures import (
    LinkProbe,
    Transfers,
    bench_figures,
    hist_deltas,
    limit_ratio,
    link_finding,
    link_probe_from,
    link_ratio,
    metric_transfers,
    mooncake_transfers,
    pd_over_colocated,
    percent,
    probe_size,
    transfer_histograms,
    ttft_split,
    window_means,
)
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import connectors
from pd_sessions.core.connectors.base import MetricEvidence
from pd_sessions.core.errors import ConfigError, PerfError
from pd_sessions.core.plan import ClusterPlan
from pd_sessions.core.results import FAIL, NOT_RUN, PASS, CheckResult, Figure, Table, Value
from pd_sessions.runtime import http, machine, process
from pd_sessions.runtime.cluster import Cluster

# Where the baseline figures' names come from: figure key of bench_figures -> baselined.
BASELINED = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "output_tok_s")
DRIVER_START_S = 300.0  # importing vLLM's benchmark: 20-30 s on 2 busy cores
RUN_TIMEOUT_S = 600.0
PROBE_TIMEOUT_S = 180.0
PROBE_REPEATS = 10
DEFAULT_STATS_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL when an instance does not set it


@dataclass(frozen=True)
class RunRecord:
    """One bench run and what the instances said about it."""

    target: str  # "pd" (through the router) | "colocated" (prefill-0 direct)
    concurrency: int
    figures: Mapping[str, float]  # perf_figures.bench_figures
    prefill_means: Mapping[str, float] = field(default_factory=dict)  # window means (P/D runs)
    decode_means: Mapping[str, float] = field(default_factory=dict)
    transfers: Transfers | None = None


# ---------------------------------------------------------------- pure


def baseline_figures(records: Sequence[RunRecord], ratio: float | None) -> dict[str, float]:
    """The figures baselines are kept for: each P/D run's BASELINED figures, and the link ratio."""
    out = {f"c{r.concurrency}.pd.{k}": r.figures[k] for r in records if r.target == "pd" for k in BASELINED}
    if ratio is not None:
        out["link_ratio"] = ratio
    return out


def expectation_figures(records: Sequence[RunRecord]) -> dict[str, float]:
    """At each level with both runs: ``c<N>.ratio.<m>_p<P>`` (P/D / colocated) and
    ``c<N>.excess.<m>_p<P>_ms`` (P/D - colocated, ms) of TTFT, ITL and TPOT, as the lane's
    expectations name them (perf_baselines.EXPECTATION_FIGURE)."""
    out: dict[str, float] = {}
    for pd in (r for r in records if r.target == "pd"):
        co = next((r for r in records if r.concurrency == pd.concurrency and r.target == "colocated"), None)
        if co is None:
            continue
        for m in ("ttft", "itl", "tpot"):
            for p in (50, 99):
                k = f"{m}_p{p}_ms"
                out[f"c{pd.concurrency}.excess.{k}"] = pd.figures[k] - co.figures[k]
                if co.figures[k] > 0:
                    out[f"c{pd.concurrency}.ratio.{m}_p{p}"] = pd.figures[k] / co.figures[k]
    return out


def _fig(name: str, value: float | None, unit: str) -> Figure:
    return Figure(name, None if value is None else round(value, 6), unit)


def _numbers(records: Sequence[RunRecord], link: LinkProbe | None) -> tuple[list[Figure], list[Table]]:
    """(figures, tables) in the results schema, for any reader of result.json (report.html)."""
    figures: list[Figure] = []
    lat = [f"{m}_p{p}_ms" for m in ("ttft", "itl", "tpot") for p in (50, 99)]
    cols = ("concurrency", "run", *[k.replace("_ms", " (ms)").replace("_", " ") for k in lat])
    vs_rows: list[tuple[Value, ...]] = []
    split: dict[str, dict[int, float | None]] = {}  # figure -> level -> ms
    kinds: dict[str, str] = {}
    bw_rows: list[tuple[Value, ...]] = []
    levels = sorted({r.concurrency for r in records})
    for c in levels:
        pd = next((r for r in records if r.concurrency == c and r.target == "pd"), None)
        co = next((r for r in records if r.concurrency == c and r.target == "colocated"), None)
        for r in (pd, co):
            if r is None:
                continue
            vs_rows.append(
                (c, r.target, *[round(r.figures[k], 3) for k in lat], round(r.figures["output_tok_s"], 2))
            )
            figures += [_fig(f"c{c}.{r.target}.{k}", r.figures[k], "ms") for k in lat]
            figures.append(_fig(f"c{c}.{r.target}.output_tok_s", r.figures["output_tok_s"], "tokens/s"))
        if pd and co:
            ratios = pd_over_colocated(pd.figures, co.figures)
            vs_rows.append((c, "P/D / colocated", *[_r(ratios[k]) for k in lat], _r(ratios["output_tok_s"])))
            figures += [_fig(f"c{c}.ratio.{k.replace('_ms', '')}", v, "x") for k, v in ratios.items()]
        if pd:
            for row in ttft_split(pd.figures, pd.prefill_means, pd.decode_means, pd.transfers):
                kinds.setdefault(row.figure, row.kind)
                split.setdefault(row.figure, {})[c] = None if row.ms is None else round(row.ms, 3)
                figures.append(_fig(f"c{c}.split.{row.figure.replace(' ', '_')}", row.ms, "ms"))
            t = pd.transfers
            if t is not None:
                bw_rows.append(_bandwidth_row(c, t, link))
                figures += [
                    _fig(f"c{c}.kv.gb_s", t.gb_s, "GB/s"),
                    _fig(f"c{c}.kv.bytes_per_transfer", t.bytes_per_transfer, "bytes"),
                    _fig(f"c{c}.kv.transfer_ms", t.mean_ms, "ms"),
                ]
                if link and link.limit:
                    figures.append(_fig(f"c{c}.kv.of_limit", limit_ratio(t.gb_s, link), "fraction"))
    if link:
        figures.append(_fig("link.transport_gb_s", link.gb_s, "GB/s"))
        if link.limit:
            figures.append(_fig("link.limit_gb_s", link.limit.gb_s, "GB/s"))
            figures.append(_fig("link.transport_of_limit", limit_ratio(link.gb_s, link), "fraction"))
    tables = [
        Table("P/D vs colocated (per request, vllm bench serve)", (*cols, "output tok/s"), tuple(vs_rows)),
        Table(
            "Where P/D TTFT goes (ms; per request = the bench's, window mean = the instances' "
            "/metrics over the run)",
            ("figure", "kind", *[f"c={c}" for c in levels]),
            tuple((f, kinds[f], *[split[f].get(c) for c in levels]) for f in split),
        ),
        Table(
            "KV bandwidth against the link (window over each P/D run; transport alone: the "
            "same bytes in the same descriptor size between two processes here; physical limit: "
            "the same bytes copied on the same devices)",
            (
                "concurrency",
                "transfers",
                "MiB per transfer",
                "descriptors per transfer",
                "transfer (ms, mean)",
                "effective GB/s",
                "transport alone GB/s",
                "% of the transport",
                "physical limit GB/s",
                "% of the limit",
                "transport alone, % of the limit",
            ),
            tuple(bw_rows),
        ),
    ]
    return figures, tables


def _bandwidth_row(c: int, t: Transfers, link: LinkProbe | None) -> tuple[Value, ...]:
    """One row of the bandwidth table: the window's transfers against the transport and the limit."""
    ratio = link_ratio(t.gb_s, link) if link else None
    of_limit = limit_ratio(t.gb_s, link) if link else None
    alone = limit_ratio(link.gb_s, link) if link else None
    return (
        c,
        round(t.count),
        round(t.bytes_per_transfer / 2**20, 3),
        round(t.descriptors / t.count, 1),
        round(t.mean_ms, 3),
        round(t.gb_s, 4),
        round(link.gb_s, 4) if link else None,
        _r(100 * ratio if ratio is not None else None),
        round(link.limit.gb_s, 4) if link and link.limit else None,
        None if of_limit is None else round(100 * of_limit, 4),
        None if alone is None else round(100 * alone, 4),
    )


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def evaluate(
    records: Sequence[RunRecord],
    *,
    requests: int,
    link: LinkProbe | None,
    error: str | None = None,
    baselines: Sequence[perf_baselines.PerfBaseline] = (),
    key: tuple[str, str, str, str] = ("", "", "", ""),
    expectations: Sequence[perf_baselines.Expectation] = (),
) -> CheckResult:
    """Verdict on the runs, the transport probe, the lane's expectations and the baseline (each
    problem named, in this order; the lane is the hardware class's, ``key[3]``):

    ``error``: what stopped the measurement (a bench run, the probe), if anything did
    a run whose requests did not all complete              -> FAIL (the P/D path dropped them)
    a P/D run in which the connector reported no transfer  -> FAIL (no split, no bandwidth)
    ``error``, or no transport figure                      -> FAIL (no link ratio)
    P/D vs colocated beyond the lane's expectation         -> FAIL: figure, value, bound
    a figure regressed beyond a same-hardware baseline     -> FAIL: figure, value, bound
    otherwise, no baseline of this key or no expectation   -> NOT RUN: what was not judged
      of the lane measured                                    first, then what was
    otherwise                                             -> PASS, naming what was judged

    The transport alone against the physical limit (the probe's copy of the same bytes on the same
    devices) is reported, never judged: under 10 % of it is a finding (perf_figures.link_finding)
    in the message and ``details["link"]["finding"]``, with the lanes used and the setting to try;
    the verdict is the same with or without it (the transport's configuration is the host's).
    """
    figures, tables = _numbers(records, link)
    pds = sorted((r for r in records if r.target == "pd"), key=lambda r: r.concurrency)
    first = pds[0] if pds else None
    ratio = link_ratio(first.transfers.gb_s, link) if first and first.transfers and link else None
    measured = baseline_figures(records, ratio)
    if ratio is not None:
        figures.append(_fig("link_ratio", ratio, "fraction"))
    vs = expectation_figures(records)
    figures += [_fig(k, v, "ms") for k, v in vs.items() if ".excess." in k]
    broken, expected = perf_baselines.judge_expectations(vs, expectations, perf_baselines.lane_of(key[3]))
    regression, base = perf_baselines.judge(measured, baselines, key)
    details = _details(records, link, error, base, measured)
    details["expectations"] = expected
    problems = []
    for r in records:
        done = r.figures.get("completed", 0)
        if r.figures.get("failed", 0) or done < requests:
            problems.append(f"{r.target} c={r.concurrency}: {done:g}/{requests} requests completed")
    silent = [f"c={r.concurrency}" for r in pds if r.transfers is None]
    if silent:
        problems.append(f"the connector reported no KV transfer in the P/D run(s) at {', '.join(silent)}")
    if error:
        problems.append(error)
    elif link is None:
        problems.append("the transport alone was not measured: no P/D transfer to size it")
    if broken:
        lane = expected["lane"]
        problems.append(f"P/D vs colocated beyond the {lane} lane's expectation: " + "; ".join(broken))
    if regression:
        problems.append(f"baseline {base['key']['hardware']}: {regression}")
    summary = _summary(records, link, ratio, base, expected)
    unjudged = [d["status"] for d in (expected, base) if d["status"] not in ("judged", "compared")]
    if problems:
        also = f"; not judged: {'; '.join(unjudged)}" if unjudged else ""
        message = "; ".join(problems) + f" ({summary}{also})"
        return CheckResult("perf", FAIL, message, details, figures=figures, tables=tables)
    verdict, message = (NOT_RUN, "; ".join(unjudged) + f" ({summary})") if unjudged else (PASS, summary)
    return CheckResult("perf", verdict, message, details, figures=figures, tables=tables)


def _details(
    records: Sequence[RunRecord],
    link: LinkProbe | None,
    error: str | None,
    base: dict[str, Any],
    measured: Mapping[str, float],
) -> dict[str, Any]:
    return {
        "baseline": base,
        "baseline_figures": dict(measured),
        "link": None if link is None else _link_details(link),
        "error": error,
        "runs": [
            {
                "target": r.target,
                "concurrency": r.concurrency,
                "figures": dict(r.figures),
                "prefill_means_s": dict(r.prefill_means),
                "decode_means_s": dict(r.decode_means),
            }
            for r in records
        ],
    }


def _link_details(link: LinkProbe) -> dict[str, Any]:
    """The probe in result.json: the transport alone, the lanes it used and where that was read,
    the physical limit, the NIC, and the finding (None: none)."""
    return {
        "transport": link.transport,
        "op": link.op or None,
        "bytes": link.bytes,
        "descriptors": link.descriptors,
        "seconds": list(link.seconds),
        "gb_s": link.gb_s,
        "transports": list(link.transports),
        "transports_source": link.transports_source,
        "advice": link.advice,
        "limit": None
        if link.limit is None
        else {"name": link.limit.name, "seconds": list(link.limit.seconds), "gb_s": link.limit.gb_s},
        "transport_of_limit": limit_ratio(link.gb_s, link),
        "nic": None if link.nic is None else dict(link.nic),
        "finding": link_finding(link),
    }


def _limit_summary(kv_gb_s: float, link: LinkProbe) -> str:
    """KV and the transport alone against the physical limit, then the finding if there is one."""
    assert link.limit is not None
    kv, alone = (limit_ratio(v, link) for v in (kv_gb_s, link.gb_s))
    text = (
        f"physical limit: {link.limit.name} {link.limit.gb_s:.3g} GB/s (KV {percent(kv or 0)} of it, "
        f"the transport alone {percent(alone or 0)})"
    )
    nic = link.nic or {}
    if nic.get("interface") not in (None, "lo"):  # the address the probe used is on a NIC
        rate = f"{nic['gb_s']:.3g} GB/s line rate" if nic.get("gb_s") else nic.get("note", "unknown")
        text += f"; NIC {nic['interface']}: {rate}"
    finding = link_finding(link)
    return f"{text}; finding (reported, not judged): {finding}" if finding else text


def _summary(
    records: Sequence[RunRecord],
    link: LinkProbe | None,
    ratio: float | None,
    base: Mapping[str, Any],
    expected: Mapping[str, Any],
) -> str:
    parts = []
    for c in sorted({r.concurrency for r in records}):
        pd = next((r for r in records if r.concurrency == c and r.target == "pd"), None)
        co = next((r for r in records if r.concurrency == c and r.target == "colocated"), None)
        if pd and co:
            f, g = pd.figures, co.figures
            parts.append(
                f"c={c}: TTFT p50 {f['ttft_p50_ms']:.1f} vs {g['ttft_p50_ms']:.1f} ms colocated, "
                f"ITL p50 {f['itl_p50_ms']:.2f} vs {g['itl_p50_ms']:.2f} ms"
            )
    first = min(
        (r for r in records if r.target == "pd" and r.transfers), key=lambda r: r.concurrency, default=None
    )
    if first and first.transfers and link and ratio is not None:
        parts.append(
            f"KV {first.transfers.gb_s:.3g} GB/s = {100 * ratio:.0f} % of what {link.transport} moves "
            f"here ({link.gb_s:.3g} GB/s"
            + (f", over {', '.join(link.transports)})" if link.transports else ", lanes not reported)")
        )
    if first and first.transfers and link and link.limit:
        parts.append(_limit_summary(first.transfers.gb_s, link))
    held = [r for r in expected.get("rows", []) if r["ok"]]
    if held:
        parts.append(
            f"P/D vs colocated within the {expected['lane']} lane's expectations: "
            + ", ".join(f"{r['figure']} {r['measured']:.3g} <= {r['max']:g}" for r in held)
        )
    if base.get("status") == "compared":
        ok = sum(1 for r in base["rows"] if r["ok"])
        link_row = next((r for r in base["rows"] if r["figure"] == "link_ratio"), None)
        parts.append(
            f"baseline of {', '.join(base['key'].values())} ({base.get('source', '').split(' by:')[0]}): "
            f"{ok}/{len(base['rows'])} figures within tolerance"
            + (
                f" (link_ratio {link_row['measured']:.3g} vs {link_row['baseline']:.3g}, allowed >= "
                f"{link_row['bound']:.3g})"
                if link_row
                else ""
            )
        )
    return "; ".join(parts)


# ---------------------------------------------------------------- gathering (edge)


@dataclass(frozen=True)
class Run:
    target: str
    concurrency: int
    url: str
    seed: int

    @property
    def label(self) -> str:
        return f"{self.target}-c{self.concurrency}"


def planned_runs(plan: ClusterPlan, concurrency: Sequence[int]) -> list[Run]:
    """At each level: through the router, then prefill-0 direct; each with its own dataset seed
    (the same prompts twice would hit prefill-0's prefix cache in the colocated run)."""
    runs: list[Run] = []
    for c in sorted(set(concurrency)):
        runs.append(Run("pd", c, plan.router.url, 1000 + len(runs)))
        runs.append(Run("colocated", c, plan.prefill[0].url, 1000 + len(runs)))
    return runs


def bench_argv(plan: ClusterPlan, run: Run, options: Mapping[str, Any], result_dir: Path) -> list[str]:
    """``vllm bench serve``'s command line for one run (the same flags in vLLM 0.26 and 0.32)."""
    argv = [
        "--backend", "openai", "--base-url", run.url, "--endpoint", "/v1/completions",
        "--model", plan.served_model_name, "--tokenizer", plan.model,
        "--dataset-name", "random", "--random-input-len", str(options["input_len"]),
        "--random-output-len", str(options["output_len"]), "--random-range-ratio", "0.0",
        "--num-prompts", str(options["requests"]), "--max-concurrency", str(run.concurrency),
        "--seed", str(run.seed), "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{run.label}.json",
        "--disable-tqdm",
    ]  # fmt: skip
    if plan.config.trust_remote_code:
        argv.append("--trust-remote-code")
    return argv


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    """Atomically, as pd_sessions.vllm_side.perf_driver reads and writes its files."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


class Driver:
    """The bench driver process (``python -m pd_sessions.vllm_side.perf_driver``) and its request files."""

    def __init__(self, cluster: Cluster, folder: Path, env: Mapping[str, str]):
        self.cluster, self.folder, self.n = cluster, folder, 0
        argv = [cluster.plan.instances[0].argv[0], "-m", "pd_sessions.vllm_side.perf_driver", str(folder)]
        self.proc = process.spawn("perf-driver", argv, env=env, log_path=folder / "perf-driver.log")

    def wait(self, name: str, timeout_s: float, what: str) -> dict[str, Any]:
        """The driver's answer file ``name``, once written; PerfError if it exits or takes
        longer than ``timeout_s`` (a cluster process that dies meanwhile fails the config)."""
        path = self.folder / name

        def poll() -> dict[str, Any]:
            end = time.monotonic() + timeout_s
            while not path.exists():
                if self.proc.poll() is not None:
                    raise PerfError(
                        f"the bench driver exited with status {self.proc.poll()} waiting {what}; "
                        f"last lines of {self.proc.log_path}:\n{self.proc.log_tail(30)}"
                    )
                if time.monotonic() > end:
                    raise PerfError(
                        f"the bench driver took over {timeout_s:g} s {what} ({self.proc.log_path})"
                    )
                time.sleep(0.05)
            return dict(json.loads(path.read_text()))

        return self.cluster.guard(poll, when=f"while the perf check waited {what}")

    def run(self, argv: Sequence[str], label: str) -> None:
        _write_json(self.folder / f"run-{self.n}.json", {"argv": list(argv)})
        done = self.wait(f"done-{self.n}.json", RUN_TIMEOUT_S, f"for the bench run {label}")
        self.n += 1
        if not done.get("ok"):
            raise PerfError(f"vllm bench serve ({label}) failed: {done.get('error')} ({self.proc.log_path})")

    def stop(self, grace_s: float) -> None:
        _write_json(self.folder / f"run-{self.n}.json", {"quit": True})
        process.stop([self.proc], grace_s=grace_s)


def scrape_all(plan: ClusterPlan) -> dict[str, str]:
    """instance name -> its /metrics text."""
    return {s.name: http.get_text(f"{s.url}/metrics", timeout=10.0) for s in plan.instances}


def stats_interval(plan: ClusterPlan) -> float:
    """The instances' VLLM_LOG_STATS_INTERVAL (connector stats reach /metrics and the log on it)."""
    env = plan.prefill[0].env_dict()
    try:
        return float(env.get("VLLM_LOG_STATS_INTERVAL", DEFAULT_STATS_INTERVAL_S))
    except ValueError:
        return DEFAULT_STATS_INTERVAL_S


def _log_since(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def transfers_over(
    cluster: Cluster, before: Mapping[str, str], offsets: Mapping[str, int], completed: float
) -> tuple[Transfers | None, dict[str, str]]:
    """The connector's transfers since ``before``/``offsets`` (the run's start), and the
    /metrics texts after. Every transfer of a run ends before its request's first token, but the
    connector's stats are flushed on the stats interval: poll until they cover the run, at most
    one interval and 2 s.

    metric evidence (NIXL)  done when the histograms of the evidence's role (the decodes'
                            reads; push mode: the prefills' writes) count one per completed request
    log evidence (Mooncake) done when a prefill logs a stats line after the run ended (it covers
                            every send until then; none for an interval without sends: the bound)
    """
    plan = cluster.plan
    evidence = connectors.get(plan.config.connector).evidence
    ended = {s.name: _size(cluster.run_dir / s.log_name) for s in plan.prefill}
    end = time.monotonic() + stats_interval(plan) + 2.0
    while True:
        after = scrape_all(plan)
        if isinstance(evidence, MetricEvidence):
            side = [s.name for s in (plan.decode if evidence.role == "decode" else plan.prefill)]
            t = metric_transfers(hist_deltas(before, after, side, transfer_histograms(evidence)), evidence)
            done = t is not None and t.count >= completed
        else:
            t = mooncake_transfers(
                [_log_since(cluster.run_dir / s.log_name, offsets[s.name]) for s in plan.prefill]
            )
            later = [_log_since(cluster.run_dir / s.log_name, ended[s.name]) for s in plan.prefill]
            done = mooncake_transfers(later) is not None
        if done or time.monotonic() > end:
            return t, after
        time.sleep(0.25)


def measure_runs(
    window: CheckWindow,
    options: Mapping[str, Any],
    folder: Path,
    env: Mapping[str, str],
    records: list[RunRecord],
) -> None:
    """Every planned bench run, appended to ``records`` as it ends, with the instances' figures
    around each P/D run."""
    cluster, plan = window.cluster, window.plan
    prefills, decodes = [s.name for s in plan.prefill], [s.name for s in plan.decode]
    driver = Driver(cluster, folder, env)
    try:
        driver.wait("ready.json", DRIVER_START_S, "to import vLLM's benchmark")
        for run in planned_runs(plan, options["concurrency"]):
            before = scrape_all(plan)
            offsets = {s.name: _size(cluster.run_dir / s.log_name) for s in plan.prefill}
            driver.run(bench_argv(plan, run, options, folder), run.label)
            result_file = folder / f"{run.label}.json"
            try:
                doc = json.loads(result_file.read_text())
            except (OSError, ValueError) as e:
                raise PerfError(f"no usable result from vllm bench serve ({run.label}): {e}") from None
            figs = bench_figures(doc, source=str(result_file))
            if run.target != "pd":
                records.append(RunRecord(run.target, run.concurrency, figs))
                continue
            transfers, after = transfers_over(cluster, before, offsets, figs["completed"])
            records.append(
                RunRecord(
                    run.target,
                    run.concurrency,
                    figs,
                    window_means(hist_deltas(before, after, prefills)),
                    window_means(hist_deltas(before, after, decodes)),
                    transfers,
                )
            )
    finally:
        driver.stop(grace_s=5.0)


def probe_command(
    plan: ClusterPlan, nbytes: int, descs: int, out: Path, env: Mapping[str, str]
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the link probe: the connector's transfer operation (its spec's
    ``transfer_op``) started where the connector starts it. READ: the probing process on decode-0's
    device reads the peer's buffer on prefill-0's (the decode pulls); WRITE: on prefill-0's device,
    it writes into the peer's on decode-0's (the prefill pushes). The environment is the starting
    instance's."""
    p0, d0 = plan.prefill[0], plan.decode[0]
    spec = connectors.get(plan.config.connector)
    mine, peer = (p0, d0) if spec.transfer_op == "WRITE" else (d0, p0)
    argv = [p0.argv[0], "-m", "pd_sessions.vllm_side.link_probe",
            "--transport", spec.package.name, "--op", spec.transfer_op,
            "--kv-transfer-config", p0.argv[p0.argv.index("--kv-transfer-config") + 1],
            "--bytes", str(nbytes), "--descriptors", str(descs), "--repeats", str(PROBE_REPEATS),
            "--host", plan.config.host, "--out", str(out)]  # fmt: skip
    probe_env = {**env, **mine.env_dict()}
    gpus = list(dict.fromkeys([*p0.gpus, *d0.gpus]))
    if gpus:  # both devices visible; each side on its own instance's GPU
        probe_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        argv += ["--device", "cuda", "--peer-gpu", str(gpus.index(peer.gpus[0]))]
        argv += ["--gpu", str(gpus.index(mine.gpus[0]))]
    return argv, probe_env


def probe_link(cluster: Cluster, transfers: Transfers, folder: Path, env: Mapping[str, str]) -> LinkProbe:
    """The transport alone, between two processes on prefill-0's and decode-0's devices, moving the
    window's mean transfer in its mean descriptor size by the connector's operation
    (:func:`probe_command`, ``python -m pd_sessions.vllm_side.link_probe``)."""
    nbytes, descs = probe_size(transfers)
    out = folder / "link-probe.json"
    out.unlink(missing_ok=True)
    argv, probe_env = probe_command(cluster.plan, nbytes, descs, out, env)
    proc = process.spawn("link-probe", argv, env=probe_env, log_path=folder / "link-probe.log")
    try:
        rc = cluster.guard(proc.popen.wait, when="while the transport probe ran", timeout=PROBE_TIMEOUT_S)
    finally:
        process.stop([proc], grace_s=5.0)
    doc = json.loads(out.read_text()) if out.exists() else {}
    if rc != 0 or "error" in doc or "seconds" not in doc:
        raise PerfError(
            f"python -m pd_sessions.vllm_side.link_probe exited with status {rc}: {doc.get('error', '')} "
            f"(log: {proc.log_path})\n{proc.log_tail(15)}"
        )
    return link_probe_from(doc)


def hardware(plan: ClusterPlan) -> str:
    """The hardware class the baseline is keyed by: the GPUs the instances run on, else the cores."""
    gpus = sorted({g for s in plan.instances for g in s.gpus})
    return perf_baselines.hardware_class(machine.gpu_names(gpus), len(os.sched_getaffinity(0)))


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    """Gatherer: the bench runs, the transport probe, the baseline (recorded with --record-baseline)."""
    cluster, plan = window.cluster, window.plan
    folder = cluster.run_dir / "perf"
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    requests = int(options["requests"])
    records: list[RunRecord] = []
    link: LinkProbe | None = None
    error = None
    try:
        measure_runs(window, options, folder, env, records)
        first = next((r.transfers for r in sorted(records, key=lambda r: r.concurrency) if r.transfers), None)
        if first is not None:
            link = probe_link(cluster, first, folder, env)
    except PerfError as e:
        error = str(e)
    if error and not records:
        return CheckResult("perf", FAIL, f"could not run: {error}", {"folder": str(folder)})
    key = (plan.config.model, plan.config.connector, plan.config.name, hardware(plan))
    path = Path(options.get("baselines") or perf_baselines.BASELINES)
    result = evaluate(
        records,
        requests=requests,
        link=link,
        error=error,
        baselines=perf_baselines.load(path),
        key=key,
        expectations=perf_baselines.load_expectations(path),
    )
    result.details["folder"] = str(folder)
    if options.get("record_baseline") and not result.failed:
        return record(result, key, path)
    return result


def record(result: CheckResult, key: tuple[str, str, str, str], path: Path) -> CheckResult:
    """--record-baseline: write this run's figures as the baseline of ``key`` (a FAIL naming the
    entry when the file has one already: it is removed by hand, never overwritten). The verdict
    stays what it was (NOT RUN: this run was not judged against a baseline, it is one); the
    default tolerances of one run; ``pd-sessions perf-baseline`` measures them over N runs."""
    entry = perf_baselines.new_entry(
        key,
        result.details["baseline_figures"],
        source=f"recorded {datetime.date.today().isoformat()} by: {shlex.join(sys.argv)}",
    )
    try:
        perf_baselines.record(path, entry)
    except ConfigError as e:
        result.verdict, result.message = FAIL, f"{e}; measured: {result.message}"
        return result
    result.details["recorded"] = entry
    result.message = f"recorded the perf baseline of {key} in {path}; {result.message}"
    return result
