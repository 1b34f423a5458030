"""Perf baselines and expectations: what a config measured on one hardware class, how far it
may drift, and what P/D may cost against colocated on each lane.

A file beside the accuracy baselines (``pd_sessions/configs/perf_baselines.toml``), one entry
per (model, connector, config, hardware class), each figure with its own tolerance::

    [[baseline]]
    model = "tiny-llama"
    connector = "nixl"
    config = "1x1"
    hardware = "cpu, 2 cores"
    source = "recorded 2026-12-05 from 5 runs by: pd-sessions perf-baseline --runs 5 -- nixl_sweep ..."
    [baseline.figures."c1.pd.ttft_p50_ms"]
    value = 41.2                  # the runs' median
    rtol = 0.5                    # max(default, 3 x the largest |run - median| / median)
    better = "lower"
    spread = 0.1                  # that largest |run - median| / median
    runs = [40.1, 41.2, ...]

and one expectation per (lane, figure): P/D against colocated, hardware-relative, so a lane's
expectation holds on any machine of it::

    [[expectation]]
    lane = "cpu"
    figure = "c1.ratio.itl_p50"        # P/D / colocated (x)
    max = 2.5
    why = "measured 0.89-1.53x in 11 runs on 2 shared cores"

Baseline rules (:func:`compare`):
- a figure that is better when lower regresses when measured > value * (1 + rtol); one that is
  better when higher, when measured < value * (1 - rtol); improvements never fail;
- only an entry of the same hardware class is compared (perf on an H200 says nothing about a
  2-core VM); entries of other classes are named, not judged;
- no entry: nothing is judged against a baseline, and the check says so: NOT RUN, never PASS
  (perf.evaluate). ``pd-sessions perf-baseline`` records one from N runs (:func:`measured_entry`:
  the median, and a tolerance from the runs' spread); the sweep's ``--record-baseline`` one run.

Expectation rules (:func:`judge_expectations`): ``c<N>.ratio.<figure>`` is P/D / colocated of a
bench figure at concurrency N (ttft, itl, tpot at p50 or p99), ``c<N>.excess.<figure>_ms`` P/D -
colocated in ms (the TTFT excess is the handover's cost: the budget it has); a measured value
above ``max`` fails the check, naming the figure, the value and the bound. A lane without
expectations is not judged on them (NOT RUN, like a missing baseline).

Pure, except :func:`record` (appends to the file with a TOML writer).
"""

from __future__ import annotations

import re
import statistics
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
# pd-sessions perf-baseline (measured_entry): at least MIN_RUNS runs; each figure's tolerance is
# SPREAD_MARGIN x its runs' largest relative distance from their median, never below the figure's
# DEFAULT_TOLERANCES (a quiet window's spread says little about a busy CI); a better-when-higher
# figure's at most HIGHER_RTOL_CAP (a bound of 0 would pass anything): a tenth of the median, as
# far as the 2 shared cores spread them (output tok/s 20-194 and the link ratio 0.016-0.54 over 8
# runs of CI's shape, 2026-12-05).
MIN_RUNS = 5
SPREAD_MARGIN = 3.0
HIGHER_RTOL_CAP = 0.9
LANES = ("cpu", "cuda")
# c<N>.ratio.<m>_p<P> (P/D / colocated, x) or c<N>.excess.<m>_p<P>_ms (P/D - colocated, ms)
EXPECTATION_FIGURE = re.compile(
    r"^c[1-9][0-9]*\.(ratio\.(ttft|itl|tpot)_p(50|99)|excess\.(ttft|itl|tpot)_p(50|99)_ms)$"
)


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


@dataclass(frozen=True)
class Expectation:
    """What P/D may cost against colocated on one lane: ``figure`` (see EXPECTATION_FIGURE) at
    most ``max``; ``why`` says where the bound comes from (what was measured, the margin)."""

    lane: str  # "cpu" | "cuda"
    figure: str
    max: float
    why: str = ""

    @property
    def unit(self) -> str:
        return "x" if ".ratio." in self.figure else " ms"


def lane_of(hardware: str) -> str:
    """The lane of a hardware class (:func:`hardware_class`): "cpu" for "cpu, N cores", else "cuda"."""
    return "cpu" if hardware.startswith("cpu,") else "cuda"


def hardware_class(gpu_names: Sequence[str], cores: int) -> str:
    """The hardware class a baseline is keyed by: the GPUs the cluster runs on ("1x NVIDIA
    H200"; mixed models are listed each), or "cpu, N cores" when it runs on none."""
    if not gpu_names:
        return f"cpu, {cores} cores"
    counts: dict[str, int] = {}
    for n in gpu_names:
        counts[n] = counts.get(n, 0) + 1
    return " + ".join(f"{c}x {n}" for n, c in counts.items())


