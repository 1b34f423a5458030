"""The results model: one record per check and per config, and the schema they are written in.

What a check measured goes into one generic structure that any reader can show without knowing
the check: named :class:`Figure` s (a value and its unit) and small :class:`Table` s; ``details``
keeps the check's own raw record beside them. Every phase, process and check records when it
started (wall-clock seconds since the epoch) as well as how long it took, so that a timeline can
be drawn. ``result.json`` and ``summary.json`` carry :data:`SCHEMA_VERSION`.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec

PASS, FAIL = "pass", "fail"
# A check that could not look (netem absent from the kernel, no perf baseline for this lane, fewer
# GPUs than it needs): its message is the reason. Never a pass: a config with one reads "passed, N
# not run", a sweep may require the check (then its config fails), and --strict fails every one.
# The same word is a config's outcome when it never started (below).
NOT_RUN = "not run"
# A NOT RUN whose reason is that this config is outside what the check judges (kv_digest over a
# prefill and a decode of different TP sizes, a hybrid model, a connector whose sends it cannot
# pair): there is nothing there for it to look at, so it fails no config, not even one that
# requires the check; --strict still fails it, as every NOT RUN. It is shown as NOT RUN with its
# reason everywhere, never as a pass. Every other NOT RUN (a tool, a baseline, a side file
# missing: the check could not look where it should) fails a config that requires the check.
# CheckResult.inapplicable marks it; :func:`inapplicable` makes one.
# A check that reproduces a known upstream bug in its version range (core/known_issues.py):
# XFAIL when it failed the way the registry's entry says (still broken upstream: the config does
# not fail); XPASS when it passed (the bug is fixed: the config fails until the entry is retired).
XFAIL, XPASS = "xfail", "xpass"
VERDICTS = (PASS, FAIL, NOT_RUN, XFAIL, XPASS)

# The version of result.json and summary.json ("schema"): 1 (no key) had no figures, tables,
# start times or processes; 2 added them; 3 added the check verdict "not run", a config's
# "not_run" (its checks that could not run) and "unmet" (why a passing-looking config failed: a
# required check that did not run, or any under --strict), and the summary's "not_run" count; 4
# added the check verdicts "xfail" and "xpass" (a known upstream bug, core/known_issues.py: the
# check's details then carry "known_issue": its id, link, component, range and installed
# version), a config's "known_issues" (every entry its checks hit: check, verdict, id, link) and
# the summary's "known_issues" (the same, over every config) and "xfail"/"xpass" counts; later
# in 4, a config's "injected" (its fault-injection settings; a reader of an older file reads {})
# and a NOT RUN check's "inapplicable" (true: the config is outside what the check judges, and
# its NOT RUN fails no config but under --strict; a reader of an older file reads false).
SCHEMA_VERSION = 4

Value = float | int | str | bool | None
P = ParamSpec("P")


@dataclass(frozen=True)
class Figure:
    """One thing a check measured: ``name`` (a details key, e.g. "max_gap"), its value and unit
    ("s", "tokens", "nats", "bytes", "GB/s", "%"; "" for a count, a ratio or a text)."""

    name: str  # a details key, e.g. "max_gap"
    value: Value  # a number, a text, a bool or None
    unit: str = ""  # "s", "tokens", "nats", "bytes", "GB/s", "%"; "" for a count, a ratio or a text

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "unit": self.unit}


@dataclass(frozen=True)
class Table:
    """A small table a check measured: rows of values under named columns (a unit, if any, is
    part of the column's name: "ttft p50 (ms)")."""

    title: str  # what the table shows
    columns: tuple[str, ...]  # the column names, a unit in parentheses
    rows: tuple[tuple[Value, ...], ...]  # one value per column in each row

    def __post_init__(self) -> None:
        for i, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(
                    f"table {self.title!r}: row {i} has {len(row)} values for {len(self.columns)} columns"
                )

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "columns": list(self.columns), "rows": [list(r) for r in self.rows]}


