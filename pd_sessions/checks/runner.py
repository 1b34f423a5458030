"""Runs every selected check against a ready cluster, in the registry's order, from one table
of gatherers (``GATHERERS``: check name -> its module's ``run(window, options)``).

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

Results are appended to ``results`` as they come, so a run cut short by a
dying process still reports the checks that finished.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pd_sessions.checks import (
    abort_frees_kv,
    burst,
    cache_paths,
    kv_transfer,
    parity,
    perf,
    preemption,
    request_features,
    smoke,
    too_long,
)
from pd_sessions.checks import accuracy as acc
from pd_sessions.checks.faults import corrupt, drop, peer_death, restart, stall_abort, wire_scenarios
from pd_sessions.checks.instances import REQUEST_TIMEOUT_S
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import check_registry as registry
from pd_sessions.core.results import CheckResult
from pd_sessions.runtime.cluster import Cluster

Gatherer = Callable[[CheckWindow, Mapping[str, Any]], CheckResult]

# Every registered check's gatherer (a test keeps these names equal to the registry's).
GATHERERS: dict[str, Gatherer] = {
    "smoke": smoke.run,
    "parity": parity.run,
    "kv_transfer": kv_transfer.run,
    "request_features": request_features.run,
    "cache_paths": cache_paths.run,
    "too_long": too_long.run,
    "burst": burst.run,
    "abort_frees_kv": abort_frees_kv.run,
    "accuracy": acc.run,
    "preemption": preemption.run,
    "perf": perf.run,
    "fault_drop": drop.run,
    "fault_zero": corrupt.run_zero,
    "fault_swap": corrupt.run_swap,
    "fault_stall_abort": stall_abort.run,
    "fault_peer_death": peer_death.run,
    "fault_restart": restart.run,
    "wire_loss": wire_scenarios.run_loss,
    "wire_partition": wire_scenarios.run_partition,
    "wire_cap": wire_scenarios.run_cap,
    "wire_delay": wire_scenarios.run_delay,
}

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
    for info in registry.CHECKS:
        if info.name not in wanted:
            continue
        opts = {**info.options, **given.get(info.name, {})}
        gather = GATHERERS[info.name]
        window.timed(info.name, lambda: gather(window, opts))  # noqa: B023 (timed calls it at once)
