"""Success evidence of KV transfers, beside the scheduling-time counter (see checks/kv_transfer.py).

vLLM's external-KV counter counts when a request is *scheduled* with external tokens, not when
the transfer succeeds: on an H200 every NIXL handshake failed (unequal block sizes), every
request returned empty text, and the counter still rose by nearly every prompt token. So the
KV proof also requires success evidence, of the kind the connector's spec names
(``evidence`` in pd_sessions/core/connectors/):

- metrics (:class:`~pd_sessions.core.connectors.base.MetricEvidence`, NIXL): on the side that
  completes the transfers (the decode when it READs, the prefill when it pushes WRITEs), the
  completed-transfer count must rise by at least one per router request and the bytes must
  rise; the failure counters must not move;
- log stats (:class:`~pd_sessions.core.connectors.base.LogEvidence`, Mooncake, which exposes no
  Prometheus metrics): vLLM's periodic "KV Transfer metrics: Num successful transfers=N, ...
  Num failed transfers=M ..." lines; over the window at least one transfer must have succeeded
  and none failed (several small requests may share one logged transfer batch);
- every connector: no line of any instance's log (from its start: the router's readiness probe
  is a P/D request too) may match the connector's failure lines (``failure_lines``); the first
  ones are named in the verdict (e.g. NIXL's "handshake_setup_failed ... Local block size 240 is
  not divisible by remote block size 128").

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
from pd_sessions.core import connectors
from pd_sessions.core.connectors.base import ConnectorSpec, LogEvidence, MetricEvidence
from pd_sessions.core.errors import ConfigError

# vLLM's periodic connector-stats line ("KV Transfer metrics: Num successful transfers=3, ...").
_STATS_RE = re.compile(r"KV Transfer metrics: (.*)$")
MAX_LOG_LINES_SHOWN = 5


def failure_lines(log_text: str, patterns: Sequence[str]) -> list[str]:
    """Lines of ``log_text`` that match one of a connector's failure ``patterns``, in order.

    A failure logged with a traceback ends with the exception's own line (e.g.
    "RuntimeError: Local block size 240 is not divisible ..."); the pattern for that
    text catches it too, so no traceback parsing is needed.
    """
    failure = re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None
    if failure is None:
        return []
    return [line.strip() for line in log_text.splitlines() if failure.search(line)]


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

    connector: str  # the config's connector (its spec says which evidence counts)
    # instance name -> {sample name: value} before/after, on the instances of the role whose
    # /metrics carry the connector's metrics (empty for a connector with log evidence)
    metrics_before: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    metrics_after: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # instance name -> failure lines in its log (from the start: the readiness probe counts too)
    log_failures: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # instance name -> summed "KV Transfer metrics" fields its log gained
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
    a connector the registry does not know           -> fail (no rule)
    metrics: absent from the role's /metrics         -> fail (cannot prove success)
    metrics: a failure counter rose                  -> fail
    metrics: count rose < router_requests, or
             bytes transferred did not rise          -> fail (scheduled, not transferred)
    log stats: no "KV Transfer metrics" line         -> fail (cannot prove success; the
                                                        line needs log stats on)
    log stats: failed transfers/recvs > 0            -> fail
    log stats: successful transfers < 1              -> fail
    otherwise                                        -> None (pass); details["summary"] says what
                                                        succeeded, for the verdict
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
    try:
        spec = connectors.get(ev.connector)
    except ConfigError:
        return f"no success evidence rule for connector {ev.connector!r}", details
    if isinstance(spec.evidence, MetricEvidence):
        return _metric_verdict(spec, spec.evidence, ev, router_requests, details)
    return _log_verdict(spec, spec.evidence, ev, router_requests, details)


def _metric_verdict(
    spec: ConnectorSpec, m: MetricEvidence, ev: Evidence, router_requests: int, details: dict[str, Any]
) -> tuple[str | None, dict[str, Any]]:
    d = _deltas(ev)
    details["metrics_on"] = m.role
    details["metrics_before"] = {k: dict(v) for k, v in ev.metrics_before.items()}
    details["metrics_after"] = {k: dict(v) for k, v in ev.metrics_after.items()}
    details["metrics_delta"] = d
    if m.count not in d or m.bytes not in d:
        return (
            f"{m.role} /metrics has no {m.count} / {m.bytes}: the {spec.title} connector's success "
            f"cannot be proven (is the {m.role} a {spec.vllm_class} instance?)"
        ), details
    failed = {k: d[k] for k in m.failures if d.get(k, 0) > 0}
    if failed:
        return f"{spec.title} failure counters rose: {failed}", details
    count, nbytes = d[m.count], d[m.bytes]
    details["transfers"], details["transfer_bytes"] = count, nbytes
    if count < router_requests or nbytes <= 0:
        return (
            f"{spec.title} completed {count:g} {m.what} ({nbytes:g} bytes) for {router_requests} "
            f"router requests: requests were scheduled for KV transfer but the transfers "
            f"did not complete"
        ), details
    details["summary"] = (
        f"{spec.title} completed {count:g} {m.what} of {nbytes:.0f} bytes ({m.role} /metrics), no failures"
    )
    return None, details


def _log_verdict(
    spec: ConnectorSpec, lg: LogEvidence, ev: Evidence, router_requests: int, details: dict[str, Any]
) -> tuple[str | None, dict[str, Any]]:
    details["log_stats"] = {k: dict(v) for k, v in ev.log_stats.items()}
    if not ev.log_stats:
        return (
            f'no instance logged "KV Transfer metrics" in the window: {spec.title}\'s success '
            f"cannot be proven (vLLM exposes no {spec.title} metrics; its stats line needs log "
            "stats on, i.e. no --disable-log-stats)"
        ), details
    ok = sum(s.get(lg.success, 0) for s in ev.log_stats.values())
    failed_n = sum(s.get(f, 0) for s in ev.log_stats.values() for f in lg.failures)
    details["successful_transfers"] = ok
    details["failed_transfers"] = failed_n
    if failed_n > 0:
        return f"{spec.title} logged {failed_n:g} failed transfers/recvs in the window", details
    if ok < 1:
        return (
            f"{spec.title} logged {ok:g} successful transfers for {router_requests} router requests",
            details,
        )
    details["summary"] = f"{spec.title} logged {ok:g} successful transfers, none failed"
    return None, details


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
    recorded data. ``metric_urls``: the /metrics of the instances whose metrics count (the
    spec's ``evidence.role``; none for log evidence)."""

    def __init__(self, connector: str, metric_urls: Mapping[str, str], logs: Mapping[str, Any], scrape: Any):
        self.connector = connector
        self.spec = connectors.get(connector)
        self.metric_urls = dict(metric_urls) if isinstance(self.spec.evidence, MetricEvidence) else {}
        self.logs = dict(logs)  # instance name -> Path of its log
        self.scrape = scrape
        self.offsets = {n: _size(p) for n, p in self.logs.items()}
        self.before = self._metrics()

    @classmethod
    def for_cluster(cls, cluster: Any, scrape: Any) -> Window:
        """A window over a running cluster's instance logs and the /metrics its connector's
        evidence is read from (the decode's when it pulls, the prefill's when it pushes)."""
        plan = cluster.plan
        ev = connectors.get(plan.config.connector).evidence
        role = ev.role if isinstance(ev, MetricEvidence) else None
        counted = {"prefill": plan.prefill, "decode": plan.decode}.get(role or "", ())
        return cls(
            plan.config.connector,
            {s.name: s.url + "/metrics" for s in counted},
            {s.name: cluster.run_dir / s.log_name for s in plan.instances},
            scrape,
        )

    def _metrics(self) -> dict[str, dict[str, float]]:
        ev = self.spec.evidence
        if not isinstance(ev, MetricEvidence):
            return {}
        return {n: sample_sums(self.scrape(u), ev.samples) for n, u in self.metric_urls.items()}

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
        patterns = self.spec.failure_lines
        while True:
            # Failure lines count from each log's start: the router's readiness probe before
            # the window was a P/D request too (a failed handshake may be logged only then).
            whole, window = self._log_text(since_window=False), self._log_text(since_window=True)
            ev = Evidence(
                connector=self.connector,
                metrics_before=self.before,
                metrics_after=self._metrics(),
                log_failures={n: failure_lines(t, patterns) for n, t in whole.items()},
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
