from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"


def heavy(module: str):
    """Import a heavy dependency (torch, vllm...). In the full environment that
    `nox -s tests` builds (PD_SESSIONS_FULL_ENV=1) a missing one is an error, never a skip;
    elsewhere (`nox -s unit`) the test is skipped with the reason printed."""
    if os.environ.get("PD_SESSIONS_FULL_ENV") == "1":
        return __import__(module)
    return pytest.importorskip(module, reason=f"{module} not installed (run `nox -s tests`)")


@pytest.fixture
def python() -> str:
    return sys.executable
