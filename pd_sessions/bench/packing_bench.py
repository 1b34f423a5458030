"""The packing part: the GPU sweep's default configs on a fake 8-GPU host, side by side (the
default) and one after another (--max-parallel 1), through pd_sessions' own sweep (run_sweep).

vLLM and the router are the fake stack (pd_sessions/data/fake_stack, shipped with the package and
shared with the project's tests: a throwaway server with a grandchild "engine core"), each instance
listening ``startup_s`` after its spawn (a model loading) and, on SIGTERM, stopping its engine core
at once and exiting ``exit_s`` later (vLLM's API server after its engine core). What is measured is
the harness's packing and its overlapped teardown, not vLLM; an installed package is enough.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pd_sessions
from pd_sessions.bench.stats import summary
from pd_sessions.core import connectors
from pd_sessions.core.config import load, select
from pd_sessions.core.errors import BenchError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan.packing import need, pack
from pd_sessions.core.results import PASSED
from pd_sessions.run.sweep import run_sweep
from pd_sessions.run.sweep_options import SweepOptions

log = logging.getLogger(__name__)

GPUS = tuple(str(i) for i in range(8))
FAKE_STACK = Path(pd_sessions.__file__).resolve().parent / "data" / "fake_stack"
RATIO_GOAL = 0.6
SWEEP = connectors.DEFAULT.sweep  # the GPU sweep whose default configs are packed
CHECKS = ("smoke",)


@contextlib.contextmanager
def _fake_stack(startup_s: float, exit_s: float) -> Iterator[None]:
    """The fake stack first on the children's PYTHONPATH (the cluster starts its processes with
    this process's environment), and its timings; the environment restored after."""
    if not (FAKE_STACK / "fake_server.py").exists():
        raise BenchError(
            f"the packing part needs the fake stack shipped with pd_sessions ({FAKE_STACK} is missing): "
            "reinstall the package (its package data includes data/fake_stack)"
        )
    root = str(FAKE_STACK.parents[2])  # where pd_sessions is imported from (the children import it)
    new = {
        "PYTHONPATH": os.pathsep.join([str(FAKE_STACK), root]),
        "FAKE_STARTUP_S": f"{startup_s:g}",
        "FAKE_EXIT_S": f"{exit_s:g}",
    }
    old = {k: os.environ.get(k) for k in new}
    os.environ.update(new)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(
    log_dir: Path,
    *,
    repeats: int,
    progress: Callable[[str], None],
    startup_s: float = 4.0,
    exit_s: float = 1.5,
    grace_s: float = 5.0,
) -> dict[str, Any]:
    """``repeats`` x (the sweep packed, the sweep one config at a time), alternating which goes
    first; the walls, their ratio and whether every config passed."""
    sweep = load(SWEEP)
    # over TCP: the fake host has no RDMA device (the plan is all that reads it)
    configs = [replace(e.config, mooncake_protocol="tcp") for e in select(sweep.entries("cuda"), "cuda")[0]]
    inv = Inventory(
        gpus=GPUS, cpus=tuple(sorted(os.sched_getaffinity(0))), gpu_source="the bench's fake 8-GPU host"
    )
    packing = pack(configs, inv, platform="cuda")
    walls: dict[str, list[float]] = {"packed": [], "serial": []}
    failed: list[str] = []
    quiet = lambda msg: log.info("%s", msg)
    with _fake_stack(startup_s, exit_s):
        for rep in range(repeats):
            for mode in ("packed", "serial") if rep % 2 == 0 else ("serial", "packed"):
                opts = SweepOptions(
                    platform="cuda",
                    results_dir=log_dir / f"{mode}-{rep}",
                    grace_s=grace_s,
                    selected_checks=CHECKS,
                    max_parallel=None if mode == "packed" else 1,
                )
                t0 = time.monotonic()
                results = run_sweep(configs, inv, opts, quiet)
                walls[mode].append(time.monotonic() - t0)
                failed += [f"{mode} {rep + 1}: {r.name} {r.outcome}" for r in results if r.outcome != PASSED]
                progress(f"packing part: {mode} sweep {rep + 1}/{repeats}: {walls[mode][-1]:.1f} s")
    ratios = [p / s for p, s in zip(walls["packed"], walls["serial"], strict=True)]
    return {
        "what": (
            f"{SWEEP}'s {len(configs)} default GPU configs on a fake 8-GPU host (fake stack: each "
            f"instance ready {startup_s:g} s after its spawn, its API server exiting {exit_s:g} s "
            f"after its engine core), checks {', '.join(CHECKS)}; packed (the default) vs "
            "--max-parallel 1, through run_sweep"
        ),
        "configs": [c.name for c in configs],
        "gpus_needed": [need(c, "cuda") for c in configs],
        "waves": packing.render(),
        "packed_s": summary(walls["packed"]),
        "serial_s": summary(walls["serial"]),
        "ratio": summary(ratios),
        "failed": failed,
        "ok": not failed,
    }


def markdown(pk: dict[str, Any] | None) -> list[str]:
    if not pk:
        return []

    def fmt(s: dict[str, Any], digits: int = 1) -> str:
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"

    return [
        "## Packing: configs side by side (fake 8-GPU host)",
        "",
        f"{pk['what']}. GPUs each config needs: "
        + ", ".join(f"{c} {n}" for c, n in zip(pk["configs"], pk["gpus_needed"], strict=True))
        + ".",
        "",
        "```",
        pk["waves"],
        "```",
        "",
        f"- sweep wall, packed: {fmt(pk['packed_s'])} s; one after another: {fmt(pk['serial_s'])} s",
        f"- packed / serial: **{fmt(pk['ratio'], 2)}** (goal <= {RATIO_GOAL:g})",
        *([f"- not passed: {', '.join(pk['failed'])}"] if pk["failed"] else []),
        "",
    ]
