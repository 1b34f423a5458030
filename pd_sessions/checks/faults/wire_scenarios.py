"""Faults on the wire between the prefill and decode hosts: wire_loss, wire_partition, wire_cap,
wire_delay. Only across hosts (``--simulate-hosts N`` or ``--ray``); a run on one host is refused
before launch (core/check_registry.py: ``across_hosts_only``).

Each scenario applies its fault on the hosts' network for its own duration and removes it
afterwards, whatever ends it (an error, Ctrl-C): the nftables table on the decode host, the
qdisc on the prefill host (core/wire_rules.py has the rules and why there). Each proves its fault bit
from the kernel's counters (the rule's dropped packets, tbf's overlimits or drops): a fault that
did not bite fails the scenario. The promise is the injected faults' (promise.py): every request
equals prefill-direct or fails with a clear HTTP error within ``bound_s``; never a 200 with other
text, never a hang; afterwards the cluster is whole again, and the time it took is recorded.

- **wire_loss**: ``rates`` % of the KV packets dropped, each rate in turn (a burst of ``requests``,
  again, up to LOSS_BURSTS, until the rule has dropped a packet). Per rate: how the
  requests ended and their median time against no loss; the first rate where they slow or fail.
- **wire_partition**: every KV packet dropped for ``partition_s`` in the middle of a burst. What
  each request got, and when; the time from the heal until a request is served correctly.
- **wire_cap**: tbf at ``rate_kbit`` on the prefill host's interface. The burst's time against no
  cap, the bytes tbf passed and the time the cap needs for them.
- **wire_delay**: netem ``delay_ms`` on the prefill host's interface; "not run: no netem in this
  kernel" where tc says so.

Pure: the ``evaluate_*`` functions and :func:`slow`. The gatherers run the faults through the
cluster's launcher (``on_host``: the node agent of that host, runtime/wire_apply.py).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pd_sessions.checks.faults.promise import (
    CORRECT,
    FAILED_CLEARLY,
    KINDS,
    Outcome,
    Recovery,
    broken_promise,
    counts,
    counts_table,
    not_passing,
    recovery_details,
    said,
    verdict,
)
from pd_sessions.checks.faults.scenario import Answer, Scenario
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import wire_rules
from pd_sessions.core.errors import PdError
from pd_sessions.core.plan import ProcessSpec
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting

MAX_TOKENS = 4
# A burst is "slowed" by a fault when its median request time is this many times the median
# without the fault, and at least SLOW_MIN_S longer (the tiny model's requests take ~0.1 s:
# scheduling noise alone can double them).
SLOW_FACTOR = 2.0
SLOW_MIN_S = 0.5
# wire_loss sends up to this many bursts under a rate until its rule has dropped a packet: a
# burst of the tiny model's requests is 100-250 packets (GSO segments), so at 2 % one burst
# meets no drop 1-13 % of the time; three, at most 0.2 %.
LOSS_BURSTS = 3
TBF_BURST_BYTES = 16 * 1024
TBF_LATENCY_MS = 400


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def slow(seconds: Sequence[float], baseline_s: float) -> bool:
    """Whether a burst's request times are slowed against ``baseline_s`` (the median without the
    fault): median >= SLOW_FACTOR x baseline and >= baseline + SLOW_MIN_S."""
    m = median(seconds)
    return m >= SLOW_FACTOR * baseline_s and m >= baseline_s + SLOW_MIN_S


def ended(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """A burst's counts and times, for the details."""
    return {
        "counts": counts(outcomes),
        "median_s": round(median([o.seconds for o in outcomes]), 3),
        "max_s": round(max((o.seconds for o in outcomes), default=0.0), 3),
        "outcomes": [o.to_dict() for o in outcomes],
    }


def not_bitten(what: str, got: Mapping[str, int] | None, *keys: str) -> str | None:
    """None when one of ``keys`` of the kernel's counters ``got`` is above zero, else why the
    fault did not bite (naming the counters)."""
    if got is not None and any(got.get(k, 0) > 0 for k in keys):
        return None
    shown = ", ".join(f"{k} {v}" for k, v in sorted((got or {}).items())) or "none read"
    return f"the fault did not bite: {what} ({shown}): a fault that did not happen proves nothing"


# ---------------------------------------------------------------- wire_loss


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


def loss_numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
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


@reporting(loss_numbers)
def evaluate_loss(runs: Sequence[RateRun], baseline: Sequence[Outcome], recovery: Recovery) -> CheckResult:
    """The verdict of wire_loss.

    a rate whose rule dropped no packet            -> fail (the fault did not bite)
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
        bit = not_bitten(
            f"the rule dropping {r.percent} % dropped no KV packet", r.counters, wire_rules.DROPPED
        )
        broken = broken_promise(r.outcomes)
        problems += [f"{r.percent} %: {bit}" if bit else None, f"{r.percent} %: {broken}" if broken else None]
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


# ---------------------------------------------------------------- wire_partition


def partition_numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
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


@reporting(partition_numbers)
def evaluate_partition(
    outcomes: Sequence[Outcome],
    counters: Mapping[str, int],
    recovery: Recovery,
    *,
    partition_s: float,
    answered_after_heal_s: Sequence[float],
    recovered_after_heal_s: float,
) -> CheckResult:
    """The verdict of wire_partition.

    the rule dropped no packet (no KV crossed during the cut)  -> fail (the fault did not bite)
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
    problems = [
        not_bitten("the partition's rule dropped no KV packet", counters, wire_rules.DROPPED),
        broken_promise(outcomes),
    ]

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


