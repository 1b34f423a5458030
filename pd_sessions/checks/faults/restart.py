"""fault_restart: the prefill that fault_peer_death killed starts again in place, with the same
argv, environment, ports and role (its output appended to the same log), and P/D must answer
correctly again. Measured from the restart: until the instance is ready (alive, /health 200, the
model listed), and until a request through the router first equals prefill-direct.

The planned death is no failure: the cluster took the instance out of the processes it watches
before the SIGKILL, and puts the new process in from its spawn on; the reaper is told of the new
process as of any (so a harness killed meanwhile still leaves nothing behind). Selected alone, the
check first SIGKILLs prefill-0 itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pd_sessions.checks.faults.promise import CORRECT, KEPT, REQUEST_BOUND_S, Outcome, Proof, Recovery, proven
from pd_sessions.checks.faults.scenario import Scenario, gatherer
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.errors import ProcessExited, ReadinessTimeout
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting

log = logging.getLogger(__name__)
NAME = "fault_restart"
MAX_TOKENS = 8


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: seconds until ready and until P/D was correct; each request tried."""
    attempts = details.get("attempts") or []
    return [
        *pick(details, ("restarted", ""), ("ready_s", "s"), ("pd_correct_s", "s")),
        Table(
            "requests through the router after the restart",
            ("request", "kind", "seconds", "HTTP status"),
            tuple((i, a["kind"], a["seconds"], a["status"]) for i, a in enumerate(attempts)),
        ),
    ]


def was_down(details: Mapping[str, Any]) -> Proof:
    """The proof that the fault (the death before the restart) happened: the instance was down,
    every process of it gone, when the restart began (cluster.restart_instance verifies it and
    starts nothing otherwise: the gatherer is then NOT RUN "invalid", scenario.killed_undead)."""
    gone = bool(details.get("killed_gone"))
    return Proof(
        f"the killed {details.get('restarted')}'s processes gone before the restart",
        "every one gone" if gone else "not verified",
        gone,
    )


@reporting(numbers)
@proven(lambda d: [was_down(d)])
def evaluate(
    name: str,
    *,
    ready_s: float | None,
    start_error: str | None,
    attempts: Sequence[Outcome],
    correct_s: float | None,
    recovery: Recovery | None,
    killed_here: bool,
    bound_s: float,
    killed_gone: bool,
) -> CheckResult:
    """The verdict.

    the instance did not start again (died, or not ready)   -> fail, naming it and why
    a request wrong, hung or broken (before any correct one: the loop stops there)
                                                            -> fail, listing every attempt (a
                                                               wrong answer before a right one is
                                                               a failure, not a retry)
    no request through the router was correct within bound  -> fail, with the last answer
    the cluster not whole afterwards                        -> fail, naming what
    otherwise                                               -> pass: seconds until ready and
                                                               until P/D answered correctly
    """
    details: dict[str, Any] = {
        "restarted": name,
        "killed_by_this_check": killed_here,
        "killed_gone": killed_gone,
        "ready_s": None if ready_s is None else round(ready_s, 3),
        "pd_correct_s": None if correct_s is None else round(correct_s, 3),
        "attempts": [o.to_dict() for o in attempts],
        "last_kind": attempts[-1].kind if attempts else None,  # how the last request ended
        "recovery": recovery.to_dict() if recovery else None,
    }
    if start_error is not None:
        return CheckResult(NAME, FAIL, f"{name} did not start again in place: {start_error}", details)
    broke = [(i, a) for i, a in enumerate(attempts) if a.kind not in KEPT]
    if broke:
        listed = ", ".join(
            f"{i + 1}: {a.kind}" + (f" (HTTP {a.status})" if a.status else "") for i, a in enumerate(attempts)
        )
        i, first = broke[0]
        return CheckResult(
            NAME,
            FAIL,
            f"{name} ready again after {ready_s or 0:.1f} s, but request {i + 1} through the router was "
            f"{first.kind}"
            + (f": {first.detail[:120]!r}" if first.detail else "")
            + f" (a wrong answer before a right one is a failure, not a retry; attempts: {listed})",
            details,
        )
    if correct_s is None:
        last = attempts[-1] if attempts else None
        said = (
            f"{last.kind} after {last.seconds:.1f} s" + (f" (HTTP {last.status})" if last.status else "")
            if last
            else "none sent"
        )
        return CheckResult(
            NAME,
            FAIL,
            f"{name} ready again after {ready_s or 0:.1f} s, but no request through the router was "
            f"correct within {bound_s:g} s ({len(attempts)} tried; last: {said})",
            details,
        )
    if recovery is not None and not recovery.ok:
        return CheckResult(NAME, FAIL, f"{name} restarted; {recovery.line()}", details)
    return CheckResult(
        NAME,
        PASS,
        f"{name} started again in place (same ports and role): ready after {ready_s or 0:.1f} s, "
        f"P/D correct again {correct_s:.1f} s after the restart ({len(attempts)} request(s))",
        details,
    )


@gatherer(NAME)
def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    cluster = window.cluster
    s = Scenario(window, NAME)
    killed_here = not cluster.down
    if killed_here:
        cluster.kill_instance(window.plan.prefill[0].name)
    name = next(iter(cluster.down))
    idle = s.gauges()  # the survivors, before the restart
    bound_s = float(options["bound_s"])
    t0 = time.monotonic()
    try:
        cluster.restart_instance(name, deadline_s=float(options["deadline_s"]), say=log.info)
    except (ReadinessTimeout, ProcessExited) as e:
        return evaluate(
            name,
            ready_s=None,
            start_error=str(e),
            attempts=[],
            correct_s=None,
            recovery=None,
            killed_here=killed_here,
            bound_s=bound_s,
            killed_gone=True,  # restart_instance raised StopError (NOT RUN) had any survived
        )
    ready_s = time.monotonic() - t0
    attempts: list[Outcome] = []
    correct_s = None
    while time.monotonic() - t0 - ready_s < bound_s:
        a = s.ask(
            window.plan.router.url,
            f"Back in place ({len(attempts)}): the baker opened",
            max_tokens=MAX_TOKENS,
        )
        attempts.append(
            s.judged(a, reference=window.plan.prefill[0], max_tokens=MAX_TOKENS, bound_s=REQUEST_BOUND_S)
        )
        if attempts[-1].kind == CORRECT:
            correct_s = time.monotonic() - t0
            break
        if attempts[-1].kind not in KEPT:  # a wrong, hung or broken answer: no retry undoes it
            break
        time.sleep(0.5)
    recovery = s.recover(idle) if correct_s is not None else None
    return evaluate(
        name,
        ready_s=ready_s,
        start_error=None,
        attempts=attempts,
        correct_s=correct_s,
        recovery=recovery,
        killed_here=killed_here,
        bound_s=bound_s,
        killed_gone=True,
    )
