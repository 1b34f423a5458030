"""``pd-sessions perf-baseline``: record a config's perf baseline from N runs of its sweep.

    pd-sessions perf-baseline --runs 5 -- nixl_sweep --only 1x1 --platform cpu \\
        --model tiny-llama-remote --set trust_remote_code=true --set 'checks=["perf"]'

runs ``pd-sessions sweep <the arguments after -->`` N times, one after the other, each with its
own ``--results-dir`` (OUT/run-<i>, its console in OUT/run-<i>.log), reads each config's perf
result, and appends one entry per key (model, connector, config, hardware class) to the perf
baselines file: the median of the runs as each figure's value, and a tolerance from their spread
(:func:`pd_sessions.checks.perf_baselines.measured_entry`: max(the figure's default, 3 x the
largest |run - median| / median)), the runs' values kept beside it. The entry's ``source`` says
when, how many runs, the command and the 1-minute load average read before and after each run.

``--from DIR ...`` reads earlier sweeps' results folders instead of running (``--note`` then says
how they were made). A run whose perf check FAILED, or that has no perf figures, is refused: a
baseline comes only from runs that measured everything. The file refuses a second entry of a key
(remove the old one first); the entry is also written to OUT/entry.toml and printed.

Exit status: 0 recorded (or printed, with --print-only); 1 a run failed or the entry could not
be written; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tomli_w

from pd_sessions.checks import perf_baselines
from pd_sessions.core.errors import ConfigError, PerfError
from pd_sessions.runtime.console import install_signal_handlers, run_command, say

Key = tuple[str, str, str, str]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pd-sessions perf-baseline",
        description="record a config's perf baseline (median, tolerance from the spread) from N sweep runs",
    )
    p.add_argument("--runs", type=int, default=perf_baselines.MIN_RUNS, help="how many sweeps (default 5)")
    p.add_argument("--out", type=Path, default=Path("perf-baseline"), help="the runs' results folders")
    p.add_argument("--from", dest="from_dirs", type=Path, action="append", default=[], metavar="DIR",
                   help="an earlier sweep's --results-dir to read instead of running (repeat)")  # fmt: skip
    p.add_argument("--note", default="", help="added to the entry's source (how --from's runs were made)")
    p.add_argument("--baselines", type=Path, default=perf_baselines.BASELINES, help="the file to append to")
    p.add_argument("--margin", type=float, default=perf_baselines.SPREAD_MARGIN,
                   help="rtol = max(default, MARGIN x largest |run - median| / median)")  # fmt: skip
    p.add_argument("--print-only", action="store_true", help="print the entry, write nothing to the file")
    p.add_argument("sweep_args", nargs=argparse.REMAINDER, help="-- then `pd-sessions sweep`'s arguments")
    return p


def perf_of(results: Path) -> dict[Key, dict[str, float]]:
    """Each config's baseline figures in one sweep's results folder, by key; PerfError naming the
    run whose perf check failed or did not measure."""
    out: dict[Key, dict[str, float]] = {}
    for path in sorted(results.glob("*/result.json")):
        checks = {c["name"]: c for c in json.loads(path.read_text()).get("checks", [])}
        perf = checks.get("perf")
        if perf is None:
            continue
        if perf["verdict"] == "fail" or not perf.get("details", {}).get("baseline_figures"):
            raise PerfError(f"{path}: perf {perf['verdict']}: {perf['message']} (whole runs only)")
        key = perf["details"]["baseline"]["key"]
        figures = perf["details"]["baseline_figures"]
        out[(key["model"], key["connector"], key["config"], key["hardware"])] = figures
    if not out:
        raise PerfError(f"{results}: no config with a perf result (does the sweep run the perf check?)")
    return out


def run_sweeps(sweep_args: Sequence[str], runs: int, out: Path) -> tuple[list[Path], list[float]]:
    """``runs`` sweeps, one after the other: (their results folders, the 1-min load averages
    read before and after each)."""
    if not sweep_args:
        raise ConfigError("perf-baseline", "no sweep given: add -- SWEEP [pd-sessions sweep options]")
    folders, loads = [], []
    out.mkdir(parents=True, exist_ok=True)
    for i in range(1, runs + 1):
        results = out / f"run-{i}"
        argv = [sys.executable, "-m", "pd_sessions", "sweep", *sweep_args, "--results-dir", str(results)]
        loads.append(os.getloadavg()[0])
        say(f"perf-baseline [{i}/{runs}]: {shlex.join(argv[2:])} (load {loads[-1]:.2f})")
        with open(out / f"run-{i}.log", "wb") as log:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        loads.append(os.getloadavg()[0])
        say(f"perf-baseline [{i}/{runs}]: exit status {rc} (load {loads[-1]:.2f}; {out / f'run-{i}.log'})")
        folders.append(results)
    return folders, loads


def entries(folders: Sequence[Path], *, margin: float, source: str) -> list[dict[str, Any]]:
    """One :func:`perf_baselines.measured_entry` per key measured in the folders."""
    by_key: dict[Key, list[dict[str, float]]] = {}
    for folder in folders:
        for key, figures in perf_of(folder).items():
            by_key.setdefault(key, []).append(figures)
    return [perf_baselines.measured_entry(k, v, source=source, margin=margin) for k, v in by_key.items()]


# Left out of the command in the entry's source: this machine's folders (the entry is kept in the
# repo), and --note (its text follows the command).
PATH_OPTIONS = ("--out", "--from", "--baselines", "--results-dir", "--note")


def without_paths(argv: Sequence[str]) -> list[str]:
    """``argv`` less the options that name this machine's folders, and --note."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in PATH_OPTIONS:
            skip = True
        elif not a.startswith(tuple(f"{o}=" for o in PATH_OPTIONS)):
            out.append(a)
    return out