# ---------------------------------------------------------------- wire_cap


def cap_numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
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


@reporting(cap_numbers)
def evaluate_cap(
    outcomes: Sequence[Outcome],
    baseline: Sequence[Outcome],
    stats: Mapping[str, int] | None,
    recovery: Recovery,
    *,
    rate_kbit: int,
) -> CheckResult:
    """The verdict of wire_cap.

    tbf was not there, or counted no overlimit or drop -> fail (the cap did not bite)
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
    problems = [
        not_bitten(f"tbf at {rate_kbit} kbit/s", stats, "overlimits", "drops"),
        not_passing([*outcomes, *baseline], "a capped link must only slow them"),
    ]

    def passed() -> str:
        return (
            f"the prefill host capped at {rate_kbit} kbit/s (tbf: {sent} bytes, "
            f"{details['tbf_overlimits']} overlimits, {details['tbf_drops']} drops; {cap_time:.1f} s at "
            f"the cap): {said(c)}, median {capped_s:.2f} s against {base_s:.2f} s uncapped; {recovery.line()}"
        )

    return verdict("wire_cap", problems, recovery, details, failed=f"cap ({said(c)}): ", passed=passed)


# ---------------------------------------------------------------- wire_delay


def delay_numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
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


@reporting(delay_numbers)
def evaluate_delay(
    *,
    delay_ms: int,
    no_netem: str | None,
    outcomes: Sequence[Outcome] = (),
    baseline: Sequence[Outcome] = (),
    stats: Mapping[str, int] | None = None,
    recovery: Recovery | None = None,
) -> CheckResult:
    """The verdict of wire_delay.

    the kernel has no netem (``no_netem``: tc's message) -> pass, said "not run: no netem in
                                                            this kernel" (recorded, never silent)
    netem passed no packet                               -> fail (the delay did not bite)
    a request not correct                                -> fail, naming it
    the cluster not whole again                          -> fail
    otherwise                                            -> pass with both medians
    """
    if no_netem is not None:
        return CheckResult(
            "wire_delay",
            PASS,
            f"not run: no netem in this kernel (tc: {no_netem}); the {delay_ms} ms delay needs "
            "the sch_netem module",
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
    problems = [
        not_bitten(f"netem delaying {delay_ms} ms", stats, "packets"),
        not_passing([*outcomes, *baseline], f"under a {delay_ms} ms delay", shown=1),
    ]
    if recovery is not None:
        details.update(recovery_details(recovery))

    def passed() -> str:
        return (
            f"{delay_ms} ms added on the prefill host's interface: {said(c)}, median {delayed_s:.2f} s "
            f"against {base_s:.2f} s" + (f"; {recovery.line()}" if recovery is not None else "")
        )

    return verdict("wire_delay", problems, recovery, details, failed=f"delay ({said(c)}): ", passed=passed)


# ---------------------------------------------------------------- gathering (edge)


class NotAcross(PdError):
    """The cluster's prefill and decode are not on two hosts: no wire to fault."""


@dataclass
class Wire:
    """The wire between prefill-0's host and decode-0's host of a window's cluster."""

    window: CheckWindow
    name: str
    s: Scenario = field(init=False)
    prefill: ProcessSpec = field(init=False)
    decode: ProcessSpec = field(init=False)

    def __post_init__(self) -> None:
        plan = self.window.plan
        self.prefill, self.decode = plan.prefill[0], plan.decode[0]
        p, d = self.prefill.node, self.decode.node
        if p is None or d is None or p == d:
            raise NotAcross(
                f"{self.prefill.name} runs on {p or 'the driver host'} and {self.decode.name} on "
                f"{d or 'the driver host'}: no wire between them (plan them on two hosts: "
                "--simulate-hosts 2, or --ray with prefill_hosts / decode_hosts)"
            )
        self.s = Scenario(self.window, self.name, injector=False)
        lacking = sorted({*self.on(p, "missing"), *self.on(d, "missing")})
        if lacking:
            raise NotAcross("the hosts lack: " + "; ".join(lacking))

    def on(self, host: str, op: str, **kwargs: Any) -> Any:
        return self.window.cluster.launcher.on_host(host, op, **kwargs)

    def path(self) -> wire_rules.KvPath:
        """The KV path: each host's address and the ports its instance listens on there."""

        def ports(spec: ProcessSpec) -> tuple[int, ...]:
            pid = self.window.cluster.instance(spec.name).pid
            got = self.on(
                str(spec.node), "kv_ports", pid=pid, exclude=[spec.port], address=spec.bind or spec.host
            )
            return tuple(int(x) for x in got)

        return wire_rules.KvPath(self.prefill.host, self.decode.host, ports(self.prefill), ports(self.decode))

    @contextmanager
    def dropping(self, path: wire_rules.KvPath, percent: int) -> Iterator[dict[str, int]]:
        """``percent`` % of the KV packets dropped on the decode host for the block; the rule's
        counters (read before it goes) fill the yielded dict; the table is removed whatever
        ends the block."""
        got: dict[str, int] = {}
        host = str(self.decode.node)
        self.on(host, "drop", path=path.to_dict(), percent=percent)
        try:
            yield got
        finally:
            try:
                got.update(self.on(host, "counters"))
            finally:
                self.on(host, "heal")

    @contextmanager
    def qdisc(self, kind: str, apply: Callable[[], Any]) -> Iterator[dict[str, Any]]:
        """A ``kind`` qdisc on the prefill host's interface for the block (``apply`` adds it);
        its statistics (read before it goes) under "stats"; removed whatever ends the block."""
        got: dict[str, Any] = {}
        host = str(self.prefill.node)
        got["applied"] = apply()
        try:
            yield got
        finally:
            try:
                got["stats"] = self.on(host, "qdisc", ifname=None, kind=kind)
            finally:
                self.on(host, "uncap", ifname=None, kind=kind)

    def burst(self, prompts: Sequence[str], bound_s: float) -> list[Answer]:
        """``prompts`` through the router at once, each bounded by ``bound_s``."""
        url = self.window.plan.router.url
        with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
            futures = [
                pool.submit(self.s.ask, url, p, max_tokens=MAX_TOKENS, bound_s=bound_s) for p in prompts
            ]
            return [f.result() for f in futures]

    def judge(self, answers: Sequence[Answer], bound_s: float) -> list[Outcome]:
        return [
            self.s.judged(a, reference=self.prefill, max_tokens=MAX_TOKENS, bound_s=bound_s) for a in answers
        ]


def prompts(tag: str, n: int) -> list[str]:
    """``n`` distinct prompts of about two KV blocks each (a few hundred KV bytes per request on
    the tiny model: enough packets for a loss rate to meet)."""
    return [
        f"{tag} {i}: the cartographer unrolled the {i + 3} maps of the northern coast, traced the "
        f"rivers to their sources and counted the bridges, the ferries and the fords, then"
        for i in range(n)
    ]


def gather(
    name: str, run: Callable[[Wire, Mapping[str, Any]], CheckResult]
) -> Callable[[CheckWindow, Mapping[str, Any]], CheckResult]:
    """A wire scenario's gatherer: it fails, saying why, where it cannot run (one host, a host
    without nft/tc, a host error) instead of ending the config."""

    def gatherer(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
        try:
            return run(Wire(window, name), options)
        except (PdError, ValueError) as e:
            return CheckResult(name, FAIL, f"could not run: {e}")

    gatherer.__name__ = f"run_{name}"
    return gatherer


def _loss(w: Wire, options: Mapping[str, Any]) -> CheckResult:
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
    return evaluate_loss(runs, baseline, w.s.recover(idle))


def _partition(w: Wire, options: Mapping[str, Any]) -> CheckResult:
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
    return evaluate_partition(
        outcomes,
        got,
        recovery,
        partition_s=cut_s,
        answered_after_heal_s=after,
        recovered_after_heal_s=(t_rec - heal) + recovery.seconds,
    )


def _cap(w: Wire, options: Mapping[str, Any]) -> CheckResult:
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
    return evaluate_cap(
        w.judge(answers, bound_s), baseline, got.get("stats"), w.s.recover(idle), rate_kbit=rate
    )


def _delay(w: Wire, options: Mapping[str, Any]) -> CheckResult:
    n, bound_s, ms = int(options["requests"]), float(options["bound_s"]), int(options["delay_ms"])
    host = str(w.prefill.node)
    no_netem = w.on(host, "delay", ifname=None, delay_ms=ms)
    if no_netem is not None:
        return evaluate_delay(delay_ms=ms, no_netem=no_netem)
    w.on(host, "uncap", ifname=None, kind="netem")  # probed: now measure without, then with
    idle = w.s.gauges()
    baseline = w.judge(w.burst(prompts("Undelayed", n), bound_s), bound_s)
    with w.qdisc("netem", lambda: w.on(host, "delay", ifname=None, delay_ms=ms)) as got:
        answers = w.burst(prompts("Delayed", n), bound_s)
    return evaluate_delay(
        delay_ms=ms,
        no_netem=None,
        outcomes=w.judge(answers, bound_s),
        baseline=baseline,
        stats=got.get("stats"),
        recovery=w.s.recover(idle),
    )


run_loss = gather("wire_loss", _loss)
run_partition = gather("wire_partition", _partition)
run_cap = gather("wire_cap", _cap)
run_delay = gather("wire_delay", _delay)
