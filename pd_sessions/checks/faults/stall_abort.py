"""fault_stall_abort: clients that disconnect before their first token, at the two places a P/D
request waits, must leave nothing behind. abort_frees_kv disconnects after the first tokens; here
the disconnect comes earlier:

1. **while the prefill is stalled**: the injector keeps each request waiting, unscheduled, on
   the prefill for ``stall_s`` (it answers vLLM's "how many tokens can be loaded" with "not yet");
2. **while the decode waits for stalled KV**: the prefill has computed the prompt, the decode
   holds blocks for the KV, and the injector starts the load ``stall_s`` late.

The clients disconnect once the injector has held every request back there (its log says so;
the wait for that is 0.8 ``stall_s``, so the stall outlasts it).

After each disconnect every block on both sides must be free, and no request running or
waiting, within ``bound_s`` (15 s, as abort_frees_kv requires after the first tokens).
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

from pd_sessions.checks.faults.promise import Recovery, injected_problem
from pd_sessions.checks.faults.scenario import POLL_S, Scenario, gatherer, holds
from pd_sessions.checks.instances import WAITING
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.plan import ProcessSpec
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting
from pd_sessions.runtime import http as pdhttp

NAME = "fault_stall_abort"
KV_FETCH = "vllm:num_requests_kv_fetch_by_stage"
WAITING_FOR_KV = ("waiting_to_start", "in_progress")  # its stages before the KV has arrived


@dataclass(frozen=True)
class Phase:
    """One disconnect and what followed it."""

    where: str  # "prefill" | "decode"
    requests: int
    reached: int  # requests the instance reported waiting before the disconnect
    got_token: int  # streams that had produced a token before the disconnect (must be 0)
    injected: Mapping[str, int]
    freed_s: float  # from the disconnect until every instance was idle (or the bound)
    held: Mapping[str, str | None]  # what each instance held at the end (None: idle)
    bound_s: float

    def problems(self) -> list[str]:
        out = []
        if injected_problem(self.injected, "stall"):
            out.append(f"{self.where}: {injected_problem(self.injected, 'stall')}")
        if self.reached < self.requests:
            out.append(
                f"{self.where}: only {self.reached}/{self.requests} requests were seen waiting on the "
                f"{self.where} before the disconnect"
            )
        if self.got_token:
            out.append(f"{self.where}: {self.got_token} stream(s) had a token before the disconnect")
        still = {n: h for n, h in self.held.items() if h is not None}
        if still:
            out.append(
                f"{self.bound_s:g} s after {self.requests} clients disconnected while the {self.where} "
                "waited: " + "; ".join(f"{n}: {h}" for n, h in still.items())
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "where": self.where,
            "requests": self.requests,
            "reached": self.reached,
            "got_token_before_disconnect": self.got_token,
            "injected": dict(self.injected),
            "freed_s": round(self.freed_s, 3),
            "held": dict(self.held),
            "bound_s": self.bound_s,
        }


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: how soon every block was free after each disconnect."""
    phases = details.get("phases") or []
    return [
        *pick(
            details,
            ("freed_after_prefill_stall_s", "s"),
            ("freed_after_decode_stall_s", "s"),
            ("recovery_s", "s"),
        ),
        Table(
            "clients gone before the first token",
            ("stalled on", "requests", "seen waiting", "freed after (s)", "bound (s)", "still held"),
            tuple(
                (
                    p["where"],
                    p["requests"],
                    p["reached"],
                    p["freed_s"],
                    p["bound_s"],
                    "; ".join(f"{n}: {h}" for n, h in p["held"].items() if h) or "nothing",
                )
                for p in phases
            ),
        ),
    ]


@reporting(numbers)
def evaluate(phases: Sequence[Phase], recovery: Recovery) -> CheckResult:
    """Pass when each phase's stall happened, its requests were waiting where they should when
    the clients left, and every instance was idle within the bound; then the cluster recovers."""
    problems = [p for ph in phases for p in ph.problems()]
    if not recovery.ok:
        problems.append(recovery.line())
    details: dict[str, Any] = {
        **{f"freed_after_{p.where}_stall_s": round(p.freed_s, 3) for p in phases},
        "recovery_s": round(recovery.seconds, 3),
        "phases": [p.to_dict() for p in phases],
        "recovery": recovery.to_dict(),
    }
    if problems:
        return CheckResult(NAME, FAIL, "; ".join(problems), details)
    return CheckResult(
        NAME,
        PASS,
        "; ".join(
            f"{p.requests} clients disconnected before the first token while the {p.where} waited "
            f"(stalled): every instance idle again {p.freed_s:.1f} s later"
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


def waiting(spec: ProcessSpec, where: str) -> float:
    """How many requests ``spec`` holds waiting: on the prefill for scheduling; on the decode
    for remote KV (the stages of vllm:num_requests_kv_fetch_by_stage before it arrived)."""
    text = pdhttp.get_text(f"{spec.url}/metrics", timeout=3.0)
    n = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            on_prefill = where == "prefill" and s.name == WAITING
            if on_prefill or (
                where == "decode" and s.name == KV_FETCH and s.labels.get("stage") in WAITING_FOR_KV
            ):
                n += s.value
    return n


def poll(until: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while True:
        if until():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(POLL_S)


def phase(window: CheckWindow, where: str, options: Mapping[str, Any], idle: Mapping[str, Any]) -> Phase:
    """Stall requests on ``where``, disconnect their clients once they wait there, and time how
    long until every instance is idle again (gauges as in ``idle``)."""
    s = Scenario(window, f"{NAME}-{where}")
    n, stall_s, bound_s = int(options["requests"]), float(options["stall_s"]), float(options["bound_s"])
    s.inject("stall", where=where, stall_s=stall_s)
    conns = []
    seen = [0.0]
    try:
        for i in range(n):
            conns.append(
                open_stream(
                    window.plan.router.url,
                    s.model,
                    f"Stalled {where} {i}: the night train waits",
                    timeout=bound_s,
                )
            )

        def reached() -> bool:  # the injector has held each one back where it waits
            seen[0] = s.injected(where).get("stall", 0)
            return seen[0] >= n

        poll(reached, timeout=stall_s * 0.8)
        got_token = sum(had_token(c) for c in conns)
    finally:
        for c in conns:
            disconnect(c)
        s.off()
    t0 = time.monotonic()
    held: dict[str, str | None] = {}

    def idle_again() -> bool:
        for sp in s.live():
            try:
                held[sp.name] = holds(idle.get(sp.name, {}), s.gauges([sp])[sp.name])
            except pdhttp.HttpError as e:
                held[sp.name] = f"/metrics: {e.reason}"
        return all(h is None for h in held.values())

    poll(idle_again, timeout=bound_s)
    freed = time.monotonic() - t0
    return Phase(where, n, int(seen[0]), got_token, s.injected(), freed, dict(held), bound_s)


@gatherer(NAME)
def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    s = Scenario(window, NAME)
    idle = s.gauges()
    phases = [phase(window, where, options, idle) for where in ("prefill", "decode")]
    return evaluate(phases, s.recover(idle))