@dataclass
class CheckResult:
    name: str  # "smoke", "parity", "kv_transfer", ...
    verdict: str  # "pass" | "fail" | "not run" | "xfail" | "xpass" (VERDICTS)
    message: str  # one line a person reads first; for "not run", the reason
    details: dict[str, Any] = field(default_factory=dict)  # the check's own raw record
    seconds: float = 0.0  # how long it ran
    figures: list[Figure] = field(default_factory=list)  # what it measured, for any reader
    tables: list[Table] = field(default_factory=list)  # small tables it measured
    started_at: float | None = None  # time.time() when it started
    # NOT RUN only: the config is outside what the check judges (kv_digest over TP sizes that
    # differ, a hybrid model); its NOT RUN then fails no config but under --strict
    inapplicable: bool = False

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"check {self.name!r}: verdict {self.verdict!r} is not one of {VERDICTS}")
        if self.inapplicable and self.verdict != NOT_RUN:
            raise ValueError(f"check {self.name!r}: only a NOT RUN can be inapplicable, not {self.verdict!r}")

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    @property
    def failed(self) -> bool:
        return self.verdict == FAIL

    @property
    def not_run(self) -> bool:
        return self.verdict == NOT_RUN

    @property
    def ok(self) -> bool:
        """Does not fail its config: passed, could not look (NOT RUN), or a known bug still there."""
        return self.verdict in (PASS, NOT_RUN, XFAIL)

    @property
    def known_issue(self) -> dict[str, Any] | None:
        """The known upstream bug this check's verdict is about (XFAIL or XPASS), or None."""
        k = self.details.get("known_issue") if self.verdict in (XFAIL, XPASS) else None
        return k if isinstance(k, dict) else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "verdict": self.verdict,
            "message": self.message,
            "started_at": None if self.started_at is None else round(self.started_at, 3),
            "seconds": round(self.seconds, 3),
            "figures": [f.to_dict() for f in self.figures],
            "tables": [t.to_dict() for t in self.tables],
            "details": self.details,
            **({"inapplicable": self.inapplicable} if self.verdict == NOT_RUN else {}),
        }


Numbers = Callable[[Mapping[str, Any]], Sequence[Figure | Table]]


def reporting(numbers: Numbers) -> Callable[[Callable[P, CheckResult]], Callable[P, CheckResult]]:
    """Decorates a check's pure ``evaluate``: every result it returns also carries the figures
    and tables that ``numbers`` (pure, beside it) reads from the result's details, whichever
    branch returned it. ``numbers`` must cope with the keys a failing branch leaves out."""

    def wrap(evaluate: Callable[P, CheckResult]) -> Callable[P, CheckResult]:
        @functools.wraps(evaluate)
        def evaluated(*args: P.args, **kwargs: P.kwargs) -> CheckResult:
            r = evaluate(*args, **kwargs)
            for n in numbers(r.details):
                if isinstance(n, Figure):
                    r.figures.append(n)
                else:
                    r.tables.append(n)
            return r

        return evaluated

    return wrap


def pick(details: Mapping[str, Any], *spec: tuple[str, str]) -> list[Figure]:
    """A Figure for each (key, unit) of ``spec`` whose value in ``details`` is a number or a text
    (absent keys and None are left out), in ``spec``'s order."""
    out = []
    for key, unit in spec:
        v = details.get(key)
        if isinstance(v, (int, float, str)):
            out.append(Figure(key, round(v, 6) if isinstance(v, float) else v, unit))
    return out


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


def unrun(name: str, reason: str, details: dict[str, Any] | None = None) -> CheckResult:
    """A check that could not look: NOT RUN, ``reason`` saying why (and what would let it run)."""
    return CheckResult(name, NOT_RUN, reason, dict(details or {}))


def inapplicable(name: str, reason: str, details: dict[str, Any] | None = None) -> CheckResult:
    """A check that has nothing to judge in this config (its layout is outside what the check
    compares): NOT RUN, ``reason`` saying why; it fails no config, even one that requires the
    check (only --strict fails it). Never for a check that should have looked and could not:
    that is :func:`unrun`."""
    return CheckResult(name, NOT_RUN, reason, dict(details or {}), inapplicable=True)


PASSED, FAILED, ERROR = "passed", "failed", "error"


# A config a stop cut short; one never started (NOT_RUN, above); one under way (only ever seen in
# a provisional summary, written as each config starts: see unfinished.py).
CANCELLED, RUNNING = "cancelled", "running"


PHASES = ("plan", "start", "router", "checks", "teardown")


@dataclass
class ProcessRecord:
    """One process of a config's cluster: where it ran, its log, when it started and how long
    it took to be ready (None: never noticed ready)."""

    name: str  # "prefill-0", "decode-0", "router"
    role: str  # "prefill" | "decode" | "router"
    host: str  # the address it served on
    log: str  # its log file's name, in the config's run directory
    started_at: float | None = None  # time.time() when spawned
    ready_s: float | None = None  # seconds from spawn to ready

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "host": self.host,
            "log": self.log,
            "started_at": None if self.started_at is None else round(self.started_at, 3),
            "ready_s": None if self.ready_s is None else round(self.ready_s, 3),
        }


