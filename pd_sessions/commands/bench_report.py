"""``pd-sessions bench-report``: render bench results (table, goals, chart) again from results.json."""

from __future__ import annotations

import argparse

from pd_sessions.bench import bench_results as bench_report
from pd_sessions.core.errors import UsageError


def run(args: argparse.Namespace) -> int:
    if not args.results_json.is_file():
        raise UsageError(
            f"{args.results_json}: no such file; give the results.json a bench run wrote "
            "(pd-sessions bench --out DIR writes DIR/results.json; default bench/results.json)"
        )
    for path in bench_report.rerender(args.results_json).values():
        print(path)
    return 0
