"""wire_loss: ``rates`` % of the KV packets between the prefill and decode hosts dropped, each rate
in turn (a burst of ``requests``, again, up to LOSS_BURSTS, until the rule has dropped a packet).
Per rate: how the requests ended and their median time against no loss; the first rate where
they slow or fail. What the wire scenarios share (across hosts only, the fault removed whatever
ends it, proved from the kernel's counters, the promise): wire_common.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pd_sessions.checks.faults.promise import (
    CORRECT,
    KINDS,
    Outcome,
    Recovery,
    broken_promise,
    counts,
    proven,
    recovery_details,
    said,
    verdict,
)
from pd_sessions.checks.faults.scenario import Answer
from pd_sessions.checks.faults.wire_common import Wire, across_hosts, bitten, ended, median, prompts, slow
from pd_sessions.core import wire_rules
from pd_sessions.core.results import CheckResult, Figure, Table, pick, reporting

# wire_loss sends up to this many bursts under a rate until its rule has dropped a packet: a
# burst of the tiny model's requests is 100-250 packets (GSO segments), so at 2 % one burst
# meets no drop 1-13 % of the time; three, at most 0.2 %.
LOSS_BURSTS = 3


@dataclass(frozen=True)
class RateRun:
    """One loss rate: the burst under it and what the rule counted."""

    percent: int
    outcomes: Sequence[Outcome]
    counters: Mapping[str, int]  # {"seen": N, "dropped": M} (packets)

    @property
    def failed(self) -> int:
        return sum(1 for o in self.outcomes if o.kind != CORRECT)

    def to_dict(self, baseline_s: float) -> dict[str, Any]:
        return {
            "percent": self.percent,
            "counters": dict(self.counters),
            "slowed": slow([o.seconds for o in self.outcomes], baseline_s),
            **ended(self.outcomes),
        }


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    rates = details.get("rates") or []
    return [
        *pick(
            details,
            ("baseline_median_s", "s"),
            ("first_slow_rate", "%"),
            ("first_failing_rate", "%"),
            ("recovery_s", "s"),
        ),
        Table(
            "KV packets dropped between the prefill and decode hosts",
            ("loss %", "KV packets seen", "dropped", *KINDS, "median s", "max s", "slowed"),
            tuple(
                (
                    r["percent"],
                    r["counters"].get(wire_rules.SEEN, 0),
                    r["counters"].get(wire_rules.DROPPED, 0),
                    *(r["counts"][k] for k in KINDS),
                    r["median_s"],
                    r["max_s"],
                    "yes" if r["slowed"] else "no",
                )
                for r in rates
            ),
        ),
    ]


@reporting(numbers)
@proven(
    lambda d: [
        bitten(f"the KV rule dropping {r['percent']} %", r["counters"], wire_rules.DROPPED)
        for r in d.get("rates") or []
    ]
)
def evaluate(runs: Sequence[RateRun], baseline: Sequence[Outcome], recovery: Recovery) -> CheckResult:
    """The verdict of wire_loss.

    a rate whose rule dropped no packet            -> NOT RUN "invalid" (the fault did not
                                                      bite: promise.proven)
    a request wrong, hung or cut (any rate, or the
    burst without loss)                            -> fail, naming it
    the cluster not whole again                    -> fail, naming what
    otherwise                                      -> pass: per rate how the requests ended,
                                                      the first rate that slowed or failed them
    """
    base_s = median([o.seconds for o in baseline])
    first_slow = next((r.percent for r in runs if slow([o.seconds for o in r.outcomes], base_s)), None)
    first_fail = next((r.percent for r in runs if r.failed), None)
    details: dict[str, Any] = {
        "baseline_median_s": round(base_s, 3),
        "baseline": ended(baseline),
        "rates": [r.to_dict(base_s) for r in runs],
        "first_slow_rate": first_slow,
        "first_failing_rate": first_fail,
        **recovery_details(recovery),
    }
    problems: list[str | None] = []
    for r in runs:
        broken = broken_promise(r.outcomes)
        problems.append(f"{r.percent} %: {broken}" if broken else None)
    broken = broken_promise(baseline)
    problems.append(f"without loss: {broken}" if broken else None)

    def passed() -> str:
        per_rate = "; ".join(
            f"{r.percent} %: {r.counters.get(wire_rules.DROPPED, 0)} of "
            f"{r.counters.get(wire_rules.SEEN, 0)} KV "
            f"packets dropped, {said(counts(r.outcomes))}, "
            f"median {median([o.seconds for o in r.outcomes]):.2f} s"
            for r in runs
        )
        when = (
            f"requests slowed from {first_slow} %"
            if first_slow is not None
            else "no rate slowed the requests"
        ) + (f", failed from {first_fail} %" if first_fail is not None else ", none failed")
        return f"{per_rate} (median without loss {base_s:.2f} s): {when}; {recovery.line()}"

    return verdict("wire_loss", problems, recovery, details, failed="", passed=passed)


@across_hosts("wire_loss")
def run(w: Wire, options: Mapping[str, Any]) -> CheckResult:
    n, bound_s = int(options["requests"]), float(options["bound_s"])
    idle = w.s.gauges()
    path = w.path()
    baseline = w.judge(w.burst(prompts("No loss", n), bound_s), bound_s)
    runs = []
    for percent in options["rates"]:
        answers: list[Answer] = []
        with w.dropping(path, int(percent)) as got:
            for k in range(LOSS_BURSTS):  # a low rate may meet no packet of one small burst
                answers += w.burst(prompts(f"Loss {percent}.{k}", n), bound_s)
                if w.on(str(w.decode.node), "counters").get(wire_rules.DROPPED, 0) > 0:
                    break
        runs.append(RateRun(int(percent), w.judge(answers, bound_s), dict(got)))
    return evaluate(runs, baseline, w.s.recover(idle))
