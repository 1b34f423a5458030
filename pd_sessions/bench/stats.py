"""Pure arithmetic of the benchmark: summaries, percentiles, overhead, goal verdicts."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def summary(values: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """Median and spread (min, max, and every sample) of ``values``; empty -> n = 0."""
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0, "median": None, "min": None, "max": None, "values": []}
    return {
        "n": len(vals),
        "median": round(statistics.median(vals), digits),
        "min": round(min(vals), digits),
        "max": round(max(vals), digits),
        "values": [round(v, digits) for v in vals],
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    vals = sorted(values)
    pos = (len(vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def overhead(
    wall_s: float,
    own_startup_s: Mapping[str, float],
    checks_s: float,
    phases: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Harness overhead of one config run.

        overhead = wall time - slowest instance's own startup - check time

    An instance's own startup is spawn -> its /health first answered 200 (seen by an
    independent prober), so what is left is what the driver added: planning, noticing
    readiness late, getting the router ready, waiting, tearing down. With ``phases``
    (prepare, instances, router, teardown seconds) it is split into those parts:
    ``noticing`` = instances phase - slowest own startup; ``other`` = the rest.
    """
    if not own_startup_s:
        raise ValueError("no instance startup measured")
    slowest = max(own_startup_s.values())
    over = wall_s - slowest - checks_s
    out = {
        "wall_s": wall_s,
        "slowest_startup_s": slowest,
        "checks_s": checks_s,
        "overhead_s": over,
        "overhead_fraction": over / wall_s if wall_s > 0 else 0.0,
    }
    if phases is not None:
        parts = {
            "prepare": phases.get("prepare", 0.0),
            "noticing": phases.get("instances", slowest) - slowest,
            "router": phases.get("router", 0.0),
            "teardown": phases.get("teardown", 0.0),
        }
        parts["other"] = over - sum(parts.values())
        out.update({f"{k}_s": v for k, v in parts.items()})
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


@dataclass(frozen=True)
class Goal:
    """One goal of the benchmark: ``measured`` (a median) compared with ``limit``."""

    name: str
    limit: float
    unit: str
    measured: float | None
    meaning: str

    @property
    def met(self) -> bool | None:
        return None if self.measured is None else self.measured <= self.limit

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "limit": self.limit,
            "unit": self.unit,
            "measured": None if self.measured is None else round(self.measured, 4),
            "met": self.met,
            "meaning": self.meaning,
        }
