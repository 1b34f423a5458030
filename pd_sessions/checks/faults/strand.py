"""fault_strand: the prefill never frees a request's blocks after the decode's abort (vLLM
#46283, #21570: the prefill holds them until its abort timeout), and the conservation invariant
(checks/conservation.py) must see it.

fault_stall_abort's decode phase, with the prefill made to strand: the injector holds each load
on the decode ``stall_s`` back, the clients disconnect once the decode shows them waiting for
KV (the decode aborts them), and on the prefill it keeps every send that finishes from its
scheduler (``finished_sending``: mode ``strand``), so their blocks stay in use. Then:

a. **caught**: the invariant's own probe and verdict (conservation.probe, conservation.evaluate)
   over the cluster, bounded by the stall's end plus ``free_slack_s``, FAILs naming a prefill
   instance and the KV blocks it holds; the scenario PASSes only then (an invariant that passes
   here cannot see stranded blocks);
b. **handed back**: with the mode off, a request straight to prefill-0 makes its engine step and
   the injector hands every kept send back (its "release" events), so the cluster is whole again
   for the checks after it (promise.Recovery: every instance idle, a correct P/D answer).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pd_sessions.checks import conservation
from pd_sessions.checks.faults.promise import Proof, Recovery, counted, proven
from pd_sessions.checks.faults.scenario import Scenario, gatherer
from pd_sessions.checks.faults.stall_abort import disconnect, had_token, open_stream, poll, waiting
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import check_registry, faults
from pd_sessions.core.results import FAIL, PASS, CheckResult, Table, reporting

NAME = "fault_strand"


@dataclass(frozen=True)
class Stranded:
    """What was seen under the fault."""

    requests: int
    stalled: int  # the injector's decode stall events before the disconnect
    reached: int  # requests the decode's /metrics showed waiting for KV
    got_token: int  # streams with a token before the disconnect (must be 0)
    stranded: int  # the injector's strand events on the prefill (sends kept)
    released: int  # its release events once the mode went off
    invariant: CheckResult  # conservation's verdict on the probe under the fault
    prefills: Sequence[str]  # the prefill instances' names

    @property
    def held(self) -> dict[str, Any]:
        """What the invariant's probe saw each instance hold (None: idle)."""
        return dict(self.invariant.details.get("records", [{}])[0].get("held") or {})

    @property
    def caught_on(self) -> list[str]:
        """The prefill instances the invariant named as holding KV blocks."""
        return [n for n in self.prefills if self.held.get(n) and "KV blocks in use" in str(self.held[n])]

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "stalled": self.stalled,
            "reached": self.reached,
            "got_token_before_disconnect": self.got_token,
            "stranded": self.stranded,
            "released": self.released,
            "caught_on": self.caught_on,
            "invariant": self.invariant.to_dict(),
        }


def proofs(details: Mapping[str, Any]) -> list[Proof]:
    """The fault fired: every request's load stalled on the decode and its send kept on the prefill."""
    n = int(details.get("requests", 1))
    return [
        counted("the injector's stall events on the decode", int(details.get("stalled", 0)), want=n),
        counted("the injector's strand events on the prefill", int(details.get("stranded", 0)), want=n),
    ]


def numbers(details: Mapping[str, Any]) -> list[Table]:
    held = ((details.get("invariant") or {}).get("details", {}).get("records") or [{}])[0].get("held") or {}
    rows = tuple((n, h or "idle") for n, h in held.items())
    return [Table("what the invariant saw under the fault", ("instance", "held"), rows)] if rows else []


