"""conservation: what the checks take from the instances, they give back. After every check the
runner (checks/runner.py) probes the cluster and attaches the record to that check's result
(``details["conservation"]``); this check, run last, judges every record:

1. **KV back to idle, in-flight sends drained**: within ``idle_bound_s`` of the check's end every
   live instance has no request running or waiting and no KV block in use (kv_held.holds against
   an empty cache: ``vllm:kv_cache_usage_perc`` x ``num_gpu_blocks``, exact to the block). A
   prefill's blocks stay in use while its send waits for the decode, so a send that never drains
   is a block still held: the same measure.
2. **process resources**: each instance's open fds, threads and RSS (psutil, summed over the
   process tree pd-sessions started) within a bound of their values after the warm-up check (the
   first check that ran); a restarted instance (a new PID) is measured from its first record.
   An instance on another host (the Ray lane) cannot be measured from here: NOT RUN, saying so.
3. **transfers started = transfers completed = requests through P/D**: where vLLM counts a
   connector's completed transfers (its spec's MetricEvidence, on the side that completes them),
   their rise over each check that counts its router requests (the window's ledger: smoke,
   parity) must equal those requests, exactly; the rise after every other check is recorded.
   Transfers started on the prefill: NOT RUN, with the reason (no connector exposes a counter of
   them in vLLM 0.32; a connector with no Prometheus counter at all is NOT RUN as a whole).

A violation FAILs, naming the instance, what it held or how far it grew, and the check after
which it first appeared. The parts not measured are named in the message, never passed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pd_sessions.checks import instances
from pd_sessions.checks.kv_held import BLOCKS, holds, state
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import connectors
from pd_sessions.core.connectors.base import LogEvidence, MetricEvidence
from pd_sessions.core.results import FAIL, NOT_RUN, PASS, CheckResult, Table, reporting, unrun
from pd_sessions.runtime import http, proc_usage
from pd_sessions.runtime.process import Running

NAME = "conservation"
POLL_S = 0.2
# An empty cache: no request, no KV block in use (exact where num_gpu_blocks is exposed; else
# abort_frees_kv's rule on the usage fraction, against 0).
IDLE: Mapping[str, float] = {
    instances.RUNNING: 0.0,
    instances.WAITING: 0.0,
    instances.KV_USAGE: 0.0,
    BLOCKS: 0.0,
}
RESOURCES = ("fds", "threads", "rss_mib")
# Beyond a connector's KV lease, how long the end-of-sweep wait for carried blocks may take.
END_SLACK_S = 5.0
BOUND_OPTION = {"fds": "fds_bound", "threads": "threads_bound", "rss_mib": "rss_bound_mib"}


# ---------------------------------------------------------------- the verdict (pure)


def transfers_unmeasured(connector: str) -> tuple[str, str | None]:
    """What of transfers started on the prefills = completed = P/D requests is not judged for
    ``connector``, and why (its spec's evidence says what vLLM exposes); and the counter of
    completed transfers judged against the router requests (None: there is none)."""
    spec = connectors.get(connector)
    ev = spec.evidence
    if isinstance(ev, MetricEvidence):
        return (
            f"transfers started on the prefill NOT RUN ({spec.title}: vLLM counts completed {ev.what} on the "
            f"{ev.role} only, {ev.count})",
            ev.count,
        )
    assert isinstance(ev, LogEvidence)
    return (
        f"transfers NOT RUN ({spec.title}: vLLM exposes no Prometheus counter of its transfers; its "
        f"'{ev.success}' log lines are summed per stats interval, not per check)",
        None,
    )


def unequal_transfers(records: Sequence[Mapping[str, Any]], counter: str) -> tuple[list[str], int]:
    """The checks whose completed transfers (summed over instances) differ from the router
    requests they counted, and how many checks were judged."""
    judged = [r for r in records if r.get("router_requests") and "transfers" in r]
    out = []
    for r in judged:
        got = sum((r.get("transfers") or {}).values())
        if got != r["router_requests"]:
            out.append(
                f"after {r['check']}: {got:g} completed transfers ({counter}) for {r['router_requests']} "
                "router requests"
            )
    return out, len(judged)


def first_growth(
    records: Sequence[Mapping[str, Any]], bounds: Mapping[str, float]
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Each instance's resources against its values after warm-up (its first record per PID):
    the problems (the first check after which each resource exceeded base + bound, per
    instance) and the warm-up values used."""
    base: dict[str, dict[str, Any]] = {}
    problems: dict[tuple[str, str], str] = {}
    for rec in records:
        for inst, u in (rec.get("usage") or {}).items():
            b = base.get(inst)
            if b is None or b["pid"] != u["pid"]:
                base[inst] = {**u, "after": rec["check"]}
                continue
            for k in RESOURCES:
                grew = u[k] - b[k]
                if grew > bounds[k] and (inst, k) not in problems:
                    problems[(inst, k)] = (
                        f"{inst}: {k} {u[k]:g} after {rec['check']} ({grew:+g} on {b[k]:g} after "
                        f"{b['after']}, bound +{bounds[k]:g})"
                    )
    return list(problems.values()), base


def first_held(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each instance that was not idle within the bound after a check: the first such check,
    what it held, and how many checks after it it still held something."""
    seen: dict[str, list[str]] = {}
    for rec in records:
        for inst, h in (rec.get("held") or {}).items():
            if h is not None:
                seen.setdefault(inst, []).append(f"{rec['check']}: {h}")
    out = []
    for inst, said in seen.items():
        more = f" (and after {len(said) - 1} later check(s))" if len(said) > 1 else ""
        first = said[0].split(": ", 1)
        out.append(f"{inst} not idle after {first[0]}: {first[1]}{more}")
    return out


def numbers(details: Mapping[str, Any]) -> list[Table]:
    rows = tuple(
        (
            r["check"],
            r.get("idle_s"),
            "; ".join(f"{n}: {h}" for n, h in (r.get("held") or {}).items() if h) or "nothing",
            "; ".join(
                f"{n} {u['fds']}/{u['threads']}/{u['rss_mib']:g}" for n, u in (r.get("usage") or {}).items()
            )
            or r.get("usage_not_run", ""),
            "; ".join(f"{n} {v:g}" for n, v in (r.get("transfers") or {}).items()) or "",
        )
        for r in details.get("records") or []
    )
    head = ("after", "idle after (s)", "still held", "fds/threads/RSS MiB", "transfers completed")
    return [Table("conservation after each check", head, rows)] if rows else []


@reporting(numbers)
def evaluate(
    records: Sequence[Mapping[str, Any]],
    bounds: Mapping[str, float],
    *,
    transfers: tuple[str, str | None],
    end: Mapping[str, Any] | None = None,
) -> CheckResult:
    """The verdict over every check's record (``transfers``: transfers_unmeasured's answer;
    ``end``: :func:`drain_at_end`'s record, where blocks were still carried at the last probe and
    the connector leases them: ``carried_at_end`` is then what outlived the lease).

    no record (no check ran before it)             -> NOT RUN
    an instance not idle within the bound          -> FAIL: instance, what it held, the check after
                                                      which it first appeared
    a resource above warm-up + its bound           -> FAIL: instance, value, warm-up, the check
    completed transfers != router requests         -> FAIL: the check, both counts
    a probe that failed                            -> FAIL, naming it
    otherwise                                      -> PASS; the parts not measured (transfers
                                                      started, resources on remote hosts) named
                                                      NOT RUN, never passed
    """
    details: dict[str, Any] = {"records": list(records), "bounds": dict(bounds)}
    if not records:
        return unrun(NAME, "no check ran before it: nothing to conserve", details)
    probed = [r for r in records if "held" in r]
    held = first_held(probed)
    growth, base = first_growth(probed, bounds)
    usage_unrun = sorted({r["usage_not_run"] for r in probed if r.get("usage_not_run")})
    why_not, counter = transfers
    unequal, judged = unequal_transfers(probed, counter) if counter else ([], 0)
    parts = {
        "kv_idle": FAIL if held else PASS,
        "resources": FAIL if growth else (NOT_RUN if usage_unrun and not base else PASS),
        "transfers": FAIL if unequal else (PASS if judged else NOT_RUN),
    }
    details.update(warm_up=base, parts=parts, transfers_not_run=why_not, resources_not_run=usage_unrun)
    # blocks reported once and never seen freed: at the last probe, or where the connector leases
    # them, after waiting its lease out (drain_at_end): what a known issue of a bounded lease must
    # not cover
    details["carried_at_end"] = dict(probed[-1].get("carried") or {}) if probed else {}
    if end is not None:
        details["end_drain"] = dict(end)
        details["carried_at_end"] = dict(end.get("carried") or {})
    not_run = [why_not] + [f"resources NOT RUN ({r})" for r in usage_unrun]
    not_run += [f"not probed after {r['check']} ({r['skipped']})" for r in records if "skipped" in r]
    errors = [f"after {r['check']}: {r['error']}" for r in records if "error" in r]
    if end is not None and end.get("carried"):  # what outlived the lease: a leak, said as such
        errors += [
            f"{n} still held {b:g} KV blocks {end.get('waited_s', 0):.1f} s after the last check "
            f"(its connector's KV lease and {END_SLACK_S:g} s waited out: {end.get('bound_s')} s)"
            for n, b in end["carried"].items()
        ]
    if not probed and not errors:
        return unrun(NAME, "no check was probed: " + "; ".join(not_run[1:]), details)
    problems = held + growth + unequal + errors
    if problems:
        return CheckResult(NAME, FAIL, "; ".join(problems) + "; " + "; ".join(not_run), details)
    b = ", ".join(f"{k} +{v:g}" for k, v in bounds.items())
    counted = f"completed transfers = router requests after {judged} check(s); " if judged else ""
    slowest = max(probed, key=lambda r: r["idle_s"])
    return CheckResult(
        NAME,
        PASS,
        f"after each of {len(probed)} checks every instance was idle within {slowest['bound_s']:g} s "
        f"(slowest {slowest['idle_s']:.1f} s, after {slowest['check']}) and within its warm-up "
        f"resources ({b}); {counted}" + "; ".join(not_run),
        details,
    )


# ---------------------------------------------------------------- gathering (edge)


def tree_usage(r: Running) -> dict[str, Any]:
    """fds, threads and RSS (MiB) summed over ``r``'s process and its descendants
    (runtime/proc_usage.py, the soak's reader too), and its PID; Unreadable naming why not."""
    u = proc_usage.tree_usage(r)
    return {"pid": r.pid, "fds": u.fds, "threads": u.threads, "rss_mib": round(u.rss_mib, 1)}


@dataclass
class Ledger:
    """The probes after each check of one window (the runner's; this check judges them)."""

    window: CheckWindow
    options: Mapping[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    counted: dict[str, float] = field(default_factory=dict)  # completed transfers so far
    requests: int = 0  # the window's router requests so far
    carried: dict[str, float] = field(default_factory=dict)  # blocks held past a bound, reported

    def reference(self) -> dict[str, dict[str, float]]:
        """Each instance's idle state for the next probe: an empty cache but the blocks it was
        already reported holding."""
        return {n: {**IDLE, BLOCKS: b} for n, b in self.carried.items() if b}

    @classmethod
    def open(cls, window: CheckWindow, options: Mapping[str, Any]) -> Ledger:
        ledger = cls(window, options)
        ledger.counted = completed_transfers(window)
        window.invariants[NAME] = ledger
        return ledger

    def after(self, check: str) -> None:
        """Probe the cluster after ``check`` and attach the record to its result."""
        w = self.window
        if w.stuck:
            rec: dict[str, Any] = {
                "check": check,
                "skipped": f"not probed: the P/D path is stuck ({w.stuck})",
            }
        else:
            try:
                rec = probe(w, check, float(self.options["idle_bound_s"]), self.reference())
                now = completed_transfers(w)
            except (proc_usage.Unreadable, OSError) as e:  # the conservation check fails, naming it
                rec = {"check": check, "error": f"probe failed: {type(e).__name__}: {e}"}
            else:
                # a restarted instance's counter starts again from 0: where it went down, the
                # instance restarted during the check (the soak restarts the decode, whose NIXL
                # counter this is), and the check's transfers cannot be counted from it
                restarted = sorted(n for n, v in now.items() if v < self.counted.get(n, 0.0))
                if restarted:
                    rec["transfers_not_judged"] = (
                        f"{', '.join(restarted)} restarted during {check}: its counter began again"
                    )
                else:
                    rec["transfers"] = {n: v - self.counted.get(n, 0.0) for n, v in now.items()}
                rec["router_requests"] = w.router_requests - self.requests
                self.counted.update(now)
                self.requests = w.router_requests
                # blocks an instance still held at the bound were reported after this check;
                # the next probes judge only blocks beyond them (as they are freed, fewer)
                for n, b in rec["blocks"].items():
                    left = b or 0.0
                    self.carried[n] = left if rec["held"].get(n) else min(self.carried.get(n, 0.0), left)
                rec["carried"] = {n: b for n, b in self.carried.items() if b}
        self.records.append(rec)
        if w.results and w.results[-1].name == check:
            w.results[-1].details[NAME] = rec


def probe(
    window: CheckWindow, check: str, bound_s: float, idle: Mapping[str, Mapping[str, float]] | None = None
) -> dict[str, Any]:
    """Poll the live instances until each is idle (an empty cache, or its state in ``idle``)
    or ``bound_s`` passed; then their resources. ``held``: instance -> what it still holds
    (None: idle)."""
    cluster = window.cluster
    live = [s for s in window.plan.instances if s.name not in cluster.down]
    t0 = time.monotonic()
    held: dict[str, str | None] = {}
    blocks: dict[str, float | None] = {}
    while True:
        for s in live:
            try:
                now = state(http.get_text(f"{s.url}/metrics", timeout=5.0))
                held[s.name], blocks[s.name] = holds((idle or {}).get(s.name, IDLE), now), now.get(BLOCKS)
            except http.HttpError as e:
                held[s.name] = f"/metrics: {e.reason}"
        if all(h is None for h in held.values()) or time.monotonic() - t0 >= bound_s:
            break
        time.sleep(POLL_S)
    rec: dict[str, Any] = {"check": check, "held": held, "idle_s": round(time.monotonic() - t0, 3)}
    rec.update(bound_s=bound_s, blocks=blocks)
    remote = [r.name for r in cluster.instances if r.node is not None]
    if remote:
        rec["usage_not_run"] = (
            f"{', '.join(remote)} on other hosts: their processes are not visible from this one"
        )
    else:
        rec["usage"] = {r.name: tree_usage(r) for r in cluster.instances if r.name not in cluster.down}
    return rec


def completed_transfers(window: CheckWindow) -> dict[str, float]:
    """instance -> its connector's completed-transfer counter, where vLLM exposes one (a
    restarted instance's starts again from 0)."""
    ev = connectors.get(window.plan.config.connector).evidence
    if not isinstance(ev, MetricEvidence):
        return {}
    out = {}
    for s in window.plan.decode if ev.role == "decode" else window.plan.prefill:
        if s.name in window.cluster.down:
            continue
        try:
            got = instances.sample_sums(http.get_text(f"{s.url}/metrics", timeout=5.0), [ev.count])
        except http.HttpError:
            continue
        out[s.name] = got.get(ev.count, 0.0)
    return out


def lease_of(connector: str) -> float | None:
    """How long ``connector`` leases a send's blocks (its spec's kv_lease_s), None: no lease."""
    return connectors.get(connector).kv_lease_s


def drain_at_end(window: CheckWindow, carried: Mapping[str, float], lease_s: float) -> dict[str, Any]:
    """After the last check: blocks ``carried`` since a probe reported them, on a connector that
    leases a send's blocks for ``lease_s``: wait that long (and END_SLACK_S) for every instance to
    be idle, then say which of them still hold blocks (``carried``: instance -> blocks in use).
    Timing-free: whatever the checks after the strand took, the lease has run out by then."""
    bound_s = lease_s + END_SLACK_S
    rec = probe(window, "the end of the checks", bound_s)
    # freed: seen idle. An instance not seen (down, or its /metrics unanswered) keeps what it
    # carried: a strand nobody saw freed is not called freed
    seen = rec["held"]
    left = {n: rec["blocks"].get(n) or b for n, b in carried.items() if n not in seen or seen[n] is not None}
    return {"bound_s": bound_s, "waited_s": rec["idle_s"], "held": seen, "carried": left}


def bounds_of(options: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(options[o]) for k, o in BOUND_OPTION.items()}


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    ledger = window.invariants.get(NAME)
    records = ledger.records if isinstance(ledger, Ledger) else []
    connector = window.plan.config.connector
    lease_s = lease_of(connector)
    carried = (records[-1].get("carried") or {}) if records else {}
    end = drain_at_end(window, carried, lease_s) if carried and lease_s and not window.stuck else None
    return evaluate(records, bounds_of(options), transfers=transfers_unmeasured(connector), end=end)
