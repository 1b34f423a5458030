"""Verdicts a CI run prints at its end, under "judged in this run" (conftest's
pytest_terminal_summary), so that its log shows them even when their tests pass: e.g. the perf
check of the shared NIXL sweep, with the baseline it was compared against."""

from __future__ import annotations

import pytest

LINES = pytest.StashKey[list[str]]()


def add(config: pytest.Config, line: str) -> None:
    """One line for the end of the run (each shared run's test adds its own once)."""
    config.stash.setdefault(LINES, []).append(line)
