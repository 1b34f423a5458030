"""One check registry (issue 39): each check's registration (core/check_registry.py) names its
gatherer as data, (module under pd_sessions.checks, function), and checks/runner.py resolves it.
Every registered name resolves to a callable, in the registry's running order; a registration
naming a module or function that is not there fails loudly, naming the check and the fix, at the
runner's import; an import error inside a gatherer's own module is not disguised as one."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pd_sessions.checks import runner
from pd_sessions.core import check_registry as registry
from pd_sessions.core.errors import UnknownGatherer

ROOT = Path(__file__).resolve().parent.parent


def test_every_registered_gatherer_resolves_to_a_callable_in_running_order():
    assert list(runner.GATHERERS) == list(registry.NAMES)  # the registry's order, nothing else
    for info in registry.CHECKS:
        module, function = info.gatherer
        got = runner.gatherer(info)
        assert callable(got), info.name
        assert got is runner.GATHERERS[info.name]
        assert sys.modules[f"pd_sessions.checks.{module}"].__dict__[function] is got


def test_the_wire_scenarios_and_the_corruptions_resolve_to_their_own_modules():
    """Registrations that name a function other than ``run``, or a module below faults/."""
    assert registry.BY_NAME["fault_zero"].gatherer == ("faults.corrupt", "run_zero")
    assert registry.BY_NAME["wire_cap"].gatherer == ("faults.wire_cap", "run")
    assert runner.GATHERERS["wire_cap"].__name__ == "run_wire_cap"


def _bad(gatherer: tuple[str, str]) -> registry.CheckInfo:
    return dataclasses.replace(registry.BY_NAME["smoke"], name="ghost", gatherer=gatherer)


def test_a_registration_naming_a_missing_module_fails_naming_the_check_and_the_fix():
    with pytest.raises(UnknownGatherer) as e:
        runner.gatherer(_bad(("faults.nope", "run")))
    msg = str(e.value)
    assert "ghost's gatherer=('faults.nope', 'run')" in msg
    assert "no module pd_sessions.checks.faults.nope" in msg
    assert "name a module under pd_sessions/checks/" in msg
    with pytest.raises(UnknownGatherer) as e:
        runner.gatherer(_bad(("nope.deeper", "run")))
    assert "no module pd_sessions.checks.nope.deeper" in str(e.value)


@pytest.mark.parametrize("function", ["nope", "CHECK_REQUEST_TIMEOUT_S"])
def test_a_registration_naming_a_missing_or_not_callable_function_fails(function):
    with pytest.raises(UnknownGatherer) as e:
        runner.gatherer(_bad(("runner", function)))
    assert f"pd_sessions.checks.runner has no function {function!r}" in str(e.value)
    assert "ghost's gatherer" in str(e.value)


def test_an_import_error_inside_an_existing_gatherer_module_is_its_own(monkeypatch):
    """A gatherer's module that exists but lacks a dependency says so (the dependency), not
    "no module": the registration is right, the environment is not."""

    def import_module(name: str):
        raise ModuleNotFoundError("No module named 'lm_eval'", name="lm_eval")

    monkeypatch.setattr(runner.importlib, "import_module", import_module)
    with pytest.raises(ModuleNotFoundError) as e:
        runner.gatherer(registry.BY_NAME["accuracy"])
    assert e.type is ModuleNotFoundError and e.value.name == "lm_eval"


@pytest.mark.procs
def test_a_bad_registration_fails_the_runners_import():
    """Loudly and early: before any cluster starts, importing the runner raises, naming it."""
    code = (
        "import dataclasses\n"
        "from pd_sessions.core import check_registry as r\n"
        "r.CHECKS = (*r.CHECKS, dataclasses.replace(r.CHECKS[0], name='ghost', gatherer=('ghost', 'run')))\n"
        "import pd_sessions.checks.runner\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert p.returncode != 0
    assert "UnknownGatherer" in p.stderr and "ghost's gatherer=('ghost', 'run')" in p.stderr, p.stderr
