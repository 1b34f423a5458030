"""Command line: ``pd-sessions <command>`` (or ``python -m pd_sessions <command>``), the one way in.

Commands: sweep, serve, tiny-model, inventory, bench, bench-report, wheelhouse, buildkite, report; this
module parses them and maps what they end with to an exit status, and each one lives in its own
module in :mod:`pd_sessions.commands`. The other ``python -m pd_sessions.X`` entries are process
boundaries (envfacts, canary, the lifeline reaper, the bench's fake servers); each module's
docstring says why. Only the entry points print (this module, the command modules,
pd_sessions.runtime.console, and the modules a command hands its command line to).

Exit status: 0 all passed; 1 a config failed; 2 bad config or arguments
(nothing launched); 128+N when stopped by signal N (teardown still ran).
`serve` exits 0 when stopped by Ctrl-C or SIGTERM (its normal end) and 1 when a server died.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

# Only modules that import with the standard library alone at the top, so that `--help` (and each
# subcommand's) works on a bare interpreter (tests/test_bare_imports.py); each command's module,
# and what it needs, is imported only when that command runs (_command).
from pd_sessions import __version__
from pd_sessions.core.cliargs import SWEEP_HELP, add_common_options, add_sweep_options
from pd_sessions.runtime.console import install_signal_handlers, run_command


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-sessions", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)

    # The options live in cliargs (standard library only): the noxfile parses posargs with them.
    s = sub.add_parser("sweep", help="run (or --dry-run) a sweep of P/D clusters")
    s.add_argument("sweep", help=SWEEP_HELP)
    add_sweep_options(s)

    v = sub.add_parser(
        "serve", help="start one config, print how to reach it, and keep it up until Ctrl-C or SIGTERM"
    )
    v.add_argument("sweep", help=SWEEP_HELP)
    add_common_options(v)

    t = sub.add_parser("tiny-model", help="generate (once) the tiny model and print its path")
    t.add_argument("--cache-dir", type=Path, default=None)

    sub.add_parser("inventory", help="print the detected host inventory as JSON")

    _passthrough(
        sub,
        "bench",
        "measure the harness's overhead next to what users run today; writes bench/ "
        "(pd-sessions bench --help lists its options)",
    )
    r = sub.add_parser(
        "bench-report", help="render bench results (table, goals, chart) again from results.json"
    )
    r.add_argument("results_json", type=Path, metavar="RESULTS_JSON", help="e.g. bench/results.json")
    _passthrough(
        sub,
        "wheelhouse",
        "download every wheel a session needs, for an offline host (pd-sessions wheelhouse --help)",
    )
    sub.add_parser(
        "buildkite",
        help="render .buildkite/ from the job registry in pd_sessions/report/buildkite_pipelines.py",
    )
    rep = sub.add_parser(
        "report",
        help="render DIR/report.html again from a sweep's result files (summary.json, */result.json)",
    )
    rep.add_argument("results_dir", type=Path, metavar="DIR", help="a results directory a sweep wrote")
    return p


def _passthrough(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str) -> None:
    """A subcommand whose own parser lives in its module, imported only when it runs (so that
    `pd-sessions --help` needs none of its dependencies): everything after its name is handed
    over as is. argparse takes no option here: no argument starts with the NUL prefix char."""
    s = sub.add_parser(name, help=help, add_help=False, prefix_chars="\0")
    s.add_argument("rest", nargs=argparse.REMAINDER)


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    """The subcommand's ``run``, its module imported only now: `--help` needs none of them."""
    if name == "sweep":
        from pd_sessions.commands.sweep import run
    elif name == "serve":
        from pd_sessions.commands.serve import run
    elif name == "tiny-model":
        from pd_sessions.commands.tiny_model import run
    elif name == "inventory":
        from pd_sessions.commands.inventory import run
    elif name == "bench":
        from pd_sessions.commands.bench import run
    elif name == "bench-report":
        from pd_sessions.commands.bench_report import run
    elif name == "wheelhouse":
        from pd_sessions.commands.wheelhouse import run
    elif name == "buildkite":
        from pd_sessions.commands.buildkite import run
    elif name == "report":
        from pd_sessions.commands.report import run
    else:  # argparse lets only the names above through
        raise ValueError(f"no module for the command {name!r}")
    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    install_signal_handlers()
    return run_command(lambda: _command(args.command)(args), prog="pd-sessions")
