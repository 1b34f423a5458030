"""fault_peer_death: the prefill dies (SIGKILL) while a decode waits for its KV.

The injector starts the decode's load ``stall_s`` late; the request goes through the router; as
soon as the decode reports it waiting for remote KV (``vllm:num_requests_kv_fetch_by_stage``),
the prefill that computed it (the one whose prompt-token counter rose) is SIGKILLed, its whole
process group, on purpose: the cluster takes it out of the watched processes first, so the
runner does not take the death for a failure. When the stall ends the decode pulls from a dead
peer. The promise: the request ends with a clear HTTP error or a correct recompute (equal to the
decode serving the prompt alone) within the request bound; the decode stays healthy and frees
its blocks. The result names the dead instance and what each survivor holds.

The killed prefill stays down: fault_restart (required after this check) starts it again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from pd_sessions.checks import instances
from pd_sessions.checks.faults.drop import policy
from pd_sessions.checks.faults.promise import (
    CORRECT,
    HUNG,
    Outcome,
    Proof,
    Recovery,
    broken_promise,
    classify,
    injector_count,
    proven,
)
from pd_sessions.checks.faults.scenario import Answer, Scenario, gatherer
from pd_sessions.checks.faults.stall_abort import decode_waits, poll, reading
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.errors import StopError
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting

NAME = "fault_peer_death"
MAX_TOKENS = 8
PROMPT = "A peer dies: the ferry left the harbour while the bell"


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the dead instance, how the request ended and when, each survivor."""
    survivors = details.get("survivors") or {}
    return [
        *pick(
            details,
            ("dead", ""),
            ("outcome", ""),
            ("answered_after_s", "s"),
            ("killed_after_wait_s", "s"),
            ("survivors_idle_s", "s"),
        ),
        Table(
            "survivors",
            ("process", "health", "holds"),
            tuple((n, v["health"], v["held"] or "nothing") for n, v in survivors.items()),
        ),
    ]


def died(details: Mapping[str, Any]) -> Proof:
    """The proof that the peer died: the prefill killed on purpose, every process of it gone."""
    victim, undead, died_s = details.get("dead"), details.get("undead"), details.get("died_s")
    what = "the killed prefill's processes gone"
    if victim is None:
        why = (
            "no prefill killed: the decode never reported the request waiting for remote KV "
            f"({details.get('decode_waited_by') or 'vllm:num_requests_kv_fetch_by_stage'})"
        )
        return Proof(what, why, False)
    if undead:
        return Proof(what, f"{victim} outlived its SIGKILL: {undead}", False)
    return Proof(what, f"{victim}: every process gone {died_s or 0:.2f} s after the SIGKILL", True)


