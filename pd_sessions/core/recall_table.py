"""The recall table: for each bug class of the catalogue (core/bug_catalogue.py) and each
connector, what a run's results say of it. Pure: the results are passed in, parsed (each a
config's result.json, core/results.py), with where each came from.

A cell, from the verdicts of the class's judging checks (the injecting check; for a class
injected by config settings, every check of ``caught_by`` on a config with those settings):

=====================================================  ==========================================
the judging check(s)                                    cell
=====================================================  ==========================================
injecting check PASS / settings' checks all FAIL        CAUGHT, with its detection figure
XFAIL (a known upstream bug, details.known_issue)       XFAIL, naming the known issue and its link
injecting check FAIL or XPASS / a settings' check PASS  MISSED, with the check's message
NOT RUN, or no result of it on that connector           NOT RUN, with the reason
the connector declared out (not_run_reason,             OUT, with the declared reason; not counted
ci_not_run in CI's scope)
=====================================================  ==========================================

Several results for one cell: MISSED wins, then CAUGHT, XFAIL, NOT RUN (one run that missed it
is a miss). CAUGHT and XFAIL are covered. Recall per connector = covered / classes counted on it;
the table passes only at 100 % on every connector, with every class counted somewhere and every
injecting check of the registry catalogued: a class without a result is NOT RUN, never a silent pass.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pd_sessions.core import bug_catalogue
from pd_sessions.core.bug_catalogue import CONNECTORS, BugClass, Catalogue
from pd_sessions.core.results import FAIL, PASS, XFAIL, XPASS

CAUGHT, XFAILED, MISSED, UNRUN, OUT = "caught", "xfail", "missed", "not run", "out"
COVERED = (CAUGHT, XFAILED)
_RANK = {MISSED: 0, CAUGHT: 1, XFAILED: 2, UNRUN: 3}
_PLACEHOLDER = re.compile(r"\{([^{}]+)\}")
_SHOWN = 160  # characters of a message or a value shown in a cell


@dataclass(frozen=True)
class Result:
    """One config's result.json, parsed, and where it came from (a path, for the reader)."""

    source: str
    data: Mapping[str, Any]

    @property
    def connector(self) -> str:
        return str(self.data.get("connector", ""))

    def checks(self) -> dict[str, Mapping[str, Any]]:
        return {str(c.get("name")): c for c in self.data.get("checks", []) if isinstance(c, Mapping)}

    def injected(self) -> Mapping[str, Any]:
        v = self.data.get("injected")
        return v if isinstance(v, Mapping) else {}


@dataclass(frozen=True)
class Cell:
    bug: str
    connector: str
    status: str  # CAUGHT | XFAILED | MISSED | UNRUN | OUT
    detail: str  # the detection figure, the known issue, why missed, why not run
    source: str = ""  # the result it was read from

    @property
    def covered(self) -> bool:
        return self.status in COVERED

    @property
    def counted(self) -> bool:
        return self.status != OUT

    def to_dict(self) -> dict[str, Any]:
        return {
            "bug": self.bug,
            "connector": self.connector,
            "status": self.status,
            "detail": self.detail,
            "source": self.source,
        }


def _lookup(details: Any, dotted: str) -> Any:
    value = details
    for part in dotted.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def detection(template: str, check: Mapping[str, Any]) -> str:
    """The class's detection template filled from a check's result: {message}, or {key} of its
    details (dotted: nested); a key the result lacks reads "?"."""

    def fill(m: re.Match[str]) -> str:
        key = m.group(1)
        value = check.get("message") if key == "message" else _lookup(check.get("details") or {}, key)
        return "?" if value is None else str(value)[:_SHOWN]

    return _PLACEHOLDER.sub(fill, template)


def _by_check(bug: BugClass, r: Result) -> Cell | None:
    """The cell one result gives a class injected by a fault check (None: the check is not in it)."""
    c = r.checks().get(bug.injection.check)
    if c is None:
        return None
    verdict, msg = c.get("verdict"), str(c.get("message", ""))[:_SHOWN]
    if verdict == PASS:
        return Cell(bug.id, r.connector, CAUGHT, detection(bug.detection, c), r.source)
    if verdict == XFAIL:
        return _xfail(bug, r, c)
    if verdict in (FAIL, XPASS):
        return Cell(bug.id, r.connector, MISSED, f"{bug.injection.check} {verdict}: {msg}", r.source)
    return Cell(bug.id, r.connector, UNRUN, f"{bug.injection.check} not run: {msg}", r.source)


def _xfail(bug: BugClass, r: Result, c: Mapping[str, Any]) -> Cell:
    known = (c.get("details") or {}).get("known_issue")
    if not isinstance(known, Mapping) or not known.get("id"):
        return Cell(bug.id, r.connector, MISSED, f"{c.get('name')} XFAIL without a known issue", r.source)
    return Cell(bug.id, r.connector, XFAILED, f"known issue {known['id']}: {known.get('link', '')}", r.source)


# Within one result, the cell of a class that several checks must catch: the worst of theirs (a
# check that passed missed it, whatever the others did; one that did not run leaves it unproven;
# an XFAIL among failures is the known issue's).
_WITHIN = {MISSED: 0, UNRUN: 1, XFAILED: 2, CAUGHT: 3}


