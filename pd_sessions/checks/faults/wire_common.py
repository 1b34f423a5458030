"""What the faults on the wire between the prefill and decode hosts share (wire_loss.py,
wire_partition.py, wire_cap.py, wire_delay.py: one module per scenario). Only across hosts
(``--simulate-hosts N`` or ``--ray``); a run on one host is refused before launch
(core/check_registry.py: ``across_hosts_only``).

Each scenario applies its fault on the hosts' network for its own duration and removes it
afterwards, whatever ends it (an error, Ctrl-C): the nftables table on the decode host, the
qdisc on the prefill host (core/wire_rules.py has the rules and why there). Each proves its fault bit
from the kernel's counters (the rule's dropped packets, tbf's overlimits or drops): a fault that
did not bite fails the scenario. The promise is the injected faults' (promise.py): every request
equals prefill-direct or fails with a clear HTTP error within ``bound_s``; never a 200 with other
text, never a hang; afterwards the cluster is whole again, and the time it took is recorded.

Pure: :func:`slow`, :func:`ended`, :func:`bitten` (and each scenario's ``evaluate``). The
gatherers run the faults through the cluster's launcher (``on_host``: the node agent of that
host, runtime/wire_apply.py): :class:`Wire` and :func:`across_hosts`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pd_sessions.checks.faults.promise import Outcome, Proof, counts, guard
from pd_sessions.checks.faults.scenario import Answer, Scenario
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import wire_rules
from pd_sessions.core.errors import PdError
from pd_sessions.core.plan import ProcessSpec
from pd_sessions.core.results import FAIL, CheckResult

MAX_TOKENS = 4
# A burst is "slowed" by a fault when its median request time is this many times the median
# without the fault, and at least SLOW_MIN_S longer (the tiny model's requests take ~0.1 s:
# scheduling noise alone can double them).
SLOW_FACTOR = 2.0
SLOW_MIN_S = 0.5


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


def bitten(what: str, got: Mapping[str, Any] | None, *keys: str) -> Proof:
    """The proof that a wire fault bit: one of ``keys`` of the kernel's counters ``got`` above
    zero (``what``: the rule or qdisc, e.g. "the KV rule dropping 2 %"; its value names the
    counters read)."""
    shown = ", ".join(f"{k} {v}" for k, v in sorted((got or {}).items())) or "nothing (no counters)"
    return Proof(f"{what}: its counters", shown, got is not None and any(got.get(k, 0) > 0 for k in keys))


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


WireRun = Callable[[Wire, Mapping[str, Any]], CheckResult]
Gatherer = Callable[[CheckWindow, Mapping[str, Any]], CheckResult]


def across_hosts(name: str) -> Callable[[WireRun], Gatherer]:
    """A wire scenario's gatherer (``run(wire, options)`` made ``run(window, options)``): it fails,
    saying why, where it cannot run (one host, a host without nft/tc, a host error) instead of
    ending the config; what it returns must prove that its fault bit (promise.guard, as every
    fault scenario's gatherer: NOT RUN "invalid" otherwise)."""

    def wrap(run: WireRun) -> Gatherer:
        def gatherer(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
            try:
                return guard(run(Wire(window, name), options))
            except (PdError, ValueError) as e:
                return CheckResult(name, FAIL, f"could not run: {e}")

        gatherer.__name__ = f"run_{name}"
        return gatherer

    return wrap
