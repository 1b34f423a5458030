"""Checks run against a ready cluster. Each module has a pure ``evaluate()``
(inputs -> CheckResult) and a thin gatherer that makes the requests.

A check that cannot run fails with its reason: there are no silent skips.
"""

from pd_sessions.core.results import CheckResult

__all__ = ["CheckResult"]
