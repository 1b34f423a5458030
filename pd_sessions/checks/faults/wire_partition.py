"""wire_partition: every KV packet between the prefill and decode hosts dropped for
``partition_s`` in the middle of a burst. What each request got, and when; the time from the heal
until a request is served correctly. What the wire scenarios share (across hosts only, the fault
removed whatever ends it, proved from the kernel's counters, the promise): wire_common.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pd_sessions.checks.faults.promise import (
    CORRECT,
    FAILED_CLEARLY,
    Outcome,
    Recovery,
    broken_promise,
    counts,
    counts_table,
    proven,
    said,
    verdict,
)
from pd_sessions.checks.faults.scenario import Answer
from pd_sessions.checks.faults.wire_common import MAX_TOKENS, Wire, across_hosts, bitten, ended, prompts
from pd_sessions.core import wire_rules
from pd_sessions.core.results import CheckResult, Figure, Table, pick, reporting


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    return [
        *pick(
            details,
            ("partition_s", "s"),
            ("dropped_packets", ""),
            ("last_answer_after_heal_s", "s"),
            ("recovery_s", "s"),
        ),
        *(
            [counts_table(details["counts"], "requests in flight across the partition")]
            if "counts" in details
            else []
        ),
    ]


@reporting(numbers)
@proven(lambda d: [bitten("the partition's KV rule", d.get("counters"), wire_rules.DROPPED)])
def evaluate(
    outcomes: Sequence[Outcome],
    counters: Mapping[str, int],
    recovery: Recovery,
    *,
    partition_s: float,
    answered_after_heal_s: Sequence[float],
    recovered_after_heal_s: float,
) -> CheckResult:
    """The verdict of wire_partition.

    the rule dropped no packet (no KV crossed during the cut)  -> NOT RUN "invalid" (the fault
                                                                   did not bite: promise.proven)
    a request wrong, hung or cut                                -> fail, naming it
    the cluster not whole again                                 -> fail, naming what
    otherwise                                                   -> pass: what the requests in
                                                                   flight got; the time from the
                                                                   heal until served correctly
    """
    c = counts(outcomes)
    last = max(answered_after_heal_s, default=0.0)
    details: dict[str, Any] = {
        "partition_s": partition_s,
        "counters": dict(counters),
        "dropped_packets": counters.get(wire_rules.DROPPED, 0),
        "last_answer_after_heal_s": round(last, 3),
        "recovery_s": round(recovered_after_heal_s, 3),
        **ended(outcomes),
        "recovery": recovery.to_dict(),
    }
    problems = [broken_promise(outcomes)]

    def passed() -> str:
        how = (
            "each answered correctly once healed"
            if c[CORRECT] == len(outcomes)
            else "each failed with an HTTP error"
            if c[FAILED_CLEARLY] == len(outcomes)
            else "each correct or failed with an HTTP error"
        )
        return (
            f"every KV packet between the hosts dropped for {partition_s:g} s "
            f"({counters.get(wire_rules.DROPPED, 0)} packets): {said(c)}: {how}, the last {last:.1f} s after "
            f"the heal; served correctly again {recovered_after_heal_s:.1f} s after the heal "
            f"({recovery.line()})"
        )

    return verdict(
        "wire_partition", problems, recovery, details, failed=f"partition ({said(c)}): ", passed=passed
    )


@across_hosts("wire_partition")
def run(w: Wire, options: Mapping[str, Any]) -> CheckResult:
    n, bound_s, cut_s = int(options["requests"]), float(options["bound_s"]), float(options["partition_s"])
    idle = w.s.gauges()
    path = w.path()
    url = w.window.plan.router.url
    healed_at: list[float] = []
    done_at: dict[int, float] = {}

    def ask(i: int, p: str) -> Answer:
        a = w.s.ask(url, p, max_tokens=MAX_TOKENS, bound_s=bound_s)
        done_at[i] = time.monotonic()
        return a

    ps = prompts("Partition", n)
    first = max(1, n // 2)
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(ask, i, p) for i, p in enumerate(ps[:first])]  # in flight at the cut
        with w.dropping(path, 100) as got:
            futures += [pool.submit(ask, first + i, p) for i, p in enumerate(ps[first:])]  # during it
            threading.Event().wait(cut_s)
        healed_at.append(time.monotonic())
        answers = [f.result() for f in futures]
    heal = healed_at[0]
    after = [max(0.0, t - heal) for t in done_at.values()]
    outcomes = w.judge(answers, bound_s)
    t_rec = time.monotonic()
    recovery = w.s.recover(idle)
    return evaluate(
        outcomes,
        got,
        recovery,
        partition_s=cut_s,
        answered_after_heal_s=after,
        recovered_after_heal_s=(t_rec - heal) + recovery.seconds,
    )
