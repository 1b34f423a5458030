"""``pd-sessions recall``: the recall table (core/recall_table.py) of every bug class of the
catalogue (configs/bug_catalogue.toml), over Mooncake and NIXL on the CPU lane.

Without ``--results`` it runs the sweeps that inject every class, one after the other, each a
``pd-sessions sweep`` of its own under ``OUT/<name>`` (:data:`SWEEPS`): the fault scenarios
(`faults`: both connectors), the faulty decode (`recall_decode`: other weights, silent
recompute) and the wire faults across two simulated hosts per connector (``--no-hosts`` leaves
them out: their classes then read NOT RUN). With ``--results DIR ...`` it runs nothing and builds
the table from the result.json files below those folders (earlier runs of any of these sweeps,
CI's shared runs). Either way it prints the table, writes ``OUT/recall.json`` and
``OUT/recall.md``, and exits 0 at 100 % recall on every connector, 1 below.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from pd_sessions.core import bug_catalogue, connectors, recall_table
from pd_sessions.core.errors import UsageError
from pd_sessions.runtime import parentwatch, process
from pd_sessions.runtime.console import say

# The wire faults selected on a rehearsal (no default check: only what the wire classes need).
WIRE_CHECKS = '["smoke", "wire_loss", "wire_partition", "wire_cap"]'
# Per connector, what its wire rehearsal adds: Mooncake's wire_loss at 2 % only, as CI: at 20 %
# its pull sometimes waits out Mooncake's 30 s TCP give-up (docs/failure-modes.md, row 50).
WIRE_EXTRA = {connectors.MOONCAKE.name: ("--set", "check_options.wire_loss.rates=[2]")}
# The sweeps that inject every class: name -> the `pd-sessions sweep` arguments; each recalled
# connector's wire rehearsal is "hosts_<connector>".
HOSTS = tuple(f"hosts_{c.name}" for c in connectors.RECALL)
# What the faults sweep does not list but the catalogue needs: fault_strand (opt-in: caught by the
# conservation invariant, which faults.toml does not list either) and kv_digest (the second
# detector of another-requests-answer; a CPU-lane default, but a sweep that lists its checks
# runs only those). A `nox -s recall` without them read kv-stranded-after-abort NOT RUN
# (2026-12-05).
FAULTS_EXTRA = ("fault_strand", "conservation", "kv_digest")
SWEEPS: dict[str, tuple[str, ...]] = {
    "faults": ("faults", "--check", ",".join(FAULTS_EXTRA)),
    "decode": ("recall_decode",),
    **{
        f"hosts_{c.name}": (
            c.sweep, "--only", "1x1", "--simulate-hosts", "2", "--set", f"checks={WIRE_CHECKS}",
            *WIRE_EXTRA.get(c.name, ()),
        )
        for c in connectors.RECALL
    },
}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pd-sessions recall",
        description="the recall table of every injected bug class (configs/bug_catalogue.toml)",
    )
    p.add_argument(
        "--results",
        nargs="+",
        type=Path,
        default=None,
        metavar="DIR",
        help="build the table from the result.json files below these folders (earlier runs); run nothing",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="where recall.json and recall.md (and the sweeps' results) go"
    )
    p.add_argument("--platform", default="cpu", choices=("cpu", "cuda"), help="the sweeps' platform")
    p.add_argument(
        "--no-hosts",
        action="store_true",
        help="leave out the wire faults across simulated hosts (their classes read NOT RUN)",
    )
    return p


def read_results(dirs: Iterable[Path]) -> list[recall_table.Result]:
    """Every config's result.json below ``dirs``; a folder that does not exist is a UsageError."""
    out = []
    for d in dirs:
        if not d.is_dir():
            raise UsageError(f"--results: {d} is not a folder; give a sweep's results folder")
        for path in sorted(d.rglob("result.json")):
            out.append(recall_table.Result(str(path), json.loads(path.read_text())))
    return out


def write(table: recall_table.RecallTable, out: Path) -> list[Path]:
    """recall.json and recall.md in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "recall.json", out / "recall.md"]
    written[0].write_text(json.dumps(table.to_dict(), indent=2) + "\n")
    written[1].write_text(table.markdown())
    return written


def sweep_argv(name: str, out: Path, platform: str) -> list[str]:
    """The command line of one of :data:`SWEEPS`, its results under ``out/name``."""
    args = SWEEPS[name]
    return [sys.executable, "-m", "pd_sessions", "sweep", *args, "--platform", platform,
            "--results-dir", str(out / name)]  # fmt: skip


# How long a stopped sweep has for its own teardown (its clusters stopped, each within its own
# grace) before what is left of it gets SIGKILL.
SWEEP_GRACE_S = 120.0


def run_sweep(
    argv: Sequence[str], *, grace_s: float = SWEEP_GRACE_S, kill_wait_s: float = process.KILL_WAIT_S
) -> int:
    """One sweep, in a session of its own, waited for. Stopped (Ctrl-C, SIGTERM: the CLI's
    exceptions), its group and everything it started get SIGTERM (its own teardown), ``grace_s``
    to end, then SIGKILL, every process verified gone within ``kill_wait_s`` (StopError names a
    survivor) before the stop goes on (runtime/process.py's stop_leaders). The sweep also gets
    SIGTERM if this process dies (parentwatch)."""
    child: subprocess.Popen[bytes] | None = None
    try:
        with process.signals_deferred():  # a stop before the leader is recorded waits, then stops it
            child = subprocess.Popen(
                list(argv), start_new_session=True, preexec_fn=parentwatch.child_preexec()
            )
            leader = process.Leader("sweep", child.pid, process.start_ticks(child.pid))
        return child.wait()
    except BaseException:
        if child is None:
            raise
        with process.signals_deferred():
            try:
                process.stop_leaders([leader], grace_s=grace_s, kill_wait_s=kill_wait_s)
            finally:
                child.poll()  # reap it
        raise


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    catalogue = bug_catalogue.load()
    if args.results:
        dirs = list(args.results)
        out = args.out or dirs[0]
    else:
        out = args.out or Path("results") / f"recall-{time.strftime('%Y%m%d-%H%M%S')}"
        names = [n for n in SWEEPS if not (args.no_hosts and n in HOSTS)]
        for name in names:
            argv_ = sweep_argv(name, out, args.platform)
            say(f"recall: {name}: {' '.join(argv_[1:])}")
            say(f"recall: {name} exited {run_sweep(argv_)}")
        dirs = [out / n for n in names if (out / n).is_dir()]
    table = recall_table.build(catalogue, read_results(dirs))
    for line in table.lines():
        print(line)
    for path in write(table, out):
        say(f"recall: wrote {path}")
    return 0 if table.ok else 1
