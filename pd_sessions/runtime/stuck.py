"""What a P/D request that never answers is stuck on, read from every instance's /metrics.

A decode whose request waits for KV that never comes (seen: 2P1D over Mooncake tcp, decode-0
waiting on a pull from prefill-1's bootstrap server with no expiry) reports it in
``vllm:num_requests_waiting_by_reason{reason="deferred"}`` (deferred by KV transfer, among
transient constraints) while no prefill is computing anything. Pure ``diagnose``; ``gather``
makes the scrapes and never raises (an unreachable instance is part of the answer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from pd_sessions.core import connectors
from pd_sessions.core.plan import ClusterPlan
from pd_sessions.runtime import http

WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
RUNNING = "vllm:num_requests_running"


@dataclass(frozen=True)
class State:
    running: float = 0.0
    deferred: float = 0.0  # waiting by reason "deferred" (KV transfer among others)
    error: str | None = None  # the scrape failed


def state(metrics_text: str) -> State:
    running = deferred = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == RUNNING:
                running += s.value
            elif s.name == WAITING_BY_REASON and s.labels.get("reason") == "deferred":
                deferred += s.value
    return State(running, deferred)


def diagnose(states: Mapping[str, State], sources: Mapping[str, str]) -> str:
    """One line per instance that holds something, most telling first.

    ``sources``: prefill name -> where a decode pulls its KV from (e.g. "bootstrap port 4242").

        decode with deferred requests, no prefill running -> "decode-0 waits for KV from <sources>
                                                             (N deferred, M running); no prefill
                                                             is computing: the pull is stuck"
        decode with deferred requests, a prefill running  -> "... waits for KV while prefill-1 still
                                                             computes" (slow, not yet stuck)
        instance with running requests                    -> "prefill-0 has N running"
        scrape failed                                     -> "decode-0: /metrics unreachable (why)"
        nothing held anywhere                             -> "no instance reports a running or
                                                             deferred request"
    """
    lines = []
    busy_prefills = [n for n, s in states.items() if n.startswith("prefill") and s.running > 0]
    where = ", ".join(f"{n} ({src})" for n, src in sources.items()) or "a prefill"
    for name, s in states.items():
        if s.error is not None:
            lines.append(f"{name}: /metrics unreachable ({s.error})")
        elif name.startswith("decode") and s.deferred > 0:
            tail = (
                f"while {', '.join(busy_prefills)} still computes"
                if busy_prefills
                else "no prefill is computing: the KV pull is stuck"
            )
            lines.append(
                f"{name} waits for KV from {where} ({s.deferred:g} deferred, {s.running:g} running); {tail}"
            )
        elif s.running > 0:
            lines.append(f"{name} has {s.running:g} running request(s)")
    return "; ".join(lines) or "no instance reports a running or deferred request"


def gather(plan: ClusterPlan, timeout: float = 3.0) -> str:
    states: dict[str, State] = {}
    for spec in plan.instances:
        try:
            states[spec.name] = state(http.get_text(f"{spec.url}/metrics", timeout=timeout))
        except http.HttpError as e:
            states[spec.name] = State(error=e.reason)
    return diagnose(states, sources(plan))


def sources(plan: ClusterPlan) -> dict[str, str]:
    """Where a decode gets each prefill's KV from, for people: its bootstrap server, else its
    connector's side channel (the port its spec's ``ports`` put in the environment), else its URL."""
    spec = connectors.get(plan.config.connector)
    out = {}
    for p in plan.prefill:
        if p.bootstrap_port:
            out[p.name] = f"bootstrap http://{p.host}:{p.bootstrap_port}"
        elif side := dict(p.env).get(spec.ports.side_channel_env or ""):
            out[p.name] = f"{spec.title} side channel {p.host}:{side}"
        else:
            out[p.name] = p.url
    return out


def is_timeout(error: BaseException | str) -> bool:
    return "no answer within" in str(error)
