"""The bench's command-line options (standard library only): ``pd-sessions bench`` parses its
command line with :func:`bench_parser`, and ``nox -s bench`` its posargs, before it installs
anything (the noxfile imports this module with nox's own interpreter)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pd_sessions.core import check_registry
from pd_sessions.core.connectors import DEFAULT, MOONCAKE, NIXL

# The first line of pd_sessions/bench/bench_command.py's docstring, as `--help` has always shown it.
DESCRIPTION = (
    "``pd-sessions bench`` (``nox -s bench``): run the benchmark and write "
    "bench/results.{json,md} + phases.png."
)
PARTS = ("router", "teardown", "clusters", "checks", "digest", "startup", "report", "multihost", "packing")
# multihost (two simulated hosts: root and the [ray] extra) runs only when --parts names it.
DEFAULT_PARTS = ("router", "teardown", "clusters", "checks", "digest", "startup", "report", "packing")
# The checks part: what each check costs over each connector (the clusters part's pd_sessions
# runs count for its own sweep, so that one is not run again).
CHECK_SWEEPS = (MOONCAKE.sweep, NIXL.sweep)


def bench_parser(prog: str = "pd-sessions bench") -> argparse.ArgumentParser:
    """The options of ``pd-sessions bench``; ``nox -s bench`` parses its posargs with it too."""
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench"),
        help="where results.json, results.md and phases.png go (logs: OUT/logs/)",
    )
    p.add_argument(
        "--sweep",
        default=DEFAULT.sweep,
        help="the sweep whose configs run: a built-in name or a .toml file",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="only these configs (default: the sweep's default ones on this lane)",
    )
    p.add_argument(
        "--platform", choices=["cpu", "cuda"], default=None, help="force a lane (default: cuda with a GPU)"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per config and driver (default 3)")
    p.add_argument(
        "--parts",
        default=",".join(DEFAULT_PARTS),
        help=f"comma-separated subset of {','.join(PARTS)} (default: all but multihost, which needs "
        "root and pip install 'pd-sessions[ray]')",
    )
    p.add_argument("--grace", type=float, default=5.0, help="SIGTERM grace at teardown, seconds (default 5)")
    p.add_argument(
        "--with-accuracy",
        action="store_true",
        help="also run the accuracy check in every cluster run (slower)",
    )
    p.add_argument(
        "--with-perf",
        action="store_true",
        help="also run the perf check in every cluster run where the sweep does not (it is opt-in "
        "on the CPU lane): the checks part then says what it costs",
    )
    _skip_check(p)
    p.add_argument(
        "--check-sweeps",
        default=",".join(CHECK_SWEEPS),
        help="checks part: the sweeps (one per connector) whose configs measure what each check "
        f"costs (default {','.join(CHECK_SWEEPS)}; --only selects the configs)",
    )
    p.add_argument(
        "--startup-session",
        default=DEFAULT.sweep,
        help="startup part: the nox session whose second-run start-up is measured, with "
        f"--only (first name given, default 1x1) and this lane's --platform (default {DEFAULT.sweep})",
    )
    p.add_argument(
        "--report-from",
        type=Path,
        default=None,
        metavar="DIR",
        help="report part: the results directory whose configs the 6-config page is built from "
        "(default: the one this bench's clusters part wrote)",
    )
    p.add_argument(
        "--router-requests", type=int, default=600, help="router part: single requests per proxy (latency)"
    )
    p.add_argument(
        "--router-concurrent-requests",
        type=int,
        default=2000,
        help="router part: requests per proxy at --concurrency (throughput)",
    )
    p.add_argument("--concurrency", type=int, default=100, help="router part: requests in flight at once")
    return p


def _skip_check(p: argparse.ArgumentParser) -> None:
    """--skip-check NAME, as the sweep's (the digest part measures with and without kv_digest)."""
    p.add_argument(
        "--skip-check",
        action="append",
        default=[],
        choices=list(check_registry.NAMES),
        metavar="NAME",
        help="leave this check out of every cluster run (as `pd-sessions sweep --skip-check`; "
        "accuracy is left out unless --with-accuracy)",
    )
