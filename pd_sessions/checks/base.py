from __future__ import annotations

import traceback
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