def _by_settings(bug: BugClass, r: Result) -> Cell | None:
    """The cell one result gives a class injected by config settings (None: the config does not
    inject it). Every check of caught_by must FAIL; one that passed missed it, whatever the others
    say (each is looked at: an XFAIL first does not hide a PASS after it)."""
    if not bug.matches_settings(r.injected()):
        return None
    checks = r.checks()
    cells = []
    for name in bug.caught_by:
        c = checks.get(name)
        if c is None:
            cells.append(
                Cell(bug.id, r.connector, UNRUN, f"{name} did not run on the injected config", r.source)
            )
            continue
        verdict, msg = c.get("verdict"), str(c.get("message", ""))[:_SHOWN]
        if verdict == PASS:
            cells.append(
                Cell(bug.id, r.connector, MISSED, f"{name} passed under the injection: {msg}", r.source)
            )
        elif verdict == XFAIL:
            cells.append(_xfail(bug, r, c))
        elif verdict != FAIL:
            cells.append(Cell(bug.id, r.connector, UNRUN, f"{name} {verdict}: {msg}", r.source))
    if cells:
        return min(cells, key=lambda c: _WITHIN[c.status])
    first = checks[bug.caught_by[0]]
    return Cell(bug.id, r.connector, CAUGHT, detection(bug.detection, first), r.source)


def cell(bug: BugClass, connector: str, results: Sequence[Result], *, ci: bool = False) -> Cell:
    """The class's cell on ``connector`` from every result of that connector."""
    out = bug.reason_left_out(connector, ci=ci)
    if out:
        return Cell(bug.id, connector, OUT, out)
    judge = _by_check if bug.injection.check else _by_settings
    cells = [c for r in results if r.connector == connector and (c := judge(bug, r)) is not None]
    if not cells:
        what = bug.injection.check or f"a config with {dict(bug.injection.settings)}"
        return Cell(bug.id, connector, UNRUN, f"no result of {what} on {connector} in the results given")
    return min(cells, key=lambda c: _RANK[c.status])


@dataclass(frozen=True)
class RecallTable:
    cells: tuple[Cell, ...]
    bugs: tuple[str, ...]  # the catalogue's ids, in its order
    connectors: tuple[str, ...]
    ci: bool  # judged against CI's scope (ci_not_run left out)
    # injecting checks of the registry with no catalogue entry (bug_catalogue.uncatalogued)
    uncatalogued: tuple[str, ...] = ()

    def at(self, bug: str, connector: str) -> Cell:
        return next(c for c in self.cells if c.bug == bug and c.connector == connector)

    def recall(self, connector: str) -> tuple[int, int]:
        """(covered, counted) classes on ``connector``."""
        mine = [c for c in self.cells if c.connector == connector and c.counted]
        return sum(c.covered for c in mine), len(mine)

    def uncounted(self) -> list[str]:
        """The classes no connector counts (declared out everywhere)."""
        return [b for b in self.bugs if not any(self.at(b, k).counted for k in self.connectors)]

    def problems(self) -> list[str]:
        """Each cell that keeps the table below 100 %, naming the class and the connector."""
        bad = [c for c in self.cells if c.counted and not c.covered]
        out = [f"{c.bug} on {c.connector}: {c.status.upper()}: {c.detail}" for c in bad]
        out += [f"{b}: declared out on every connector; it must run somewhere" for b in self.uncounted()]
        return out + [
            f"{c}: injects a fault but has no entry in the bug catalogue: add a [[bug]] (or a "
            "[[not_a_class]] with the reason) to configs/bug_catalogue.toml"
            for c in self.uncatalogued
        ]

    @property
    def ok(self) -> bool:
        return not self.problems()

    def summary(self) -> str:
        parts = []
        for k in self.connectors:
            covered, counted = self.recall(k)
            pct = f"{100 * covered // counted} %" if counted else "none counted"
            parts.append(f"{k} {covered}/{counted} ({pct})")
        verdict = "PASS" if self.ok else "FAIL"
        return f"recall {verdict}{' (CI scope)' if self.ci else ''}: " + ", ".join(parts)

    def markdown(self) -> str:
        head = "| class | " + " | ".join(self.connectors) + " |"
        rule = "| --- |" + " --- |" * len(self.connectors)
        rows = [
            f"| {b} | " + " | ".join(_md(self.at(b, k)) for k in self.connectors) + " |" for b in self.bugs
        ]
        return "\n".join([self.summary(), "", head, rule, *rows, ""])

    def lines(self) -> list[str]:
        """The table as plain lines (a CI log, a terminal)."""
        width = max(len(b) for b in self.bugs)
        out = [self.summary()]
        for b in self.bugs:
            for k in self.connectors:
                c = self.at(b, k)
                out.append(f"  {b:<{width}}  {k:<8}  {c.status.upper():<7}  {c.detail}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "ci": self.ci,
            "recall": {
                k: dict(zip(("covered", "counted"), self.recall(k), strict=True)) for k in self.connectors
            },
            "problems": self.problems(),
            "cells": [c.to_dict() for c in self.cells],
        }


def _md(c: Cell) -> str:
    return f"**{c.status.upper()}**: {c.detail}".replace("|", "\\|").replace("\n", " ")


def build(
    catalogue: Catalogue,
    results: Sequence[Result],
    *,
    ci: bool = False,
    connectors: Sequence[str] = CONNECTORS,
) -> RecallTable:
    """The recall table of ``results`` against every class of ``catalogue`` (``ci``: CI's scope,
    each class's ci_not_run connectors left out)."""
    cells = tuple(cell(b, k, results, ci=ci) for b in catalogue.bugs for k in connectors)
    return RecallTable(
        cells=cells,
        bugs=catalogue.ids(),
        connectors=tuple(connectors),
        ci=ci,
        uncatalogued=tuple(bug_catalogue.uncatalogued(catalogue)),
    )
