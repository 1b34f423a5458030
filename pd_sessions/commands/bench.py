"""``pd-sessions bench``: a passthrough; the bench parses its own options (bench/bench_command.py)."""

from __future__ import annotations

import argparse

from pd_sessions.bench import bench_command as bench_cli


def run(args: argparse.Namespace) -> int:
    return bench_cli.main(args.rest)
