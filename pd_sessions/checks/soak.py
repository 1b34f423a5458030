"""soak: leaks across restarts, compressed. Each cycle restarts every prefill, then every decode,
in place (the same argv, environment, ports and role: runtime/cluster.py, kill_instance and
restart_instance, as fault_restart does), one at a time, so that the others live through each
restart. After each restart it waits until a request through the router equals prefill-0 direct,
runs parity and the KV digest (checks/parity.py, checks/kv_digest.py: the digest needs its
observer, so the soak requires kv_digest among the checks), waits until no instance holds a
request, and reads every process pd-sessions started (each instance and the router, with its
whole process tree): open fds, threads and RSS (runtime/proc_usage.py, psutil), and, of the
instances, the KV blocks in use (/metrics: vllm:kv_cache_usage_perc x num_gpu_blocks,
checks/kv_held.py, state).

Growth is counted only while a process stays the same (its PID unchanged between two reads): a
restarted instance starts over, and the leak users report (ai-dynamo/nixl#2025, vllm#49238) is
in the peer that lives through the restart. Per cycle and process, growth = the sum of its
changes between consecutive reads of the cycle where it stayed the same process: the decode's
across the prefill's restart, the prefill's across the decode's, the router's across both.

Bounds (per cycle, on the mean over the cycles; the per-cycle figures are all reported):
``fds_per_cycle``, ``threads_per_cycle``, ``rss_mib_per_cycle`` (options, see
core/check_registry.py for the defaults and docs/soak.md for the measurements they come from) and
KV_BLOCKS_PER_CYCLE = 0: a block still in use on an idle instance after a cycle, more than
before it, is stranded.

Verdicts (:func:`evaluate`):
- FAIL: an instance did not start again, or P/D did not answer correctly within ``bound_s`` of
  it being ready (a wrong answer first fails: no retry undoes it); parity or the digest failed
  after a restart; a resource of an instance grew beyond its bound (naming the instance, the
  resource and every cycle's figure).
- NOT RUN: a figure could not be read (its reason: on another host, no /metrics, ...), or parity
  or the digest could not look; the soak's restarts over Mooncake (the known issue
  router-stale-mooncake-engine-id: P/D never answers again after a prefill restarts in place).
- PASS: every cycle's restarts, parity and digest passed, and every growth within its bound.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pd_sessions.checks import kv_digest, parity
from pd_sessions.checks.faults.promise import CORRECT, KEPT, REQUEST_BOUND_S
from pd_sessions.checks.faults.scenario import Scenario
from pd_sessions.checks.instances import RUNNING, WAITING
from pd_sessions.checks.kv_held import BLOCKS, CACHE_INFO, state
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import connectors, known_issues
from pd_sessions.core.errors import ProcessExited, ReadinessTimeout, StopError
from pd_sessions.core.plan import ClusterPlan, ProcessSpec
from pd_sessions.core.results import FAIL, NOT_RUN, PASS, CheckResult, Figure, Table, reporting, unrun
from pd_sessions.env.envfacts import component_versions
from pd_sessions.runtime import http
from pd_sessions.runtime.proc_usage import FDS, RSS, THREADS, Unreadable, tree_usage

NAME = "soak"
KV_BLOCKS = "kv_blocks"
RESOURCES = (FDS, THREADS, RSS, KV_BLOCKS)
# A KV block in use on an idle instance, more than before the cycle, is stranded: no slack.
KV_BLOCKS_PER_CYCLE = 0.0
OPTION = {FDS: "fds_per_cycle", THREADS: "threads_per_cycle", RSS: "rss_mib_per_cycle"}
UNITS = {FDS: "", THREADS: "", RSS: "MiB", KV_BLOCKS: ""}
# How long the soak waits, before each read, for every instance to hold no request.
SETTLE_S = 15.0
MAX_TOKENS = 8

# One read of one process: {"pid": int, resource: value, ...} or {"pid": int|None, "unreadable": why}
Read = Mapping[str, Any]
# One read of every process pd-sessions started: process name -> its read
Sample = Mapping[str, Read]


def bounds(options: Mapping[str, Any]) -> dict[str, float]:
    """resource -> its bound on the growth per cycle, from the check's options."""
    return {**{r: float(options[o]) for r, o in OPTION.items()}, KV_BLOCKS: KV_BLOCKS_PER_CYCLE}


