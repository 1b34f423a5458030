"""``pd-sessions buildkite``: render .buildkite/ from the job registry (pd_sessions.report.ci_jobs)."""

from __future__ import annotations

import argparse

from pd_sessions.report import ci_jobs


def run(args: argparse.Namespace) -> int:
    for rel in ci_jobs.write():
        print(f"wrote {rel}")
    return 0
