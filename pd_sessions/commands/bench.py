"""``pd-sessions bench``: a passthrough; the bench parses its own options (pd_sessions.bench.cli)."""

from __future__ import annotations

import argparse

from pd_sessions.bench import cli as bench_cli


def run(args: argparse.Namespace) -> int:
    return bench_cli.main(args.rest)
