"""``pd-sessions buildkite``: render .buildkite/ from the job registry (report/buildkite_pipelines.py)."""

from __future__ import annotations

import argparse

from pd_sessions.report import buildkite_pipelines


def run(args: argparse.Namespace) -> int:
    for rel in buildkite_pipelines.write():
        print(f"wrote {rel}")
    return 0