def _document(path: Path) -> dict[str, Any]:
    """The file's TOML ({} when there is no file; ConfigError naming it when it does not parse)."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("perf baselines", str(e), source=str(path)) from None


def load(path: Path = BASELINES) -> list[PerfBaseline]:
    """Every entry of the file (ConfigError naming the entry and the field that is wrong)."""
    data = _document(path)
    return [
        from_entry(raw, where=f"baseline #{i + 1}", source=str(path))
        for i, raw in enumerate(data.get("baseline", []))
    ]


def load_expectations(path: Path = BASELINES) -> list[Expectation]:
    """Every ``[[expectation]]`` of the file (ConfigError naming the entry and the field)."""
    data = _document(path)
    out = []
    for i, raw in enumerate(data.get("expectation", [])):
        where = f"expectation #{i + 1}"
        if raw.get("lane") not in LANES:
            raise ConfigError(f"{where}.lane", f"got {raw.get('lane')!r}; allowed: {LANES}", source=str(path))
        figure = raw.get("figure")
        if not isinstance(figure, str) or not EXPECTATION_FIGURE.match(figure):
            raise ConfigError(
                f"{where}.figure",
                f"got {figure!r}; allowed: c<N>.ratio.<ttft|itl|tpot>_p<50|99> (P/D / colocated) or "
                "c<N>.excess.<ttft|itl|tpot>_p<50|99>_ms (P/D - colocated)",
                source=str(path),
            )
        bound = raw.get("max")
        if not isinstance(bound, (int, float)) or isinstance(bound, bool):
            raise ConfigError(f"{where}.max", f"got {bound!r}; allowed: a number", source=str(path))
        out.append(Expectation(raw["lane"], figure, float(bound), str(raw.get("why", ""))))
    return out


def judge_expectations(
    measured: Mapping[str, float], expectations: Sequence[Expectation], lane: str
) -> tuple[list[str], dict[str, Any]]:
    """(broken expectations, details) of a run's P/D-vs-colocated figures on ``lane``.

    an expectation of the lane measured above its max -> broken: "figure value > max (why)"
    none of the lane's measured (no expectation, or other concurrency levels) -> details'
    status says so: nothing judged (the check is then NOT RUN, never PASS)
    """
    mine = [e for e in expectations if e.lane == lane]
    rows: list[dict[str, Any]] = [
        {"figure": e.figure, "measured": round(measured[e.figure], 6), "max": e.max, "why": e.why,
         "ok": measured[e.figure] <= e.max}
        for e in mine
        if e.figure in measured
    ]  # fmt: skip
    details: dict[str, Any] = {"lane": lane, "rows": rows}
    details["not_measured"] = [e.figure for e in mine if e.figure not in measured]
    if not mine:
        details["status"] = f"no P/D vs colocated expectation for the {lane} lane"
    elif not rows:
        details["status"] = (
            f"none of the {lane} lane's P/D vs colocated expectations measured "
            f"({', '.join(details['not_measured'])}: other concurrency levels)"
        )
    else:
        details["status"] = "judged"
    units = {e.figure: e.unit for e in mine}
    broken = []
    for r in rows:
        if not r["ok"]:
            u = units[r["figure"]]
            why = f" ({r['why']})" if r["why"] else ""
            broken.append(f"{r['figure']} = {r['measured']:.3g}{u}, allowed <= {r['max']:g}{u}{why}")
    return broken, details


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
        model, connector, config, hardware = key
        details["status"] = (
            f"no perf baseline for {hardware} ({model}, {connector}, {config}): nothing judged against "
            "one (record one: pd-sessions perf-baseline)"
        )
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
    return _entry(key, source, figures)


def measured_entry(
    key: tuple[str, str, str, str],
    runs: Sequence[Mapping[str, float]],
    *,
    source: str,
    margin: float = SPREAD_MARGIN,
) -> dict[str, Any]:
    """The entry ``pd-sessions perf-baseline`` writes from ``runs`` (each run's baseline figures):
    per figure measured in every run and known to DEFAULT_TOLERANCES, the median as the value, and
    rtol = max(the figure's default, ``margin`` x the largest |run - median| / median), at most
    HIGHER_RTOL_CAP for a better-when-higher figure; the runs and the spread are kept beside it.
    ConfigError when fewer than MIN_RUNS runs are given."""
    if len(runs) < MIN_RUNS:
        raise ConfigError(
            "--runs", f"got {len(runs)} run(s) with perf figures; allowed: at least {MIN_RUNS} (a spread)"
        )
    figures = {}
    for name in sorted(set.intersection(*(set(r) for r in runs))):
        tol = DEFAULT_TOLERANCES.get(name.rsplit(".", 1)[-1])
        values = [float(r[name]) for r in runs]
        median = statistics.median(values)
        if tol is None or median <= 0:
            continue
        spread = max(abs(v - median) for v in values) / median
        rtol = max(tol[0], margin * spread)
        if tol[1] == "higher":
            rtol = min(rtol, HIGHER_RTOL_CAP)
        figures[name] = {
            "value": round(median, 4),
            "rtol": round(rtol, 3),
            "better": tol[1],
            "spread": round(spread, 4),
            "runs": [round(v, 4) for v in values],
        }
    return _entry(key, source, figures)


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


def _entry(key: tuple[str, str, str, str], source: str, figures: dict[str, Any]) -> dict[str, Any]:
    """One ``[[baseline]]`` entry as the file holds it (what :func:`from_entry` reads)."""
    model, connector, config, hardware = key
    return {
        "model": model,
        "connector": connector,
        "config": config,
        "hardware": hardware,
        "source": source,
        "figures": figures,
    }