def cycle_growth(samples: Sequence[Sample]) -> tuple[dict[str, dict[str, float]], list[str]]:
    """(process -> resource -> its growth over one cycle's consecutive ``samples``, the reasons
    of figures that could not be read). Only pairs of reads of the same process (same PID) count;
    a resource read in neither of such a pair is left out of that pair; a process that never
    stayed the same between two reads has no growth this cycle (it is left out)."""
    growth: dict[str, dict[str, float]] = {}
    unread: list[str] = []
    for a, b in itertools.pairwise(samples):
        for name, after in b.items():
            before = a.get(name)
            for read in (before, after):
                if read is not None and "unreadable" in read and read["unreadable"] not in unread:
                    unread.append(str(read["unreadable"]))
            if before is None or before.get("pid") is None or before.get("pid") != after.get("pid"):
                continue
            g = growth.setdefault(name, {})
            for r in RESOURCES:
                if r in before and r in after:
                    g[r] = g.get(r, 0.0) + float(after[r]) - float(before[r])
    return growth, unread


def _numbers(d: Mapping[str, Any]) -> list[Figure | Table]:
    rows = tuple(
        (c["cycle"], name, *(c["growth"].get(name, {}).get(r) for r in RESOURCES), c.get("seconds"))
        for c in d.get("cycles", [])
        for name in sorted(c.get("growth", {}))
    )
    steps = tuple(
        (
            c["cycle"],
            s["restarted"],
            s.get("ready_s"),
            s.get("pd_back_s"),
            s.get("parity"),
            s.get("kv_digest"),
        )
        for c in d.get("cycles", [])
        for s in c.get("steps", [])
    )
    means = [
        Figure(f"{name} {r} per cycle", round(v, 3), UNITS[r])
        for name, per in sorted((d.get("mean_growth") or {}).items())
        for r, v in per.items()
    ]
    return [
        Figure("cycles", len(d.get("cycles", []))),
        *means,
        Table(
            "growth per cycle, of each process while it stayed the same",
            ("cycle", "process", "fds", "threads", "rss (MiB)", "KV blocks", "cycle (s)"),
            rows,
        ),
        Table(
            "restarts in place",
            ("cycle", "restarted", "ready (s)", "P/D correct (s)", "parity", "kv_digest"),
            steps,
        ),
    ]


def _figures(name: str, r: str, cycles: Sequence[Mapping[str, Any]]) -> str:
    per = [c["growth"].get(name, {}).get(r) for c in cycles]
    return ", ".join("-" if v is None else f"{v:+g}" for v in per)


