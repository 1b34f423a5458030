"""Perf baselines: what a config measured on one hardware class, and how far it may drift.

A file beside the accuracy baselines (``pd_sessions/configs/perf_baselines.toml``), one entry
per (model, connector, config, hardware class), each figure with its own tolerance::

    [[baseline]]
    model = "tiny-llama"
    connector = "nixl"
    config = "1x1"
    hardware = "cpu, 2 cores"
    source = "recorded 2026-12-01 by: pd-sessions sweep ... --record-baseline"
    [baseline.figures]
    "c1.pd.ttft_p50_ms" = { value = 41.2, rtol = 0.5, better = "lower" }

Rules (:func:`compare`):
- a figure that is better when lower regresses when measured > value * (1 + rtol); one that is
  better when higher, when measured < value * (1 - rtol); improvements never fail;
- only an entry of the same hardware class is compared (perf on an H200 says nothing about a
  2-core VM); entries of other classes are named, not judged;
- no entry: the figures are recorded in the result and nothing fails (perf is noisy); the
  sweep's ``--record-baseline`` (the accuracy check's flow) writes one.

Pure, except :func:`record` (appends to the file with a TOML writer).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_sessions.core.errors import ConfigError

BASELINES = Path(__file__).resolve().parent.parent / "configs" / "perf_baselines.toml"
BETTER = ("lower", "higher")
# Tolerances written by --record-baseline, by the figure's last part (edit them in the file).
# p99s and ITL on shared machines move a lot; the link ratio is the steadier headline.
DEFAULT_TOLERANCES: dict[str, tuple[float, str]] = {
    "ttft_p50_ms": (0.5, "lower"),
    "ttft_p99_ms": (1.0, "lower"),
    "itl_p50_ms": (0.5, "lower"),
    "itl_p99_ms": (1.0, "lower"),
    "tpot_p50_ms": (0.5, "lower"),
    "output_tok_s": (0.5, "higher"),
    "link_ratio": (0.5, "higher"),
}


@dataclass(frozen=True)
class FigureBaseline:
    value: float
    rtol: float
    better: str  # "lower" | "higher"

    def bound(self) -> float:
        """The worst value that still passes."""
        return self.value * (1 + self.rtol) if self.better == "lower" else self.value * (1 - self.rtol)

    def ok(self, measured: float) -> bool:
        return measured <= self.bound() if self.better == "lower" else measured >= self.bound()


@dataclass(frozen=True)
class PerfBaseline:
    model: str
    connector: str
    config: str
    hardware: str
    figures: Mapping[str, FigureBaseline] = field(default_factory=dict)
    source: str = ""

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.model, self.connector, self.config, self.hardware)


def hardware_class(gpu_names: Sequence[str], cores: int) -> str:
    """The hardware class a baseline is keyed by: the GPUs the cluster runs on ("1x NVIDIA
    H200"; mixed models are listed each), or "cpu, N cores" when it runs on none."""
    if not gpu_names:
        return f"cpu, {cores} cores"
    counts: dict[str, int] = {}
    for n in gpu_names:
        counts[n] = counts.get(n, 0) + 1
    return " + ".join(f"{c}x {n}" for n, c in counts.items())


def load(path: Path = BASELINES) -> list[PerfBaseline]:
    """Every entry of the file (ConfigError naming the entry and the field that is wrong)."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return []
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("perf baselines", str(e), source=str(path)) from None
    return [
        from_entry(raw, where=f"baseline #{i + 1}", source=str(path))
        for i, raw in enumerate(data.get("baseline", []))
    ]


def from_entry(raw: Mapping[str, Any], *, where: str = "baseline", source: str = "") -> PerfBaseline:
    """One entry of the file (a :func:`new_entry` dict), checked: ConfigError naming the field."""
    for key in ("model", "connector", "config", "hardware"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise ConfigError(f"{where}.{key}", "missing; allowed: a non-empty string", source=source)
    figures = {}
    for name, f in (raw.get("figures") or {}).items():
        try:
            fb = FigureBaseline(float(f["value"]), float(f.get("rtol", 0.5)), str(f.get("better", "lower")))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"{where}.figures.{name}",
                f'got {f!r}; allowed: {{ value = N, rtol = R, better = "lower"|"higher" }}',
                source=source,
            ) from None
        if fb.better not in BETTER or fb.rtol < 0:
            raise ConfigError(
                f"{where}.figures.{name}",
                f"got better={fb.better!r}, rtol={fb.rtol}; allowed: better in {BETTER}, rtol >= 0",
                source=source,
            )
        figures[name] = fb
    return PerfBaseline(
        raw["model"], raw["connector"], raw["config"], raw["hardware"], figures, raw.get("source", "")
    )


@dataclass(frozen=True)
class Comparison:
    """A run's figures against one baseline entry."""

    rows: tuple[tuple[str, float, float, float, bool], ...]  # figure, measured, baseline, bound, ok
    not_measured: tuple[str, ...]  # in the baseline, not in this run (other options)

    @property
    def regressions(self) -> list[str]:
        return [
            f"{name} {measured:.4g} vs baseline {value:.4g} (allowed {'<=' if measured > value else '>='} "
            f"{bound:.4g})"
            for name, measured, value, bound, ok in self.rows
            if not ok
        ]


def compare(measured: Mapping[str, float], baseline: PerfBaseline) -> Comparison:
    """Each figure of ``baseline`` that this run measured, judged by its own tolerance."""
    rows, missing = [], []
    for name, fb in baseline.figures.items():
        if name not in measured:
            missing.append(name)
            continue
        m = measured[name]
        rows.append((name, m, fb.value, fb.bound(), fb.ok(m)))
    return Comparison(tuple(rows), tuple(missing))


def judge(
    measured: Mapping[str, float], baselines: Sequence[PerfBaseline], key: tuple[str, str, str, str]
) -> tuple[str | None, dict[str, Any]]:
    """(regression message or None, details) of a run keyed (model, connector, config, hardware).

    an entry with the same key   -> compared: a regression beyond a tolerance is the message
    only entries of other hardware -> None; they are named in the details ("other_hardware")
    no entry                      -> None; details say how to record one
    """
    same = next((b for b in baselines if b.key == key), None)
    others = sorted(b.hardware for b in baselines if b.key[:3] == key[:3] and b.key != key)
    names = ("model", "connector", "config", "hardware")
    details: dict[str, Any] = {"key": dict(zip(names, key, strict=True))}
    if others:
        details["other_hardware"] = others
    if same is None:
        details["status"] = "no baseline for this hardware class: figures recorded, nothing judged"
        return None, details
    cmp = compare(measured, same)
    details.update(
        status="compared",
        source=same.source,
        rows=[
            {"figure": n, "measured": round(m, 6), "baseline": v, "bound": round(b, 6), "ok": ok}
            for n, m, v, b, ok in cmp.rows
        ],
        not_measured=list(cmp.not_measured),
    )
    regressions = cmp.regressions
    if regressions:
        return f"{len(regressions)} figure(s) regressed beyond tolerance: " + "; ".join(regressions), details
    return None, details


def new_entry(
    key: tuple[str, str, str, str], measured: Mapping[str, float], *, source: str
) -> dict[str, Any]:
    """The TOML entry --record-baseline writes: each measured figure with its default tolerance
    (by its last dotted part; figures without one are not baselined)."""
    figures = {}
    for name, value in sorted(measured.items()):
        tol = DEFAULT_TOLERANCES.get(name.rsplit(".", 1)[-1])
        if tol is not None:
            figures[name] = {"value": round(value, 4), "rtol": tol[0], "better": tol[1]}
    model, connector, config, hardware = key
    return {
        "model": model,
        "connector": connector,
        "config": config,
        "hardware": hardware,
        "source": source,
        "figures": figures,
    }


def record(path: Path, entry: Mapping[str, Any]) -> None:
    """Append ``entry`` (:func:`new_entry`) to the file; ConfigError if one with its key is there."""
    key = (entry["model"], entry["connector"], entry["config"], entry["hardware"])
    if any(b.key == key for b in load(path)):
        raise ConfigError(
            "--record-baseline",
            f"{path} already has a perf baseline for {key}; remove it first to re-record",
        )
    import tomli_w  # only here: a TOML writer, never string formatting

    with open(path, "a") as f:
        f.write("\n" + tomli_w.dumps({"baseline": [dict(entry)]}))
