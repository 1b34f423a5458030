"""wire_cap: tbf at ``rate_kbit`` on the prefill host's interface. The burst's time against no
cap, the bytes tbf passed and the time the cap needs for them. What the wire scenarios share
(across hosts only, the fault removed whatever ends it, proved from the kernel's counters, the
promise): wire_common.py.
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
from pd_sessions.core.results import CheckResult, Figure, Table, pick, reporting

TBF_BURST_BYTES = 16 * 1024
TBF_LATENCY_MS = 400


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    return [
        *pick(
            details,
            ("rate_kbit", "kbit/s"),
            ("baseline_median_s", "s"),
            ("capped_median_s", "s"),
            ("tbf_bytes", "B"),
            ("tbf_overlimits", ""),
            ("tbf_drops", ""),
            ("cap_time_s", "s"),
            ("recovery_s", "s"),
        ),
        *([counts_table(details["counts"], "requests under the cap")] if "counts" in details else []),
    ]


@reporting(numbers)
@proven(lambda d: [bitten(f"tbf at {d.get('rate_kbit')} kbit/s", d.get("tbf"), "overlimits", "drops")])
def evaluate(
    outcomes: Sequence[Outcome],
    baseline: Sequence[Outcome],
    stats: Mapping[str, int] | None,
    recovery: Recovery,
    *,
    rate_kbit: int,
) -> CheckResult:
    """The verdict of wire_cap.

    tbf was not there, or counted no overlimit or drop -> NOT RUN "invalid" (the cap did not
                                                          bite: promise.proven)
    a request not correct (the burst must pass)        -> fail, naming it
    the cluster not whole again                        -> fail, naming what
    otherwise                                          -> pass: the burst's time against no cap,
                                                          and the time the cap needs for the
                                                          bytes tbf passed
    """
    c = counts(outcomes)
    base_s = median([o.seconds for o in baseline])
    capped_s = median([o.seconds for o in outcomes])
    sent = (stats or {}).get("bytes", 0)
    cap_time = sent * 8 / (rate_kbit * 1000)
    details: dict[str, Any] = {
        "rate_kbit": rate_kbit,
        "baseline_median_s": round(base_s, 3),
        "capped_median_s": round(capped_s, 3),
        "tbf": dict(stats) if stats is not None else None,
        "tbf_bytes": sent,
        "tbf_overlimits": (stats or {}).get("overlimits", 0),
        "tbf_drops": (stats or {}).get("drops", 0),
        "cap_time_s": round(cap_time, 3),
        "baseline": ended(baseline),
        **ended(outcomes),
        **recovery_details(recovery),
    }
    problems = [not_passing([*outcomes, *baseline], "a capped link must only slow them")]

    def passed() -> str:
        return (
            f"the prefill host capped at {rate_kbit} kbit/s (tbf: {sent} bytes, "
            f"{details['tbf_overlimits']} overlimits, {details['tbf_drops']} drops; {cap_time:.1f} s at "
            f"the cap): {said(c)}, median {capped_s:.2f} s against {base_s:.2f} s uncapped; {recovery.line()}"
        )

    return verdict("wire_cap", problems, recovery, details, failed=f"cap ({said(c)}): ", passed=passed)


@across_hosts("wire_cap")
def run(w: Wire, options: Mapping[str, Any]) -> CheckResult:
    n, bound_s, rate = int(options["requests"]), float(options["bound_s"]), int(options["rate_kbit"])
    idle = w.s.gauges()
    baseline = w.judge(w.burst(prompts("Uncapped", n), bound_s), bound_s)
    host = str(w.prefill.node)

    def apply() -> Any:
        return w.on(
            host, "cap", ifname=None, rate_kbit=rate, burst_bytes=TBF_BURST_BYTES, latency_ms=TBF_LATENCY_MS
        )

    with w.qdisc("tbf", apply) as got:
        answers = w.burst(prompts("Capped", n), bound_s)
    return evaluate(w.judge(answers, bound_s), baseline, got.get("stats"), w.s.recover(idle), rate_kbit=rate)