@reporting(_numbers)
def evaluate(
    cycles: Sequence[Mapping[str, Any]], *, planned: int, limits: Mapping[str, float]
) -> CheckResult:
    """The verdict over the cycles that ran. Each cycle: {"cycle": k, "growth": process -> resource ->
    growth, "unreadable": [why], "steps": [{"restarted", "error", "parity", "parity_message",
    "kv_digest", "kv_digest_message", ...}], "seconds"}.

    an instance that outlived its SIGKILL (nothing restarted)     -> NOT RUN "invalid", naming it
    a restart that failed (did not start, P/D not back correct)  -> FAIL, naming cycle and instance
    parity or kv_digest FAIL after a restart                      -> FAIL, naming cycle, restart, why
    fewer cycles than planned (no failure said why)               -> FAIL
    a resource's mean growth per cycle above its bound            -> FAIL, naming the process, the
                                                                     resource, every cycle's figure
    a figure unreadable, or parity / kv_digest NOT RUN            -> NOT RUN, with the reasons
    otherwise                                                     -> PASS
    """
    mean: dict[str, dict[str, float]] = {}
    for c in cycles:
        for name, per in c["growth"].items():
            for r, v in per.items():
                mean.setdefault(name, {})[r] = mean.get(name, {}).get(r, 0.0) + v / max(len(cycles), 1)
    d: dict[str, Any] = {
        "planned_cycles": planned,
        "cycles": [dict(c) for c in cycles],
        "bounds_per_cycle": dict(limits),
        "mean_growth": {n: {r: round(v, 3) for r, v in per.items()} for n, per in mean.items()},
    }
    undead = [
        f"cycle {c['cycle']}: {s['restarted']} {s['undead']}"
        for c in cycles
        for s in c["steps"]
        if s.get("undead")
    ]
    if undead:  # no restart happened: nothing about restarts was seen (scenario.killed_undead's rule)
        return unrun(NAME, "invalid: " + "; ".join(undead), d)
    failed = _broken_steps(cycles)
    exceeded = [(name, r, v) for name, per in sorted(mean.items()) for r, v in per.items() if v > limits[r]]
    over = [
        f"{name} {r} grew {v:+.3g}{UNITS[r]} per cycle (bound {limits[r]:g}; "
        f"per cycle: {_figures(name, r, cycles)})"
        for name, r, v in exceeded
    ]
    # what failed, for the known-issues registry's conditions: the steps, and which resources of
    # which roles grew beyond their bounds ("decode-0" -> "decode")
    d["broken_steps"] = failed
    d["over_resources"] = sorted({r for _, r, _ in exceeded})
    d["over_roles"] = sorted({name.rsplit("-", 1)[0] for name, _, _ in exceeded})
    if len(cycles) < planned and not failed:
        failed.append(f"{len(cycles)} of {planned} cycles ran")
    if failed or over:
        return CheckResult(NAME, FAIL, "; ".join(failed + over), d)
    unread = [f"cycle {c['cycle']}: {why}" for c in cycles for why in c.get("unreadable", [])]
    unread += [
        f"cycle {c['cycle']}: {check} after {s['restarted']}'s restart NOT RUN: {s.get(f'{check}_message')}"
        for c in cycles
        for s in c["steps"]
        for check in ("parity", "kv_digest")
        if s.get(check) == NOT_RUN
    ]
    if unread:
        return unrun(NAME, "a figure could not be read: " + "; ".join(unread), d)
    worst = ", ".join(
        f"{r} {max((per.get(r, 0.0) for per in mean.values()), default=0.0):+.3g}{UNITS[r]}"
        for r in RESOURCES
    )
    return CheckResult(
        NAME,
        PASS,
        f"{len(cycles)} cycles of restarts in place ({', '.join(s['restarted'] for s in cycles[0]['steps'])} "
        f"each), parity and kv_digest passed after every restart; largest growth per cycle: {worst} "
        f"(bounds: {', '.join(f'{r} {v:g}' for r, v in limits.items())})",
        d,
    )