@reporting(numbers)
@proven(proofs)
def evaluate(st: Stranded, recovery: Recovery) -> CheckResult:
    """The verdict.

    a load not stalled or a send not kept           -> NOT RUN "invalid" (promise.proven)
    a stream had a token before the disconnect      -> fail (no abort while the decode waited)
    the invariant did not FAIL naming a prefill     -> fail: it cannot see stranded blocks
    fewer sends handed back than kept               -> fail: blocks stay held until restart
    the cluster not whole again                     -> fail
    otherwise                                       -> pass, with the invariant's message
    """
    problems = []
    if st.got_token:
        problems.append(f"{st.got_token} stream(s) had a token before the disconnect")
    if not st.invariant.failed or not st.caught_on:
        problems.append(
            f"the conservation invariant did not catch the stranded blocks on {', '.join(st.prefills)} "
            f"({st.invariant.verdict}: {st.invariant.message})"
        )
    if st.released < st.stranded:
        problems.append(
            f"only {st.released} of {st.stranded} kept sends were handed back once the mode went off"
        )
    if not recovery.ok:
        problems.append(recovery.line())
    details = {**st.to_dict(), "recovery": recovery.to_dict(), "recovery_s": round(recovery.seconds, 3)}
    if problems:
        return CheckResult(NAME, FAIL, "; ".join(problems), details)
    return CheckResult(
        NAME,
        PASS,
        f"{st.requests} clients left while the decode waited; the prefill kept {st.stranded} finished "
        f"send(s) and the conservation invariant failed on it ("
        + "; ".join(f"{n} not idle after {NAME}: {st.held[n]}" for n in st.caught_on)
        + "); "
        f"{st.released} handed back with the mode off; {recovery.line()}",
        details,
    )


# ---------------------------------------------------------------- gathering (edge)


def leave(s: Scenario, n: int, stall_s: float) -> tuple[int, int, int, float]:
    """Send ``n`` streams through the router; disconnect once the injector stalled every load on
    the decode and the decode shows them waiting for KV (or 0.8 ``stall_s``). Returns (stalled,
    reached, got_token, sent_at)."""
    conns = []
    seen = [0, 0]
    sent_at = time.monotonic()
    try:
        for i in range(n):
            conns.append(
                open_stream(s.plan.router.url, s.model, f"Stranded {i}: the ferry waits", timeout=stall_s)
            )

        def reached() -> bool:
            seen[0] = s.injected("decode").get("stall", 0)
            seen[1] = int(sum(waiting(sp, "decode") for sp in s.plan.decode))
            return seen[0] >= n and seen[1] >= n

        poll(reached, timeout=stall_s * 0.8)
        got = sum(had_token(c) for c in conns)
    finally:
        for c in conns:
            disconnect(c)
    return seen[0], seen[1], got, sent_at


def released(s: Scenario) -> int:
    """The injector's release events of this scenario's epoch."""
    return faults.count_events(s.events()).get("release", 0)


@gatherer(NAME)
def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    s = Scenario(window, NAME)
    idle = s.gauges()
    n, stall_s, slack = int(options["requests"]), float(options["stall_s"]), float(options["free_slack_s"])
    inv_opts = check_registry.BY_NAME[conservation.NAME].options
    s.inject("strand", stall_s=stall_s)
    try:
        stalled, reached, got, sent_at = leave(s, n, stall_s)
        # the stall ends stall_s after the requests were sent: then the decode loads and frees,
        # and the prefill's sends finish (and are kept); the invariant has free_slack_s more
        # against each instance's state before the scenario: only what it left behind counts
        rec = conservation.probe(window, NAME, max(0.0, sent_at + stall_s - time.monotonic()) + slack, idle)
        stranded = s.injected("prefill").get("strand", 0)
    finally:
        s.off()
    invariant = conservation.evaluate(
        [rec],
        conservation.bounds_of(inv_opts),
        transfers=conservation.transfers_unmeasured(window.plan.config.connector),
    )
    # the prefill steps only with work: one request straight to it lets the injector hand back
    s.ask(s.plan.prefill[0].url, "Released: the ferry sails", max_tokens=1)
    recovery = s.recover(idle)
    st = Stranded(
        n, stalled, reached, got, stranded, released(s), invariant, [p.name for p in s.plan.prefill]
    )
    return evaluate(st, recovery)
