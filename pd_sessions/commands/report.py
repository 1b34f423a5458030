"""``pd-sessions report DIR``: render DIR/report.html again from the result files in DIR."""

from __future__ import annotations

import argparse

from pd_sessions.report import html
from pd_sessions.runtime.console import say


def run(args: argparse.Namespace) -> int:
    path = html.write(args.results_dir)
    say(f"wrote {path}")
    return 0
