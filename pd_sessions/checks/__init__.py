"""Checks run against a ready cluster. Each module has a pure ``evaluate()``
(inputs -> CheckResult) and a thin gatherer ``run(window, options)`` that makes the requests;
the runner runs them from one table, in the registry's order, around one check window.

A check that cannot run fails with its reason: there are no silent skips.
"""

from pd_sessions.core.results import CheckResult

__all__ = ["CheckResult"]