@reporting(numbers)
@proven(lambda d: [injector_count(d.get("injected") or {}, "stall"), died(d)])
def evaluate(
    victim: str | None,
    outcome: Outcome,
    injected: Mapping[str, int],
    recovery: Recovery,
    *,
    waited_s: float | None,
    killed_after_s: float | None,
    policy: str,
    undead: str | None = None,
    died_s: float | None = None,
    waited_by: str = "",
) -> CheckResult:
    """The verdict.

    the injector applied no stall                       -> NOT RUN "invalid" (the fault did not
    the decode never waited for KV (nothing killed)        fire: promise.proven, :func:`died`)
    the killed prefill's processes outlived the SIGKILL    naming the survivors (``undead``)
    the request wrong, hung or cut                      -> fail, naming it
    a survivor unhealthy or still holding blocks        -> fail, naming it and the value
    otherwise                                           -> pass: the dead instance named, how
                                                           the request ended, what each
                                                           survivor holds
    """
    survivors = "; ".join(
        f"{n}: {'healthy' if recovery.health.get(n) == 'ok' else recovery.health.get(n)}, "
        f"{'idle' if recovery.held.get(n) is None else recovery.held[n]}"
        for n in recovery.health
        if n in recovery.held
    )
    details: dict[str, Any] = {
        "dead": victim,
        "outcome": outcome.kind,
        "answered_after_s": round(outcome.seconds, 3),
        "killed_after_wait_s": None if killed_after_s is None else round(killed_after_s, 3),
        "died_s": None if died_s is None else round(died_s, 3),  # SIGKILL -> every process gone
        "survivors_idle_s": round(recovery.seconds, 3),
        "request": outcome.to_dict(),
        "injected": dict(injected),
        "kv_load_failure_policy": policy,
        "decode_waited_s": waited_s,
        # what said the decode waited: its KV fetch gauge, or where this vLLM has none (0.26) the
        # injector's stall lines (stall_abort.INJECTOR_STALLS)
        "decode_waited_by": waited_by or "vllm:num_requests_kv_fetch_by_stage",
        "undead": undead,
        "survivors": {n: {"health": h, "held": recovery.held.get(n)} for n, h in recovery.health.items()},
        "recovery": recovery.to_dict(),
    }
    problems: list[str] = []
    if broke := broken_promise([outcome]):
        problems.append(broke)
    if not recovery.ok:
        problems.append("survivors: " + "; ".join(recovery.problems()))
    how = (
        "was recomputed correctly on the decode"
        if outcome.kind == CORRECT
        else f"failed with HTTP {outcome.status}"
        if outcome.kind != HUNG and outcome.status
        else outcome.kind
    )
    head = (
        f"{victim} SIGKILLed {killed_after_s:.1f} s after the decode began waiting for its KV"
        + (f" (seen by {waited_by})" if waited_by else "")
        + "; "
        if victim is not None and killed_after_s is not None
        else ""
    )
    if problems:
        return CheckResult(NAME, FAIL, head + "; ".join(problems) + f" (survivors: {survivors})", details)
    return CheckResult(
        NAME,
        PASS,
        f"{head}the request {how} after {outcome.seconds:.1f} s (kv_load_failure_policy {policy}); "
        f"survivors: {survivors} ({recovery.seconds:.1f} s after the death)",
        details,
    )


@gatherer(NAME)
def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    plan, cluster = window.plan, window.cluster
    s = Scenario(window, NAME)
    stall_s, bound_s = float(options["stall_s"]), float(options["bound_s"])
    idle = s.gauges()
    served_before = instances.scrape_served(plan)
    box: dict[str, Answer] = {}
    th = threading.Thread(
        target=lambda: box.update(a=s.ask(plan.router.url, PROMPT, max_tokens=MAX_TOKENS, bound_s=bound_s)),
        name="pd-peer-death-request",
        daemon=True,
    )
    victim = waited = killed_after = died_s = undead = None
    s.inject("stall", where="decode", stall_s=stall_s)
    t_sent = time.monotonic()
    seen_by = [""]
    try:
        th.start()

        def waits() -> bool:  # the decode holds the request waiting for its KV
            got = [reading(d, "decode") for d in plan.decode]
            n, seen_by[0] = decode_waits(s.requests_held("stall", "decode"), got)
            return n >= 1

        if poll(waits, timeout=stall_s * 0.8):
            t_wait = time.monotonic()
            waited = t_wait - t_sent
            served = instances.scrape_served(plan)
            rose = [p.name for p in plan.prefill if served.get(p.name, 0.0) > served_before.get(p.name, 0.0)]
            victim = (rose or [plan.prefill[0].name])[0]
            t_kill = time.monotonic()
            try:
                cluster.kill_instance(victim)
            except StopError as e:  # judged with the rest: what the request and survivors did
                undead = str(e)
            died_s = time.monotonic() - t_kill
            killed_after = time.monotonic() - t_wait
    finally:
        s.off()
    th.join(bound_s + 5.0)
    a = box.get("a") or Answer(PROMPT, time.monotonic() - t_sent, error=f"no answer within {bound_s:g} s")
    if a.completion is not None:
        outcome = s.judged(a, reference=plan.decode[0], max_tokens=MAX_TOKENS, bound_s=bound_s)
    else:
        outcome = classify(PROMPT[:60], seconds=a.seconds, status=a.status, error=a.error, bound_s=bound_s)
    recovery = s.recover(idle, probe=False)
    return evaluate(
        victim,
        outcome,
        s.injected(),
        recovery,
        waited_s=waited,
        killed_after_s=killed_after,
        died_s=died_s,
        policy=policy(window),
        undead=undead,
        waited_by=seen_by[0],
    )
