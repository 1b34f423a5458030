"""Command line: ``pd-sessions <command>`` (or ``python -m pd_sessions <command>``), the one way in.

Commands: sweep, serve, soak, tiny-model, inventory, bench, bench-report, perf-baseline, wheelhouse,
recall, buildkite, report; this
module parses them, calls the function that does each one's work (:data:`COMMANDS`: ``sweep`` and
``serve`` are :mod:`pd_sessions.run.sweep` and :mod:`pd_sessions.run.serve`) and maps what they
end with to an exit status. The other ``python -m pd_sessions.X`` entries are process boundaries
(envfacts, canary, the lifeline reaper, the bench's fake servers); each module's docstring says
why. Only the entry points print (this module, run/sweep.py and run/serve.py,
pd_sessions.runtime.console, and the modules a command hands its command line to).

Exit status: 0 all passed; 1 a config failed; 2 bad config or arguments
(nothing launched); 128+N when stopped by signal N (teardown still ran).
`serve` exits 0 when stopped by Ctrl-C or SIGTERM (its normal end) and 1 when a server died.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

# Only modules that import with the standard library alone at the top, so that `--help` (and each
# subcommand's) works on a bare interpreter (tests/test_bare_imports.py); each command's module,
# and what it needs, is imported only when that command runs (_command).
from pd_sessions import __version__
from pd_sessions.core.cliargs import SWEEP_HELP, add_common_options, add_sweep_options
from pd_sessions.runtime.console import install_signal_handlers, run_command, say


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-sessions", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)

    # The options live in cliargs (standard library only): the noxfile parses posargs with them.
    s = sub.add_parser("sweep", help="run (or --dry-run) a sweep of P/D clusters")
    s.add_argument("sweep", help=SWEEP_HELP)
    add_sweep_options(s)

    k = sub.add_parser(
        "soak",
        help="leaks across restarts: restart the prefill and the decode in place --cycles times, parity "
        "and the KV digest after each restart, the growth per cycle of fds, threads, RSS and KV blocks "
        "bounded (a sweep of smoke, soak and kv_digest; default the 1x1 of the built-in sweep of the "
        "connector restarts in place work over)",
    )
    k.add_argument(
        "sweep",
        nargs="?",
        default=None,
        help=SWEEP_HELP + " (default: the built-in sweep of the soak's connector, connectors.SOAK)",
    )
    k.add_argument("--cycles", type=int, default=3, metavar="N", help="restart cycles (default 3, as in CI)")
    add_sweep_options(k)

    v = sub.add_parser(
        "serve", help="start one config, print how to reach it, and keep it up until Ctrl-C or SIGTERM"
    )
    v.add_argument("sweep", help=SWEEP_HELP)
    add_common_options(v)

    t = sub.add_parser("tiny-model", help="generate (once) the tiny model and print its path")
    t.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where the models are cached (default ~/.cache/pd-sessions)",
    )

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
    r.add_argument("results_json", type=_results_json, metavar="RESULTS_JSON", help="e.g. bench/results.json")
    _passthrough(
        sub,
        "perf-baseline",
        "record a config's perf baseline from N runs of its sweep: the median and a tolerance from "
        "the spread (pd-sessions perf-baseline --help)",
    )
    _passthrough(
        sub,
        "wheelhouse",
        "download every wheel a session needs, for an offline host (pd-sessions wheelhouse --help)",
    )
    _passthrough(
        sub,
        "recall",
        "run every injected bug class of the catalogue (or read earlier results: --results DIR...) "
        "and print the recall table (pd-sessions recall --help)",
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


def _results_json(text: str) -> Path:
    """argparse type of bench-report's RESULTS_JSON: an existing file (exit 2 naming it, else)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"{path}: no such file; give the results.json a bench run wrote "
            "(pd-sessions bench --out DIR writes DIR/results.json; default bench/results.json)"
        )
    return path


def _printed(value: object) -> int:
    print(value)
    return 0


def _each_printed(values: Iterable[object]) -> int:
    for v in values:
        print(v)
    return 0


def _said(value: object) -> int:
    say(str(value))
    return 0


# What each subcommand calls: (module, the function that does the work, how the parsed command
# line reaches it and what is printed of its answer). The module is imported only when its
# command runs (_command), so that `--help` needs none of them.
Call = Callable[[Callable[..., Any], argparse.Namespace], int]
COMMANDS: dict[str, tuple[str, str, Call]] = {
    "sweep": ("pd_sessions.run.sweep", "run", lambda fn, a: fn(a)),
    "serve": ("pd_sessions.run.serve", "run", lambda fn, a: fn(a)),
    "soak": ("pd_sessions.run.soak_command", "run", lambda fn, a: fn(a)),
    "tiny-model": (
        "pd_sessions.runtime.tiny_model",
        "ensure",
        lambda fn, a: _printed(fn(cache_dir=a.cache_dir)),
    ),
    "inventory": ("pd_sessions.runtime.machine", "inventory_json", lambda fn, a: _printed(fn())),
    # passthroughs: they parse their own options
    "bench": ("pd_sessions.bench.bench_command", "main", lambda fn, a: fn(a.rest)),
    "perf-baseline": ("pd_sessions.bench.perf_baseline", "main", lambda fn, a: fn(a.rest)),
    "wheelhouse": ("pd_sessions.env.wheelhouse", "main", lambda fn, a: fn(a.rest)),
    "recall": ("pd_sessions.run.recall", "main", lambda fn, a: fn(a.rest)),
    "bench-report": (
        "pd_sessions.bench.bench_results",
        "rerender",
        lambda fn, a: _each_printed(fn(a.results_json).values()),
    ),
    "buildkite": (
        "pd_sessions.report.buildkite_pipelines",
        "write",
        lambda fn, a: _each_printed(f"wrote {rel}" for rel in fn()),
    ),
    "report": ("pd_sessions.report.html", "write", lambda fn, a: _said(f"wrote {fn(a.results_dir)}")),
}


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    """The subcommand, its module imported only now: `--help` needs none of them."""
    module, function, call = COMMANDS[name]  # argparse lets only these names through
    fn = getattr(importlib.import_module(module), function)
    return lambda args: call(fn, args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    install_signal_handlers()
    return run_command(lambda: _command(args.command)(args), prog="pd-sessions")
