"""fault_stall_abort: clients that disconnect before their first token, at the two places a P/D
request waits, must leave nothing behind, and their abort must reach the instance where they
wait. abort_frees_kv disconnects after the first tokens; here the disconnect comes earlier:

1. **while the prefill is stalled**: the injector keeps each request waiting, unscheduled, on
   the prefill for ``stall_s`` (it answers vLLM's "how many tokens can be loaded" with "not yet");
2. **while the decode waits for stalled KV**: the prefill has computed the prompt, the decode
   holds blocks for the KV, and the injector starts the load ``stall_s`` late.

The clients disconnect once the injector has held every request back there (its log says so:
the proof that the stall fired, promise.proven) and that instance's /metrics shows them waiting
(``reached``: ``vllm:num_requests_waiting`` on the prefill; on the decode the stages of
``vllm:num_requests_kv_fetch_by_stage`` before the KV arrived); the wait for both is 0.8
``stall_s``, so the stall outlasts it. Then, judged from the disconnect:

a. **the abort reaches the stalled instance**: its requests leave its queues
   (``vllm:num_requests_waiting`` + ``vllm:num_requests_running`` back to 0) within
   ``abort_bound_s``, and before any stall could have ended (``stall_s`` after the requests were
   sent): a request that leaves only when its stall ends was never aborted, so a cluster that does
   not propagate the abort fails. vLLM takes an aborted request out of its queues at once, also on
   the decode while its load is in flight (``Scheduler.finish_requests``);
b. **every block is freed by the stall's end plus slack**: every instance idle (no request, KV
   blocks as before: scenario.holds) within ``stall_s`` + ``free_slack_s``. The decode keeps the
   blocks of an aborted request whose load is in flight until the load ends (vLLM's
   ``delay_free_blocks``), so there they are freed when the stall ends, not at the abort.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pd_sessions.checks.faults.promise import Proof, Recovery, counted, proven
from pd_sessions.checks.faults.scenario import POLL_S, Scenario, gatherer, holds
from pd_sessions.checks.instances import RUNNING, WAITING
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.plan import ProcessSpec
from pd_sessions.core.results import FAIL, NOT_RUN, PASS, CheckResult, Figure, Table, pick, reporting
from pd_sessions.runtime import http as pdhttp

NAME = "fault_stall_abort"
KV_FETCH = "vllm:num_requests_kv_fetch_by_stage"
WAITING_FOR_KV = ("waiting_to_start", "in_progress")  # its stages before the KV has arrived


# Where the decode's waiting is read when its /metrics lacks KV_FETCH (vLLM 0.26 has no such
# gauge): the injector's own stall lines. The injector holds back a load the decode's scheduler
# has already scheduled, so each line is a request waiting there for its remote KV.
INJECTOR_STALLS = "the injector's stall lines (this vLLM exports no KV fetch gauge)"


def metric_of(where: str, seen_by: str = "") -> str:
    """The metric ``reached`` reads on ``where`` (``seen_by``: what was read instead, if not it)."""
    return seen_by or (WAITING if where == "prefill" else f"{KV_FETCH} ({' + '.join(WAITING_FOR_KV)})")


@dataclass(frozen=True)
class Phase:
    """One disconnect and what followed it (seconds from the disconnect)."""

    where: str  # "prefill" | "decode"
    requests: int
    stalled: int  # the injector's stall events on ``where`` before the disconnect (the proof)
    reached: int  # requests ``where``'s /metrics showed waiting before the disconnect (metric_of)
    got_token: int  # streams that had produced a token before the disconnect (must be 0)
    injected: Mapping[str, int]
    left_s: float | None  # until ``where``'s queues were empty (None: not within the wait)
    queued: str | None  # what ``where``'s queues still held when the wait for that ended
    stall_ends_s: float  # the earliest any stall could end: stall_s after the requests were sent
    abort_bound_s: float
    freed_s: float  # until every instance was idle (or the free bound)
    held: Mapping[str, str | None]  # what each instance held at the end (None: idle)
    free_bound_s: float  # stall_s + free_slack_s
    # whether ``where``'s /metrics exported metric_of(where) at all while ``reached`` was read:
    # without it the waiting cannot be seen (a vLLM without the gauge), which is NOT RUN, not FAIL;
    # on the decode the injector's stall lines are read instead (seen_by: INJECTOR_STALLS)
    exported: bool = True
    seen_by: str = ""

    @property
    def seen(self) -> bool:
        """Whether the waiting could be seen at all (the gauge, or the injector's lines)."""
        return self.exported or bool(self.seen_by)

    @property
    def abort_limit_s(self) -> float:
        """The abort must have emptied the queues by then: the bound, or the stall's earliest end
        when that comes first (leaving then could be the stall ending, not the abort)."""
        return min(self.abort_bound_s, self.stall_ends_s)

    def problems(self) -> list[str]:
        out = []
        if self.seen and self.reached < self.requests:  # unseen: evaluate says NOT RUN
            out.append(
                f"{self.where}: only {self.reached}/{self.requests} requests were seen waiting on the "
                f"{self.where} ({metric_of(self.where, self.seen_by)}) before the disconnect"
            )
        if self.got_token:
            out.append(f"{self.where}: {self.got_token} stream(s) had a token before the disconnect")
        if self.left_s is None or self.left_s > self.abort_limit_s:
            when = "were still" if self.left_s is None else f"left only {self.left_s:.1f} s later; they were"
            out.append(
                f"{self.where}: the abort did not reach the {self.where}: its requests {when} queued "
                f"{self.abort_limit_s:g} s after {self.requests} clients disconnected "
                f"({self.queued or 'queued'}; the stall could end {self.stall_ends_s:.1f} s after the "
                "disconnect: only an abort that propagates empties the queues before)"
            )
        still = {n: h for n, h in self.held.items() if h is not None}
        if still:
            out.append(
                f"{self.free_bound_s:g} s after {self.requests} clients disconnected while the {self.where} "
                "waited: " + "; ".join(f"{n}: {h}" for n, h in still.items())
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "where": self.where,
            "requests": self.requests,
            "stalled": self.stalled,
            "reached": self.reached,
            "reached_metric": metric_of(self.where, self.seen_by),
            "got_token_before_disconnect": self.got_token,
            "injected": dict(self.injected),
            "left_s": None if self.left_s is None else round(self.left_s, 3),
            "queued": self.queued,
            "stall_ends_s": round(self.stall_ends_s, 3),
            "abort_bound_s": self.abort_bound_s,
            "freed_s": round(self.freed_s, 3),
            "held": dict(self.held),
            "free_bound_s": self.free_bound_s,
            "metric_exported": self.exported,
        }


def proofs(details: Mapping[str, Any]) -> list[Proof]:
    """Each phase's stall, from the injector's events on that side: every request held back."""
    return [
        counted(f"the injector's stall events on the {p['where']}", p["stalled"], want=p["requests"])
        for p in details.get("phases") or []
    ] or [Proof("the injector's stall events", "no phase ran", False)]


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: how soon the abort emptied the queues and every block was free."""
    phases = details.get("phases") or []
    return [
        *pick(
            details,
            ("abort_reached_prefill_s", "s"),
            ("abort_reached_decode_s", "s"),
            ("freed_after_prefill_stall_s", "s"),
            ("freed_after_decode_stall_s", "s"),
            ("recovery_s", "s"),
        ),
        Table(
            "clients gone before the first token",
            (
                "stalled on",
                "requests",
                "seen waiting",
                "queues empty after (s)",
                "abort bound (s)",
                "freed after (s)",
                "free bound (s)",
                "still held",
            ),
            tuple(
                (
                    p["where"],
                    p["requests"],
                    p["reached"],
                    p["left_s"],
                    p["abort_bound_s"],
                    p["freed_s"],
                    p["free_bound_s"],
                    "; ".join(f"{n}: {h}" for n, h in p["held"].items() if h) or "nothing",
                )
                for p in phases
            ),
        ),
    ]


@reporting(numbers)
@proven(proofs)
def evaluate(phases: Sequence[Phase], recovery: Recovery) -> CheckResult:
    """The verdict.

    a phase's stall not applied to every request    -> NOT RUN "invalid" (promise.proven)
    any problem below (a phase whose instance
    exported no metric_of(where) judged on the rest) -> fail
    a phase's instance exported no metric_of(where),
    and nothing else wrong                           -> NOT RUN: the waiting could not be seen
                                                       (a stall that fired but was not seen
                                                       waiting on an exported gauge: fail)
    fewer requests waiting on its /metrics than sent -> fail, naming the metric
    a stream had a token before the disconnect      -> fail
    its queues not empty within the abort bound, or
    only once a stall could have ended              -> fail: the abort did not reach it
    an instance still holding a request or blocks
    at stall_s + free_slack_s                       -> fail, naming the instance and the value
    the cluster not whole again                     -> fail
    otherwise                                       -> pass, with both times per phase
    """
    problems = [p for ph in phases for p in ph.problems()]
    if not recovery.ok:
        problems.append(recovery.line())
    details: dict[str, Any] = {
        **{f"abort_reached_{p.where}_s": None if p.left_s is None else round(p.left_s, 3) for p in phases},
        **{f"freed_after_{p.where}_stall_s": round(p.freed_s, 3) for p in phases},
        "recovery_s": round(recovery.seconds, 3),
        "phases": [p.to_dict() for p in phases],
        "recovery": recovery.to_dict(),
    }
    blind = [p for p in phases if not p.seen]
    if blind and not problems:
        return CheckResult(
            NAME,
            NOT_RUN,
            "; ".join(
                f"{p.where}: the injector stalled {p.stalled}/{p.requests} requests, but the {p.where}'s "
                f"/metrics exported no {metric_of(p.where)}, so whether they waited there could not be "
                "seen (that vLLM lacks the gauge)"
                for p in blind
            ),
            details,
        )
    if problems:
        return CheckResult(NAME, FAIL, "; ".join(problems), details)
    return CheckResult(
        NAME,
        PASS,
        "; ".join(
            f"{p.requests} clients disconnected before the first token while the {p.where} waited "
            f"(stalled{'; seen by ' + p.seen_by if p.seen_by else ''}): the abort emptied its queues "
            f"{p.left_s or 0:.1f} s later (bound "
            f"{p.abort_limit_s:g} s), every instance idle again {p.freed_s:.1f} s later"
            for p in phases
        )
        + f"; {recovery.line()}",
        details,
    )


# ---------------------------------------------------------------- gathering (edge)


def open_stream(base_url: str, model: str, prompt: str, *, timeout: float) -> http.client.HTTPConnection:
    """Send a streaming completion and return its connection unread (the client is "waiting")."""
    u = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout)
    body = {"model": model, "prompt": prompt, "max_tokens": 64, "temperature": 0.0, "stream": True}
    conn.request(
        "POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    return conn


def had_token(conn: http.client.HTTPConnection) -> bool:
    """Whether a generated token had reached the client (read without waiting)."""
    if conn.sock is None:
        return False
    conn.sock.setblocking(False)
    got = b""
    try:
        while chunk := conn.sock.recv(65536):
            got += chunk
    except (BlockingIOError, OSError):
        pass
    return b'"choices"' in got and b'"text"' in got


def disconnect(conn: http.client.HTTPConnection) -> None:
    if conn.sock is not None:
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def samples(spec: ProcessSpec) -> list[Any]:
    text = pdhttp.get_text(f"{spec.url}/metrics", timeout=3.0)
    return [smp for family in text_string_to_metric_families(text) for smp in family.samples]


def waiting(spec: ProcessSpec, where: str) -> float:
    """How many requests ``spec`` holds waiting: on the prefill for scheduling; on the decode
    for remote KV (the stages of vllm:num_requests_kv_fetch_by_stage before it arrived)."""
    return reading(spec, where)[0]


def reading(spec: ProcessSpec, where: str) -> tuple[float, bool]:
    """:func:`waiting`, and whether ``spec``'s /metrics exported the metric it reads at all."""
    n, exported = 0.0, False
    name = WAITING if where == "prefill" else KV_FETCH
    for s in samples(spec):
        if s.name != name:
            continue
        exported = True
        if where == "prefill" or s.labels.get("stage") in WAITING_FOR_KV:
            n += s.value
    return n, exported


def queued(specs: Sequence[ProcessSpec]) -> str | None:
    """What the queues of ``specs`` hold (vllm:num_requests_waiting + vllm:num_requests_running,
    each instance's; an aborted request leaves both at once, on the decode too while its load is
    in flight), or None when they are empty."""
    out = []
    for spec in specs:
        try:
            got = {n: sum(s.value for s in samples(spec) if s.name == n) for n in (WAITING, RUNNING)}
        except pdhttp.HttpError as e:
            out.append(f"{spec.name}: /metrics {e.reason}")
            continue
        if any(got.values()):
            out.append(f"{spec.name}: " + ", ".join(f"{n} {v:g}" for n, v in got.items()))
    return "; ".join(out) or None


def poll(until: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while True:
        if until():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(POLL_S)


@dataclass
class Before:
    """What was seen before the disconnect."""

    stalled: int = 0
    reached: int = 0
    got_token: int = 0
    sent_at: float = 0.0
    exported: bool = False
    seen_by: str = ""  # INJECTOR_STALLS when the decode's waiting was read from the injector


def decode_waits(stalled: int, got: Sequence[tuple[float, bool]]) -> tuple[int, str]:
    """How many requests the decodes hold waiting for remote KV, and what said so: their gauge
    (``got``: :func:`reading` per decode), or where no decode exports it, the injector's stall
    lines (``stalled``)."""
    if any(e for _, e in got):
        return int(sum(n for n, _ in got)), ""
    return stalled, INJECTOR_STALLS


def stall_and_leave(s: Scenario, where: str, n: int, stall_s: float) -> Before:
    """Stall ``n`` streamed requests on ``where``; disconnect their clients once the injector
    has held every one back and ``where``'s /metrics shows them waiting (or 0.8 ``stall_s``)."""
    specs = s.plan.prefill if where == "prefill" else s.plan.decode
    b = Before()
    s.inject("stall", where=where, stall_s=stall_s)
    conns = []
    try:
        b.sent_at = time.monotonic()
        for i in range(n):
            prompt = f"Stalled {where} {i}: the night train waits"
            conns.append(open_stream(s.plan.router.url, s.model, prompt, timeout=stall_s))

        def reached() -> bool:  # held back by the injector, and waiting as the instance says
            b.stalled = s.injected(where).get("stall", 0)
            got = [reading(sp, where) for sp in specs]
            b.exported = b.exported or any(e for _, e in got)
            if where == "decode":  # the injector's lines count requests, not one line per TP rank
                b.reached, b.seen_by = decode_waits(s.requests_held("stall", "decode"), got)
            else:
                b.reached = int(sum(n for n, _ in got))
            return b.stalled >= n and b.reached >= n

        poll(reached, timeout=stall_s * 0.8)
        b.got_token = sum(had_token(c) for c in conns)
    finally:
        for c in conns:
            disconnect(c)
        s.off()
    return b


def phase(window: CheckWindow, where: str, options: Mapping[str, Any], idle: Mapping[str, Any]) -> Phase:
    """Stall requests on ``where``, disconnect their clients once they wait there, then time
    until ``where``'s queues are empty (the abort reached it) and until every instance is idle
    again (gauges as in ``idle``)."""
    s = Scenario(window, f"{NAME}-{where}")
    n, stall_s = int(options["requests"]), float(options["stall_s"])
    abort_bound_s, free_bound_s = float(options["abort_bound_s"]), stall_s + float(options["free_slack_s"])
    specs = s.plan.prefill if where == "prefill" else s.plan.decode
    b = stall_and_leave(s, where, n, stall_s)
    t0 = time.monotonic()
    stall_ends_s = b.sent_at + stall_s - t0  # no stall began before its request was sent
    held: dict[str, str | None] = {}
    left: list[float] = []
    still: list[str | None] = [None]

    def idle_again() -> bool:
        if not left:
            still[0] = queued(specs)
            if still[0] is None:
                left.append(time.monotonic() - t0)
        for sp in s.live():
            try:
                held[sp.name] = holds(idle.get(sp.name, {}), s.gauges([sp])[sp.name])
            except pdhttp.HttpError as e:
                held[sp.name] = f"/metrics: {e.reason}"
        return bool(left) and all(h is None for h in held.values())

    poll(idle_again, timeout=free_bound_s)
    freed = time.monotonic() - t0
    return Phase(
        where,
        n,
        b.stalled,
        b.reached,
        b.got_token,
        s.injected(),
        left[0] if left else None,
        still[0],
        stall_ends_s,
        abort_bound_s,
        freed,
        dict(held),
        free_bound_s,
        b.exported,
        "" if b.exported else b.seen_by,
    )


@gatherer(NAME)
def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    s = Scenario(window, NAME)
    idle = s.gauges()
    phases = [phase(window, where, options, idle) for where in ("prefill", "decode")]
    return evaluate(phases, s.recover(idle))
