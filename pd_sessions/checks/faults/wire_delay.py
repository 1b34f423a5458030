"""wire_delay: netem ``delay_ms`` on the prefill host's interface; NOT RUN where tc says the
kernel has no netem (the reason in its message, JUnit's <skipped>, the page: never a pass).
What the wire scenarios share (across hosts only, the fault removed whatever ends it, proved from
the kernel's counters, the promise): wire_common.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pd_sessions.checks.faults.promise import (
    Outcome,
    Recovery,
    counts,
    counts_table,
    not_passing,
    proven,
    recovery_details,
    said,
    verdict,
)
from pd_sessions.checks.faults.wire_common import Wire, across_hosts, bitten, ended, median, prompts
from pd_sessions.core.results import CheckResult, Figure, Table, pick, reporting, unrun


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    return [
        *pick(
            details,
            ("delay_ms", "ms"),
            ("baseline_median_s", "s"),
            ("delayed_median_s", "s"),
            ("recovery_s", "s"),
        ),
        *([counts_table(details["counts"], "requests under the delay")] if "counts" in details else []),
    ]


@reporting(numbers)
@proven(lambda d: [bitten(f"netem delaying {d.get('delay_ms')} ms", d.get("netem"), "packets")])
def evaluate(
    *,
    delay_ms: int,
    no_netem: str | None,
    outcomes: Sequence[Outcome] = (),
    baseline: Sequence[Outcome] = (),
    stats: Mapping[str, int] | None = None,
    recovery: Recovery | None = None,
) -> CheckResult:
    """The verdict of wire_delay.

    the kernel has no netem (``no_netem``: tc's message) -> NOT RUN: "no netem in this kernel"
                                                            (it could not look: never a pass)
    netem passed no packet                               -> NOT RUN "invalid" (the delay did
                                                            not bite: promise.proven)
    a request not correct                                -> fail, naming it
    the cluster not whole again                          -> fail
    otherwise                                            -> pass with both medians
    """
    if no_netem is not None:
        return unrun(
            "wire_delay",
            f"no netem in this kernel (tc: {no_netem}); the {delay_ms} ms delay needs the sch_netem module",
            {"ran": False, "delay_ms": delay_ms, "tc": no_netem},
        )
    c = counts(outcomes)
    base_s, delayed_s = median([o.seconds for o in baseline]), median([o.seconds for o in outcomes])
    details: dict[str, Any] = {
        "ran": True,
        "delay_ms": delay_ms,
        "netem": dict(stats) if stats is not None else None,
        "baseline_median_s": round(base_s, 3),
        "delayed_median_s": round(delayed_s, 3),
        "baseline": ended(baseline),
        **ended(outcomes),
    }
    problems = [not_passing([*outcomes, *baseline], f"under a {delay_ms} ms delay", shown=1)]
    if recovery is not None:
        details.update(recovery_details(recovery))

    def passed() -> str:
        return (
            f"{delay_ms} ms added on the prefill host's interface: {said(c)}, median {delayed_s:.2f} s "
            f"against {base_s:.2f} s" + (f"; {recovery.line()}" if recovery is not None else "")
        )

    return verdict("wire_delay", problems, recovery, details, failed=f"delay ({said(c)}): ", passed=passed)


@across_hosts("wire_delay")
def run(w: Wire, options: Mapping[str, Any]) -> CheckResult:
    n, bound_s, ms = int(options["requests"]), float(options["bound_s"]), int(options["delay_ms"])
    host = str(w.prefill.node)
    no_netem = w.on(host, "delay", ifname=None, delay_ms=ms)
    if no_netem is not None:
        return evaluate(delay_ms=ms, no_netem=no_netem)
    w.on(host, "uncap", ifname=None, kind="netem")  # probed: now measure without, then with
    idle = w.s.gauges()
    baseline = w.judge(w.burst(prompts("Undelayed", n), bound_s), bound_s)
    with w.qdisc("netem", lambda: w.on(host, "delay", ifname=None, delay_ms=ms)) as got:
        answers = w.burst(prompts("Delayed", n), bound_s)
    return evaluate(
        delay_ms=ms,
        no_netem=None,
        outcomes=w.judge(answers, bound_s),
        baseline=baseline,
        stats=got.get("stats"),
        recovery=w.s.recover(idle),
    )
