"""Runs every selected check against a ready cluster, in the registry's order, each through the
gatherer its registration names (core/check_registry.py: ``gatherer=(module, function)``,
resolved here into ``GATHERERS``: check name -> e.g. its module's ``run(window, options)``).

The order matters; the check window (checks/window.py) carries what the first checks share:

1. the window opens: decode /metrics (before) and the start of the KV success evidence
2. smoke: one completion through the router
3. parity: each prompt through the router, then straight to prefill-0 (exact mode), or the
   router's tokens teacher-forced through prefill-0 (margin mode; see checks/parity.py)
4. kv_transfer closes the window: decode /metrics (after; the window held only router
   requests), then a control request straight to decode-0 must leave the counter still
5. request_features (each request path users send, with per-request KV accounting of its own)
   and the edge checks (cache_paths, too_long, burst, abort_frees_kv), each with its options; they
   run after the window on purpose (they prime decode caches and send requests straight to
   instances)
6. accuracy (lm_eval through the router): on the CPU lane an offline task run through
   the router and straight to prefill-0 must give identical samples; elsewhere the
   measured value is compared with the recorded baseline
7. preemption (not a default: the preemption sweep selects it), a burst onto a decode with a
   small KV cache
8. perf (vLLM's bench serve through the router and against prefill-0, the transport alone,
   the perf baseline): after the others, so that nothing it loads the instances with disturbs
   them, and before any fault, so that it measures a whole cluster
9. the fault scenarios (checks/faults/, opt-in), last: they corrupt, stall, kill and restart;
   fault_restart leaves the cluster whole again for the user's own commands
10. conservation, when selected (a default): the runner probes the cluster after every check
   (checks/conservation.py: every instance idle, its fds, threads and RSS within bounds of their
   warm-up values), attaches the record to that check's result, and this check judges them all

Results are appended to ``results`` as they come, so a run cut short by a
dying process still reports the checks that finished.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, cast

from pd_sessions.checks import accuracy as acc
from pd_sessions.checks import conservation
from pd_sessions.checks.instances import REQUEST_TIMEOUT_S
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import check_registry as registry
from pd_sessions.core import known_issues
from pd_sessions.core.errors import UnknownGatherer
from pd_sessions.core.results import CheckResult
from pd_sessions.env.envfacts import component_versions
from pd_sessions.runtime.cluster import Cluster

Gatherer = Callable[[CheckWindow, Mapping[str, Any]], CheckResult]


def gatherer(info: registry.CheckInfo) -> Gatherer:
    """The code of ``info``'s gatherer, resolved from its registration's (module, function) under
    pd_sessions.checks. UnknownGatherer names the check, the module or function missing and the
    fix; an ImportError inside a module that exists is its own and propagates unchanged."""
    module, function = info.gatherer
    target = f"{__package__}.{module}"
    where = f"core/check_registry.py: {info.name}'s gatherer={info.gatherer!r}"
    try:
        code = importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is None or not (target == e.name or target.startswith(f"{e.name}.")):
            raise
        raise UnknownGatherer(
            f"{where}: no module {target}; name a module under pd_sessions/checks/ (dotted, "
            f"relative to pd_sessions.checks) and its run(window, options) function"
        ) from e
    found = getattr(code, function, None)
    if not callable(found):
        raise UnknownGatherer(
            f"{where}: {target} has no function {function!r}; name one of its functions that takes "
            f"(window, options) and returns a CheckResult"
        )
    return cast(Gatherer, found)


# Every registered check's gatherer, in the registry's order, resolved once (at import).
GATHERERS: dict[str, Gatherer] = {info.name: gatherer(info) for info in registry.CHECKS}

# A check request that gets no answer this long is stuck (a KV pull that never completes):
# the config fails then, naming what each instance holds, and the remaining checks do not wait.
CHECK_REQUEST_TIMEOUT_S = REQUEST_TIMEOUT_S


def run_checks(
    cluster: Cluster,
    results: list[CheckResult],
    accuracy: acc.AccuracyOptions | None = None,
    skip: tuple[str, ...] = (),
    selected: Sequence[str] = registry.DEFAULTS,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Run the ``selected`` checks in the registry's order, except those named in ``skip``
    (the caller records why). ``options``: check -> its options (registry defaults fill gaps);
    accuracy's from ``accuracy`` (the command line's)."""
    wanted = {n for n in selected if n not in skip}
    accuracy = accuracy or acc.AccuracyOptions()
    given = {
        **(options or {}),
        "accuracy": acc.as_options(accuracy),
        # --record-baseline writes the perf baseline too (the accuracy check's flow)
        "perf": {**(options or {}).get("perf", {}), "record_baseline": accuracy.record_baseline},
    }
    window = CheckWindow.open(cluster, results, timeout_s=CHECK_REQUEST_TIMEOUT_S)
    issues, versions = known_issues.load(), component_versions()

    def known(r: CheckResult) -> CheckResult:  # the checks before it in this window: an entry's `after`
        ran = {x.name for x in window.results}
        return against_known_issues(
            r, issues, connector=cluster.plan.config.connector, platform=cluster.plan.platform,
            versions=versions, ran=ran,
        )  # fmt: skip

    ledger = None
    if conservation.NAME in wanted:
        opts = {**registry.BY_NAME[conservation.NAME].options, **given.get(conservation.NAME, {})}
        ledger = conservation.Ledger.open(window, opts)
    for info in registry.CHECKS:
        if info.name not in wanted:
            continue
        opts = {**info.options, **given.get(info.name, {})}
        gather = GATHERERS[info.name]
        window.timed(info.name, lambda: gather(window, opts), judge=known)  # noqa: B023 (called at once)
        if ledger is not None and info.name in PROBED:
            ledger.after(info.name)


# The checks the conservation ledger probes after: those before conservation in the running order
# (hostile_clients, after it, judges what it leaves held itself: no probe would be judged).
PROBED = frozenset(registry.NAMES[: registry.NAMES.index(conservation.NAME)])


def against_known_issues(
    r: CheckResult,
    issues: Sequence[known_issues.KnownIssue],
    *,
    connector: str,
    platform: str,
    versions: Mapping[str, str],
    ran: Collection[str] | None = None,
) -> CheckResult:
    """``r`` judged by the known upstream bug its check reproduces here, in range (XFAIL, XPASS or
    FAIL: core/known_issues.py, judge), else ``r`` unchanged: an ordinary check. ``ran``: the
    checks before it in its window (an entry whose ``after`` did not run does not apply)."""
    hits = known_issues.every_applicable(
        issues, r.name, connector=connector, platform=platform, versions=versions, ran=ran
    )
    if not hits:
        return r
    # several entries for one check (after different checks): the one the failure matches, else
    # the first (its FAIL then says what it expected)
    return known_issues.judge(r, *next((h for h in hits if h[0].matches(r)), hits[0]))
