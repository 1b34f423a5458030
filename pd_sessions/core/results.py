from __future__ import annotations

import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PASS, FAIL = "pass", "fail"


@dataclass
class CheckResult:
    name: str  # "smoke", "parity", "kv_transfer", ...
    verdict: str  # "pass" | "fail"
    message: str  # one line a person reads first
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "verdict": self.verdict,
            "message": self.message,
            "seconds": round(self.seconds, 3),
            "details": self.details,
        }


def crashed(name: str, exc: BaseException) -> CheckResult:
    """A check that raised something unforeseen (a bug, a library's own error, not a PdError):
    it fails, naming the exception; the sweep writes the traceback to the config's checks.log,
    and the other checks still run."""
    return CheckResult(
        name,
        FAIL,
        f"crashed: {type(exc).__name__}: {exc} (traceback in checks.log)",
        {"traceback": "".join(traceback.format_exception(exc))},
    )


PASSED, FAILED, ERROR = "passed", "failed", "error"


# A config a stop cut short; one never started; one under way (only ever seen in a provisional
# summary, written as each config starts: see unfinished.py).
CANCELLED, NOT_RUN, RUNNING = "cancelled", "not run", "running"


PHASES = ("plan", "start", "router", "checks", "teardown")


@dataclass
class ConfigResult:
    name: str
    shape: str
    connector: str
    platform: str
    outcome: str = ERROR  # passed | failed | error | cancelled | not run | running
    phases: dict[str, float] = field(default_factory=dict)  # PHASES -> seconds
    checks: list[CheckResult] = field(default_factory=list)
    error: str | None = None  # what stopped the config, if anything did
    run_dir: str = ""
    warnings: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # per-process readiness etc.
    overrides: list[str] = field(default_factory=list)  # the command line's, described

    def decide(self, expected_checks: Sequence[str]) -> None:
        """passed only if no error and every expected check ran and passed."""
        ran = {c.name for c in self.checks}
        missing = [n for n in expected_checks if n not in ran]
        if self.error is None and missing:
            self.error = f"checks did not run: {', '.join(missing)}"
        if self.error is not None:
            self.outcome = ERROR
        elif all(c.passed for c in self.checks):
            self.outcome = PASSED
        else:
            self.outcome = FAILED

    @property
    def total_seconds(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": self.shape,
            "connector": self.connector,
            "platform": self.platform,
            "outcome": self.outcome,
            "error": self.error,
            "phases": {k: round(v, 3) for k, v in self.phases.items()},
            "total_seconds": round(self.total_seconds, 3),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "checks": [c.to_dict() for c in self.checks],
            "warnings": self.warnings,
            "overrides": self.overrides,
            "run_dir": self.run_dir,
        }
