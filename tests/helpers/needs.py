"""What a test needs that the unit tier's venv does not have (vLLM, Ray, torch, a connector,
root with nftables): one rule, :func:`needs`."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from pathlib import Path
from types import ModuleType

import pytest

# `nox -s tests` sets it: the full environment, where everything a test needs is installed.
FULL_ENV = os.environ.get("PD_SESSIONS_FULL_ENV") == "1"
# `nox -s unit` sets it: the pure tier, where no test may skip (tests/conftest.py's report hook).
UNIT_TIER = os.environ.get("PD_SESSIONS_UNIT_TIER") == "1"


def needs(*modules: str, unmet: str | None = None, fix: str = "run `nox -s tests`") -> ModuleType | None:
    """Import each of ``modules`` and return the last; ``unmet``: a missing piece the caller
    found itself (None: nothing is missing). A missing piece fails the test in the full
    environment (FULL_ENV) and skips it elsewhere, the reason and ``fix`` printed."""
    got = None
    for name in modules:
        try:
            got = importlib.import_module(name)
        except ImportError as e:
            unmet = f"{name} not installed ({e})"
            break
    if unmet is not None:
        if FULL_ENV:
            pytest.fail(f"the full environment lacks {unmet}")
        pytest.skip(f"{unmet} ({fix})")
    return got


def simhosts_available() -> None:
    """Ray and what the simulated hosts need on this machine (root, ip, nft...)."""
    needs("ray")
    from pd_sessions.core import simhost_plan as core
    from pd_sessions.runtime.simhosts import facts

    lacking = core.missing(facts())
    needs(unmet=str(core.refusal(lacking)) if lacking else None, fix="the refusal says how")


def package_dir(name: str) -> Path:
    """Where the installed package ``name`` lives, found without importing it (vLLM's import
    takes seconds); :func:`needs` it."""
    found = importlib.util.find_spec(name)
    places = found.submodule_search_locations if found else None
    needs(unmet=None if places else f"{name} not installed")
    return Path(next(iter(places)))


def netns_ready() -> None:
    """Root, nft (nftables) and ip (iproute2): a throwaway network namespace with rules in it."""
    lacking = [what for what, ok in (("root", os.geteuid() == 0), ("nft", shutil.which("nft")),
               ("ip", shutil.which("ip"))) if not ok]  # fmt: skip
    needs(unmet=", ".join(lacking) or None, fix="run as root with `apt-get install nftables iproute2`")


def no_skip_in_unit_tier(report: pytest.TestReport, unit_tier: bool = UNIT_TIER) -> None:
    """In the unit tier a skipped test (not an expected failure) is reported failed, saying why:
    what needs more than the unit venv, or spawns processes, is marked procs and left out."""
    if unit_tier and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            f"skipped in the unit tier ({reason}): `nox -s unit` has no skip; mark the test procs "
            "(pyproject.toml), and `nox -s tests` runs it"
        )