def _broken_steps(cycles: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for c in cycles:
        for s in c["steps"]:
            where = f"cycle {c['cycle']}: {s['restarted']}"
            if s.get("error"):
                out.append(f"{where}: {s['error']}")
            for check in ("parity", "kv_digest"):
                if s.get(check) == FAIL:
                    out.append(f"{where} restarted, then {check} FAIL: {s.get(f'{check}_message')}")
    return out


# ------------------------------------------------------------ gathering


def read_all(window: CheckWindow) -> dict[str, dict[str, Any]]:
    """Every process pd-sessions started (each live instance and the router), read once the
    instances hold no request (or SETTLE_S passed): its tree's usage and, of an instance, the KV
    blocks in use."""
    cluster = window.cluster
    metrics = _settled(window)
    out: dict[str, dict[str, Any]] = {}
    for r in cluster.processes:
        read: dict[str, Any] = {"pid": r.pid}
        try:
            read.update(tree_usage(r).as_dict())
        except Unreadable as e:
            read["unreadable"] = f"fds/threads/RSS of {r.name}: {e}"
        if r.name != "router":
            got = metrics.get(r.name)
            if isinstance(got, str):
                read["unreadable"] = f"KV blocks of {r.name}: {got}"
            elif got is not None:
                read[KV_BLOCKS] = got
        out[r.name] = read
    return out


def _settled(window: CheckWindow) -> dict[str, float | str]:
    """instance -> KV blocks in use, once none runs or waits for a request (or SETTLE_S passed:
    then what is seen), or why it could not be read."""
    t0 = time.monotonic()
    while True:
        seen: dict[str, float | str] = {}
        busy = False
        for s in window.plan.instances:
            if s.name in window.cluster.down:
                continue
            try:
                st = state(http.get_text(f"{s.url}/metrics", timeout=5.0))
            except http.HttpError as e:
                seen[s.name] = f"/metrics: {e.reason}"
                continue
            busy = busy or st.get(RUNNING, 0.0) > 0 or st.get(WAITING, 0.0) > 0 or st.get(BLOCKS, 0.0) > 0
            seen[s.name] = st.get(BLOCKS, f"num_gpu_blocks of {CACHE_INFO} not exposed")
        if not busy or time.monotonic() - t0 > SETTLE_S:
            return seen
        time.sleep(0.2)


def restart_step(window: CheckWindow, s: Scenario, name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Restart ``name`` in place, wait until P/D answers correctly, then parity and the digest."""
    cluster = window.cluster
    step: dict[str, Any] = {"restarted": name, "error": None}
    t0 = time.monotonic()
    try:
        cluster.kill_instance(name)
        cluster.restart_instance(name, deadline_s=float(options["deadline_s"]))
    except (ReadinessTimeout, ProcessExited) as e:
        step["error"] = f"did not start again in place: {e}"
        return step
    except StopError as e:  # a process of the killed one outlived its SIGKILL: nothing was started
        step["error"] = step["undead"] = f"not restarted: the SIGKILL did not end it: {e}"
        return step
    step["ready_s"] = round(time.monotonic() - t0, 3)
    tried: list[str] = []
    while time.monotonic() - t0 - step["ready_s"] < float(options["bound_s"]):
        a = s.ask(
            window.plan.router.url, f"Soak ({name}, {len(tried)}): the miller said", max_tokens=MAX_TOKENS
        )
        o = s.judged(a, reference=window.plan.prefill[0], max_tokens=MAX_TOKENS, bound_s=REQUEST_BOUND_S)
        tried.append(o.kind + (f" (HTTP {o.status})" if o.status else ""))
        if o.kind == CORRECT:
            step["pd_back_s"] = round(time.monotonic() - t0, 3)
            break
        if o.kind not in KEPT:  # wrong, hung or broken: no retry undoes it
            break
        time.sleep(0.5)
    step["requests"] = tried
    if "pd_back_s" not in step:
        step["error"] = (
            f"ready again after {step['ready_s']:.1f} s, but no request through the router was correct "
            f"within {float(options['bound_s']):g} s (requests: {', '.join(tried) or 'none'})"
        )
        return step
    for check, gather in (("parity", parity.run), ("kv_digest", kv_digest.run)):
        try:
            r = gather(window, {})
            step[check], step[f"{check}_message"] = r.verdict, r.message
        except (http.HttpError, ValueError) as e:
            step[check], step[f"{check}_message"] = FAIL, f"could not run: {e}"
    return step


def restarts_known_broken(window: CheckWindow) -> CheckResult | None:
    """NOT RUN where restart in place is a known upstream bug in range here (the entry whose
    reproducer is fault_restart: router-stale-mooncake-engine-id over Mooncake), citing it."""
    plan = window.plan
    hits = known_issues.every_applicable(
        known_issues.load(),
        "fault_restart",
        connector=plan.config.connector,
        platform=plan.platform,
        versions=component_versions(),
    )
    if not hits:
        return None
    issue, installed = hits[0]
    return unrun(
        NAME,
        f"restart in place over {plan.config.connector} is a known upstream bug here ({issue.id}, "
        f"{issue.component} {installed or 'version unknown'}: {issue.link}): P/D does not answer again "
        "after a restart, so no cycle could be judged; run the soak over another connector (nox -s soak "
        f"runs {connectors.SOAK.title})",
        {"known_issue_id": issue.id, "link": issue.link},
    )


def restart_order(plan: ClusterPlan) -> list[ProcessSpec]:
    """The instances a cycle restarts, one after the other: every prefill, then every decode."""
    return [*plan.prefill, *plan.decode]


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    plan = window.plan
    refused = restarts_known_broken(window)
    if refused is not None:
        return refused
    s = Scenario(window, NAME, injector=False)
    limits = bounds(options)
    planned = int(options["cycles"])
    cycles: list[dict[str, Any]] = []
    last: Sample = read_all(window)
    for k in range(1, planned + 1):
        t0 = time.monotonic()
        samples: list[Sample] = [last]
        steps = []
        for spec in restart_order(plan):
            steps.append(restart_step(window, s, spec.name, options))
            if steps[-1]["error"]:
                break
            samples.append(read_all(window))
        growth, unread = cycle_growth(samples)
        cycles.append(
            {
                "cycle": k,
                "growth": {n: {r: round(v, 3) for r, v in g.items()} for n, g in growth.items()},
                "unreadable": unread,
                "steps": steps,
                "reads": samples,
                "seconds": round(time.monotonic() - t0, 3),
            }
        )
        last = samples[-1]
        if any(st["error"] for st in steps):
            break
    return evaluate(cycles, planned=planned, limits=limits)