def source_text(args: argparse.Namespace, n: int, loads: Sequence[float]) -> str:
    """The entry's ``source``: when, how many runs, the command, the load around them, the rule."""
    cmd = shlex.join(["pd-sessions", "perf-baseline", *without_paths(args.argv)])
    parts = [f"recorded {datetime.date.today().isoformat()} from {n} runs by: {cmd}"]
    if args.from_dirs:
        parts.append(f"read from {len(args.from_dirs)} earlier sweeps' results folders (--from)")
    if loads:
        cores = os.cpu_count()
        parts.append(f"1-min load average {min(loads):.2f}-{max(loads):.2f} around the runs ({cores} cores)")
    parts.append(
        f"value = median; rtol = max(default, {args.margin:g} x largest |run - median| / median)"
        f", better-when-higher at most {perf_baselines.HIGHER_RTOL_CAP:g}"
    )
    if args.note:
        parts.append(args.note)
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    sweep_args = args.sweep_args[1:] if args.sweep_args[:1] == ["--"] else args.sweep_args
    folders: list[Path] = list(args.from_dirs)
    loads: list[float] = []
    if not folders:
        if args.runs < perf_baselines.MIN_RUNS:
            raise ConfigError("--runs", f"got {args.runs}; allowed: at least {perf_baselines.MIN_RUNS}")
        folders, loads = run_sweeps(sweep_args, args.runs, args.out)
    made = entries(folders, margin=args.margin, source=source_text(args, len(folders), loads))
    text = tomli_w.dumps({"baseline": made})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "entry.toml").write_text(text)
    print(text)
    if args.print_only:
        say(f"perf-baseline: wrote {args.out / 'entry.toml'}; nothing written to {args.baselines}")
        return 0
    for entry in made:
        perf_baselines.record(args.baselines, entry)
        say(f"perf-baseline: recorded {entry['model']}, {entry['connector']}, {entry['config']}, "
            f"{entry['hardware']} in {args.baselines}")  # fmt: skip
    return 0


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args.argv = list(argv)  # for the entry's source
    install_signal_handlers()
    return run_command(lambda: run(args), prog="pd-sessions perf-baseline")
