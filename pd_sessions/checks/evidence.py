"""Success evidence of KV transfers, beside the scheduling-time counter (see checks/kv_transfer.py).

vLLM's external-KV counter counts when a request is *scheduled* with external tokens, not when
the transfer succeeds: on an H200 every NIXL handshake failed (unequal block sizes), every
request returned empty text, and the counter still rose by nearly every prompt token. So the
KV proof also requires success evidence:

- NIXL: the decode side's ``vllm:nixl_xfer_time_seconds_count`` (one observation per
  completed transfer) must rise by at least one per router request and
  ``vllm:nixl_bytes_transferred_sum`` must rise; ``vllm:nixl_num_failed_transfers``
  and ``vllm:nixl_num_failed_notifications`` must not move.
- Mooncake: vLLM (0.26 and 0.32) exposes no Mooncake Prometheus metrics (its stats.py
  says "TODO(mooncake-stats): add MooncakePromMetrics"); the sender (prefill) logs
  "KV Transfer metrics: Num successful transfers=N, ... Num failed transfers=M ..." on
  each stats interval. Over the window at least one transfer must have succeeded and
  none failed (several small requests may share one logged transfer batch).
- Every connector: no line of any instance's log (from its start: the router's readiness
  probe is a P/D request too) may match the connectors' failure messages
  (:data:`FAILURE_PATTERNS`); the first ones are named in the verdict (e.g. NIXL's
  "handshake_setup_failed ... Local block size 240 is not divisible by remote block size 128").

Pure: :func:`failure_lines`, :func:`transfer_stats`, :func:`success_verdict`,
:func:`evidence_wait`. :class:`Window` reads the logs and the connector metrics (its scrape is
passed in).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pd_sessions.checks.instances import sample_sums

# Prometheus sample names (after the text parser: counters end in _total, histograms
# have _count/_sum), summed over every label set (engine, model) of one scrape.
NIXL_SUCCESS_COUNT = "vllm:nixl_xfer_time_seconds_count"
NIXL_SUCCESS_BYTES = "vllm:nixl_bytes_transferred_sum"
NIXL_FAILURES = ("vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_failed_notifications_total")
NIXL_METRICS = (NIXL_SUCCESS_COUNT, NIXL_SUCCESS_BYTES, *NIXL_FAILURES)

# Lines of an instance log that mean a transfer failed (vLLM 0.26/0.32 NIXL and Mooncake
# connectors). Matched case-sensitively, anywhere in the line.
FAILURE_PATTERNS: tuple[str, ...] = (
    r"NIXL transfer failure",  # nixl base_worker._log_failure (all kinds)
    r"handshake_setup_failed",
    r"is not divisible by remote block size",  # the handshake's block-size check
    r"pulling kv_caches for .* failed",  # mooncake decode
    r"Mooncake transfer engine returned",
    r"Sending to \S+ failed \(ret=",  # mooncake prefill
    r"Error in Mooncake sender thread",
    r"Error processing Mooncake xfer request",
)
_FAILURE_RE = re.compile("|".join(f"(?:{p})" for p in FAILURE_PATTERNS))
# vLLM's periodic connector-stats line ("KV Transfer metrics: Num successful transfers=3, ...").
_STATS_RE = re.compile(r"KV Transfer metrics: (.*)$")
MAX_LOG_LINES_SHOWN = 5


def failure_lines(log_text: str) -> list[str]:
    """Lines of ``log_text`` that match a connector failure message, in order.

    A failure logged with a traceback ends with the exception's own line (e.g.
    "RuntimeError: Local block size 240 is not divisible ..."); the pattern for that
    text catches it too, so no traceback parsing is needed.
    """
    return [line.strip() for line in log_text.splitlines() if _FAILURE_RE.search(line)]


def transfer_stats(log_text: str) -> dict[str, float]:
    """Sum of the numeric fields of every "KV Transfer metrics:" line of ``log_text``
    (e.g. {"Num successful transfers": 4, "Num failed transfers": 0, ...}); counts add up,
    averages are not used."""
    out: dict[str, float] = {}
    for line in log_text.splitlines():
        m = _STATS_RE.search(line)
        if not m:
            continue
        for part in m.group(1).split(", "):
            key, _, value = part.partition("=")
            try:
                out[key.strip()] = out.get(key.strip(), 0.0) + float(value)
            except ValueError:
                continue
    return out


@dataclass(frozen=True)
class Evidence:
    """What the gatherer saw besides the scheduling-time counter (all over the window)."""

    connector: str  # "nixl" | "mooncake"
    # decode name -> {sample name: value} before/after (NIXL_METRICS; empty for mooncake)
    metrics_before: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    metrics_after: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # instance name -> failure lines in its log (from the start: the readiness probe counts too)
    log_failures: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # prefill name -> summed "KV Transfer metrics" fields its log gained (mooncake)
    log_stats: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


def _deltas(ev: Evidence) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, after in ev.metrics_after.items():
        before = ev.metrics_before.get(name, {})
        for k, v in after.items():
            out[k] = out.get(k, 0.0) + v - before.get(k, 0.0)
    return out


def success_verdict(ev: Evidence, *, router_requests: int) -> tuple[str | None, dict[str, Any]]:
    """(failure reason or None, details) from the success evidence alone.

    log failure lines in the window                  -> fail, naming the first lines
    nixl: metrics absent from decode /metrics        -> fail (cannot prove success)
    nixl: a failure counter rose                     -> fail
    nixl: xfer count rose < router_requests, or
          bytes transferred did not rise             -> fail (scheduled, not transferred)
    mooncake: no "KV Transfer metrics" line          -> fail (cannot prove success; the
                                                        line needs log stats on)
    mooncake: failed transfers/recvs > 0             -> fail
    mooncake: successful transfers < 1               -> fail
    otherwise                                        -> None (pass)
    """
    details: dict[str, Any] = {"connector": ev.connector}
    bad_logs = {n: list(lines) for n, lines in ev.log_failures.items() if lines}
    details["log_failures"] = {n: lines[:MAX_LOG_LINES_SHOWN] for n, lines in bad_logs.items()}
    if bad_logs:
        shown = [f"{n}: {line}" for n, lines in bad_logs.items() for line in lines][:MAX_LOG_LINES_SHOWN]
        total = sum(len(v) for v in bad_logs.values())
        return (
            f"{total} connector failure line(s) in the instance logs: " + " | ".join(s[:300] for s in shown)
        ), details
    if ev.connector == "nixl":
        d = _deltas(ev)
        details["nixl_before"] = {k: dict(v) for k, v in ev.metrics_before.items()}
        details["nixl_after"] = {k: dict(v) for k, v in ev.metrics_after.items()}
        details["nixl_delta"] = d
        if NIXL_SUCCESS_COUNT not in d or NIXL_SUCCESS_BYTES not in d:
            return (
                f"decode /metrics has no {NIXL_SUCCESS_COUNT} / {NIXL_SUCCESS_BYTES}: the NIXL "
                "connector's success cannot be proven (is the decode a NIXL consumer?)"
            ), details
        failed = {k: d[k] for k in NIXL_FAILURES if d.get(k, 0) > 0}
        if failed:
            return f"NIXL failure counters rose: {failed}", details
        count, nbytes = d[NIXL_SUCCESS_COUNT], d[NIXL_SUCCESS_BYTES]
        if count < router_requests or nbytes <= 0:
            return (
                f"NIXL completed {count:g} transfers ({nbytes:g} bytes) for {router_requests} "
                f"router requests: requests were scheduled for KV transfer but the transfers "
                f"did not complete"
            ), details
        return None, details
    if ev.connector == "mooncake":
        details["mooncake_log_stats"] = {k: dict(v) for k, v in ev.log_stats.items()}
        if not ev.log_stats:
            return (
                'no prefill logged "KV Transfer metrics" in the window: Mooncake\'s success '
                "cannot be proven (vLLM exposes no Mooncake metrics; its stats line needs log "
                "stats on, i.e. no --disable-log-stats)"
            ), details
        ok = sum(s.get("Num successful transfers", 0) for s in ev.log_stats.values())
        failed_n = sum(
            s.get("Num failed transfers", 0) + s.get("Num failed recvs", 0) for s in ev.log_stats.values()
        )
        details["mooncake_successful_transfers"] = ok
        details["mooncake_failed_transfers"] = failed_n
        if failed_n > 0:
            return f"Mooncake logged {failed_n:g} failed transfers/recvs in the window", details
        if ok < 1:
            return (
                f"Mooncake logged {ok:g} successful transfers for {router_requests} router requests"
            ), details
        return None, details
    return f"no success evidence rule for connector {ev.connector!r}", details


# ---------------------------------------------------------------- gathering (edge)

# The connectors' stats reach /metrics and the log on the engine's stats interval
# (VLLM_LOG_STATS_INTERVAL, 10 s by default): wait this long for them to show.
EVIDENCE_WAIT_S = 35.0
EVIDENCE_POLL_S = 0.5


def evidence_wait(before: Mapping[str, float], after: Mapping[str, float]) -> float:
    """How long :meth:`Window.close` may wait for success evidence, given the decode instances'
    external-KV counters around the window (they count at scheduling time, so they are current
    when the requests have answered).

    the counters rose         -> EVIDENCE_WAIT_S (a transfer was claimed: wait for its stats)
    they did not (recompute)  -> 0 (the proof fails on the counters; no stats will come)
    """
    rose = sum(after.values()) > sum(before.get(k, 0.0) for k in after)
    return EVIDENCE_WAIT_S if rose else 0.0


class Window:
    """The success evidence of one check window: log offsets and connector metrics at its
    start; :meth:`close` reads the stats added since and the failure lines of whole logs.
    ``scrape(url) -> metrics text`` and the log paths are passed in, so tests can drive it with
    recorded data."""

    def __init__(self, connector: str, decode_urls: Mapping[str, str], logs: Mapping[str, Any], scrape: Any):
        self.connector = connector
        self.decode_urls = dict(decode_urls)
        self.logs = dict(logs)  # instance name -> Path of its log
        self.scrape = scrape
        self.offsets = {n: _size(p) for n, p in self.logs.items()}
        self.before = self._metrics()

    @classmethod
    def for_cluster(cls, cluster: Any, scrape: Any) -> Window:
        """A window over a running cluster's decode metrics and instance logs."""
        plan = cluster.plan
        return cls(
            plan.config.connector,
            {s.name: s.url + "/metrics" for s in plan.decode},
            {s.name: cluster.run_dir / s.log_name for s in plan.instances},
            scrape,
        )

    def _metrics(self) -> dict[str, dict[str, float]]:
        if self.connector != "nixl":
            return {}
        return {n: sample_sums(self.scrape(u), NIXL_METRICS) for n, u in self.decode_urls.items()}

    def window_text(self) -> dict[str, str]:
        """Instance name -> what its log gained since the window opened."""
        return self._log_text(since_window=True)

    def _log_text(self, *, since_window: bool) -> dict[str, str]:
        out = {}
        for n, p in self.logs.items():
            try:
                with open(p, "rb") as f:
                    f.seek(self.offsets[n] if since_window else 0)
                    out[n] = f.read().decode("utf-8", errors="replace")
            except FileNotFoundError:
                out[n] = ""
        return out

    def close(
        self, *, router_requests: int, wait_s: float = EVIDENCE_WAIT_S, clock: Any = None, sleep: Any = None
    ) -> Evidence:
        """Read the evidence, polling until it suffices or ``wait_s`` passed (stats are flushed
        on an interval); a failure line ends the wait at once."""
        clock = clock or time.monotonic
        sleep = sleep or time.sleep
        end = clock() + wait_s
        while True:
            # Failure lines count from each log's start: the router's readiness probe before
            # the window was a P/D request too (a failed handshake may be logged only then).
            whole, window = self._log_text(since_window=False), self._log_text(since_window=True)
            ev = Evidence(
                connector=self.connector,
                metrics_before=self.before,
                metrics_after=self._metrics(),
                log_failures={n: failure_lines(t) for n, t in whole.items()},
                log_stats={n: s for n, t in window.items() if (s := transfer_stats(t))},
            )
            reason, _ = success_verdict(ev, router_requests=router_requests)
            if reason is None or any(ev.log_failures.values()) or clock() >= end:
                return ev
            sleep(EVIDENCE_POLL_S)


def _size(path: Any) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
