"""Helpers the tests import (``from helpers.waiting import wait_until``); the fixtures and the
pytest hooks are in tests/conftest.py, which nothing imports. pyproject.toml puts tests/ on
sys.path (pytest's ``pythonpath``), so ``helpers`` is a plain package there.

- waiting: wait_until, wait_for_text, free_port
- needs: needs(), the rule "skip here, fail in the full environment" (`nox -s tests`)
- builders: one builder each for configs, plans, argv values, completions, ports, bench documents
- procs: throwaway processes and what is left of them
- cli_runs: the CLI (or nox) in a subprocess, its output timestamped
- fake_runs: runs on the fake stack (pd_sessions/data/fake_stack: vLLM and the router replaced by
  a throwaway OpenAI-compatible server with a grandchild "engine core")
- e2e_runs: the shared end-to-end runs on real vLLM, and the simulated hosts' rehearsals
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
USER = FIXTURES / "user_tests"