@dataclass
class ConfigResult:
    name: str  # the config's name (--only NAME)
    shape: str  # e.g. "1xP(TP1) + 1xD(TP1)"
    connector: str  # the KV connector it ran over
    platform: str  # the lane: "cpu" or "cuda"
    outcome: str = ERROR  # passed | failed | error | cancelled | not run | running
    phases: dict[str, float] = field(default_factory=dict)  # PHASES -> seconds
    checks: list[CheckResult] = field(default_factory=list)  # in running order
    error: str | None = None  # what stopped the config, if anything did
    run_dir: str = ""  # its folder: plan.txt, result.json, the logs
    warnings: list[str] = field(default_factory=list)  # printed and kept, not failures
    timings: dict[str, float] = field(default_factory=dict)  # per-process readiness etc.
    overrides: list[str] = field(default_factory=list)  # the command line's, described
    # the fault-injection settings the config sets (ClusterConfig.injected; {} for none): the
    # recall table (core/recall_table.py) finds the bug classes they inject by them
    injected: dict[str, Any] = field(default_factory=dict)
    model: str = ""  # what the instances served (path or hub id)
    started_at: float | None = None  # time.time() when the config started (its plan phase)
    phase_starts: dict[str, float] = field(default_factory=dict)  # PHASES -> time.time() at its start
    processes: list[ProcessRecord] = field(default_factory=list)  # every process it started
    # why a config whose checks all passed or could not run still failed (decide())
    unmet: list[str] = field(default_factory=list)
    # the checks ``unmet`` speaks of, by name, in its order (decide(); the JUnit writer's)
    unmet_checks: list[str] = field(default_factory=list)

    def decide(
        self, expected_checks: Sequence[str], *, required: Sequence[str] = (), strict: bool = False
    ) -> None:
        """The config's outcome from its error and its checks' verdicts:

        =====================================================  ========
        what was seen                                          outcome
        =====================================================  ========
        an error, or an expected check that returned nothing   error
        a check failed, or XPASS (a known bug fixed)           failed
        a check NOT RUN that is ``required`` (or any, strict)  failed (``unmet`` says which, why)
        every check passed, NOT RUN or XFAIL                   passed (``not_run``, ``known_issues``
                                                               list those)
        =====================================================  ========

        An inapplicable NOT RUN (the config is outside what the check judges) is never unmet but
        under ``strict``: a required check with nothing to judge does not fail its config.
        """
        ran = {c.name for c in self.checks}
        missing = [n for n in expected_checks if n not in ran]
        if self.error is None and missing:
            self.error = f"checks did not run: {', '.join(missing)}"
        unmet = [
            c for c in self.checks if c.not_run and (strict or (c.name in required and not c.inapplicable))
        ]
        self.unmet_checks = [c.name for c in unmet]
        by_sweep = {c.name for c in unmet if c.name in required and not c.inapplicable}
        self.unmet = [
            f"{c.name} is {'required by the sweep' if c.name in by_sweep else 'NOT RUN under --strict'} "
            f"and did not run: {c.message}"
            for c in unmet
        ]
        if self.error is not None:
            self.outcome = ERROR
        elif any(not c.ok for c in self.checks) or self.unmet:
            self.outcome = FAILED
        else:
            self.outcome = PASSED

    @property
    def not_run(self) -> list[str]:
        """The checks that could not run (their messages say why)."""
        return [c.name for c in self.checks if c.not_run]

    @property
    def known_issues(self) -> list[dict[str, Any]]:
        """Every known upstream bug its checks hit (XFAIL or XPASS): check, verdict, id, link."""
        return [
            {"check": c.name, "verdict": c.verdict, "id": k.get("id"), "link": k.get("link")}
            for c in self.checks
            if (k := c.known_issue) is not None
        ]

    @property
    def label(self) -> str:
        """The outcome as a person reads it: "passed, 2 not run, 1 xfail" when checks could not
        run or hit a known bug (a config is never plain green then), else the outcome."""
        n, x = len(self.not_run), sum(1 for c in self.checks if c.verdict == XFAIL)
        extra = [f"{n} not run"] * bool(n) + [f"{x} xfail"] * bool(x)
        return ", ".join([self.outcome, *extra]) if self.outcome == PASSED and extra else self.outcome

    @property
    def total_seconds(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "name": self.name,
            "shape": self.shape,
            "connector": self.connector,
            "platform": self.platform,
            "model": self.model,
            "outcome": self.outcome,
            "error": self.error,
            "started_at": None if self.started_at is None else round(self.started_at, 3),
            "phases": {k: round(v, 3) for k, v in self.phases.items()},
            "phase_starts": {k: round(v, 3) for k, v in self.phase_starts.items()},
            "processes": [p.to_dict() for p in self.processes],
            "total_seconds": round(self.total_seconds, 3),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "checks": [c.to_dict() for c in self.checks],
            "not_run": self.not_run,
            "unmet": self.unmet,
            "known_issues": self.known_issues,
            "warnings": self.warnings,
            "overrides": self.overrides,
            "injected": self.injected,
            "run_dir": self.run_dir,
        }
