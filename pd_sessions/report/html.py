"""``report.html``: one self-contained page per results directory, rendered from what the result
files hold (summary.json, or each config's result.json) and the logs beside them.

It shows the environment (vLLM, torch and the connectors, their versions and where they come
from; the lane, hosts and GPUs), configs x checks with verdicts, and per config: a phase
timeline as inline SVG (plan, each process from spawn to ready, the router, each check,
teardown), each check's message, figures and tables (whatever a check reports through the
results schema, known here or not), the placement per host when there were several, and its
logs, linked, with the tails of a config that did not pass collapsed beside them.

Safe and offline: Jinja2 with autoescaping renders every string (log lines, model, config and
file names, user commands are untrusted); links are relative, built from path segments that are
percent-quoted; CSS and SVG are inline; a Content-Security-Policy forbids every script and
remote load; it reads without JavaScript. Size is bounded: log tails, messages and tables are
capped (a 6-config sweep stays well under 2 MiB).

Written by the sweep on every exit path (with the summary, the provisional one too); ``pd-sessions
report DIR`` renders it again. Jinja2 is imported only when a page is rendered: the modules the
noxfile imports never reach this one (tests/test_bare_imports.py).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pd_sessions.core.errors import UsageError
from pd_sessions.core.results import PASSED, PHASES, SCHEMA_VERSION
from pd_sessions.runtime.logtail import log_tail

log = logging.getLogger(__name__)

PAGE = "report.html"
TEMPLATE = Path(__file__).with_name("report.html.j2")
# What the page shows at most, so that a 6-config sweep that failed everywhere, with huge logs,
# long messages and big tables, stays under 2 MiB (tests/test_html_report.py); the result files
# and the logs beside the page keep everything.
TAIL_LINES = 30  # per log of a config that did not pass
LINE_CHARS = 240  # per log line shown
LOGS_WITH_TAILS = 10  # per config
MESSAGE_CHARS = 4000
TITLE_CHARS = 300  # a message as the matrix cell's tooltip
TABLE_ROWS = 50
CELL_CHARS = 120

# The timeline's geometry (px).
LABEL_W, PLOT_W, ROW_H, BAR_H, AXIS_H = 150, 700, 20, 14, 22


# ---------------------------------------------------------------- the page's model (pure but for logs


@dataclass
class Bar:
    row: int
    kind: str  # "phase" | "process" | "check"
    name: str
    start_s: float  # from the config's start
    seconds: float
    state: str = ""  # pass | fail (checks), ready | never-ready (processes), the phase's name
    x: float = 0.0  # px, set once the axis is known
    y: float = 0.0
    w: float = 0.0

    def place(self, scale: float) -> None:
        """Its position on an axis of ``scale`` px per second (a bar is at least 2 px wide)."""
        self.x = LABEL_W + max(self.start_s, 0.0) * scale
        self.y = AXIS_H + self.row * ROW_H + (ROW_H - BAR_H) / 2
        self.w = max(self.seconds * scale, 2.0)

    @property
    def title(self) -> str:
        return (
            f"{self.name}: {self.start_s:.1f} s -> {self.start_s + self.seconds:.1f} s ({self.seconds:.2f} s)"
        )


@dataclass
class Timeline:
    bars: list[Bar]
    rows: list[str]  # the label of each row
    ticks: list[tuple[float, str]]  # (x, label)
    width: int
    height: int
    total_s: float


@dataclass
class LogFile:
    name: str
    href: str | None  # relative to the page; None if it is not below the results directory
    size: str
    tail: str | None = None  # shown (collapsed) for a config that did not pass
    named: bool = False  # its process is named in the failure


@dataclass
class Config:
    anchor: str
    doc: Mapping[str, Any]
    cells: list[dict[str, str] | None]
    checks: list[dict[str, Any]]
    timeline: Timeline | None
    placement: list[tuple[str, list[str]]]  # host -> processes, when there were several hosts
    error: str = ""  # what stopped it, capped
    badge: tuple[str, str] = ("?", "")  # outcome_label(): its text and class
    phases: list[tuple[str, float]] = field(default_factory=list)  # in PHASES' order
    logs: list[LogFile] = field(default_factory=list)


def page_model(doc: Mapping[str, Any], results_dir: Path) -> dict[str, Any]:
    """What the template renders, from a summary document (summary.json's shape)."""
    configs_doc = [c for c in doc.get("configs") or [] if isinstance(c, Mapping)]
    columns = check_columns(doc.get("checks") or [], configs_doc)
    configs = [config_model(i, c, columns, results_dir) for i, c in enumerate(configs_doc)]
    starts = [c["started_at"] for c in configs_doc if c.get("started_at")]
    passed = sum(1 for c in configs_doc if c.get("outcome") == PASSED)
    not_run = sum(len(c.get("not_run") or []) for c in configs_doc)
    known = [
        {"config": str(c.get("name", "?")), **k}
        for c in configs_doc
        for k in c.get("known_issues") or []
        if isinstance(k, Mapping)
    ]
    xfail = sum(1 for k in known if k.get("verdict") == "xfail")
    extra = [f"{not_run} not run"] * bool(not_run) + [f"{xfail} xfail"] * bool(xfail)
    ok = bool(doc.get("passed"))
    return {
        "sweep": str(doc.get("sweep") or results_dir.name),
        "passed": ok,
        # never plain green while a check could not run or a known bug was hit
        "verdict": ", ".join(["PASSED", *extra]) if ok else "FAILED",
        "verdict_class": ("partial" if extra else "passed") if ok else "failed",
        "known_issues": known,
        "n_passed": passed,
        "n": len(configs_doc),
        "provisional": doc.get("provisional"),
        "started": when(min(starts)) if starts else None,
        "total_s": sum(float(c.get("total_seconds") or 0.0) for c in configs_doc),
        "rendered": when(time.time()),
        "schema": doc.get("schema", 1),
        "columns": columns,
        "configs": configs,
        "environment": environment_rows(doc.get("environment") or {}),
        "facts": run_facts(doc, configs_doc),
        "left_out": [e for e in doc.get("left_out") or [] if isinstance(e, Mapping)],
        "skipped": list(doc.get("skipped_checks") or []),
        "overrides": list(doc.get("overrides") or []),
    }


def check_columns(expected: Sequence[str], configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The matrix's columns: the checks the sweep expected, then any other a config ran (a
    user's exec[N]), in the order first seen."""
    out = [str(n) for n in expected]
    for c in configs:
        for k in c.get("checks") or []:
            if k.get("name") not in out:
                out.append(str(k.get("name")))
    return out


def config_model(i: int, c: Mapping[str, Any], columns: Sequence[str], results_dir: Path) -> Config:
    by_name = {k.get("name"): k for k in c.get("checks") or []}
    checks = [check_model(k) for k in c.get("checks") or []]
    processes = [p for p in c.get("processes") or [] if isinstance(p, Mapping)]
    hosts: dict[str, list[str]] = {}
    for p in processes:
        hosts.setdefault(str(p.get("host")), []).append(str(p.get("name")))
    return Config(
        anchor=f"config-{i}",
        doc=c,
        cells=[cell_model(by_name[n]) if n in by_name else None for n in columns],
        checks=checks,
        timeline=timeline(c),
        placement=sorted(hosts.items()) if len(hosts) > 1 else [],
        error=cap(str(c.get("error") or ""), MESSAGE_CHARS),
        badge=outcome_label(c),
        phases=[
            (p, float(s)) for p in PHASES if isinstance(s := (c.get("phases") or {}).get(p), (int, float))
        ],
        logs=log_files(c, results_dir),
    )


def cell_model(k: Mapping[str, Any]) -> dict[str, str]:
    """A matrix cell: the verdict, the message as its tooltip."""
    return {"verdict": str(k.get("verdict", "?")), "message": cap(str(k.get("message", "")), TITLE_CHARS)}


def outcome_label(c: Mapping[str, Any]) -> tuple[str, str]:
    """A config's badge: its text ("PASSED, 2 NOT RUN" when checks could not run: never plain
    green then) and its CSS class."""
    outcome = str(c.get("outcome", "?"))
    n = len(c.get("not_run") or [])
    x = sum(1 for k in c.get("known_issues") or [] if isinstance(k, Mapping) and k.get("verdict") == "xfail")
    extra = [f"{n} NOT RUN"] * bool(n) + [f"{x} XFAIL"] * bool(x)
    if outcome == PASSED and extra:
        return ", ".join(["PASSED", *extra]), "partial"
    return outcome.upper(), outcome.replace(" ", "-")


def check_model(k: Mapping[str, Any]) -> dict[str, Any]:
    tables = []
    for t in k.get("tables") or []:
        rows = list(t.get("rows") or [])
        tables.append(
            {
                "title": t.get("title", ""),
                "columns": list(t.get("columns") or []),
                "rows": [[cell(v) for v in r] for r in rows[:TABLE_ROWS]],
                "more": max(0, len(rows) - TABLE_ROWS),
            }
        )
    return {
        "name": k.get("name", "?"),
        "verdict": k.get("verdict", "?"),
        "message": cap(str(k.get("message", "")), MESSAGE_CHARS),
        "seconds": k.get("seconds"),
        "figures": [
            (f.get("name", ""), value_text(f.get("value"), f.get("unit", ""))) for f in k.get("figures") or []
        ],
        "tables": tables,
    }


def cap(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + f" ... ({len(text) - n} more characters in result.json)"


def cell(v: Any) -> str:
    return cap(value_text(v, ""), CELL_CHARS)


def value_text(v: Any, unit: str) -> str:
    """A figure as read: 1234567 bytes -> "1.2 MiB", 0.51234 s -> "0.512 s", True -> "yes"."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)) and unit == "bytes":
        return human_bytes(float(v))
    if isinstance(v, float):
        text = f"{v:.4g}" if abs(v) < 1e6 else f"{v:,.0f}"
    elif isinstance(v, int):
        text = f"{v:,}" if abs(v) >= 10000 else str(v)
    else:
        text = str(v)
    return f"{text} {unit}" if unit else text


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # not reached


def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def environment_rows(env: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """(component, version, distribution, where from) for Python, torch, vLLM, the router, the
    connectors, lm_eval and pd-sessions, from envfacts' document."""
    rows = []
    py = env.get("python") or {}
    if py:
        rows.append(("python", str(py.get("version", "?")), "", str(py.get("executable", ""))))
    t = env.get("torch")
    if isinstance(t, Mapping):
        build = (
            ""
            if not t.get("build_known")
            else f"CUDA {t['cuda']}"
            if t.get("cuda")
            else f"ROCm {t['hip']}"
            if t.get("hip")
            else "CPU"
        )
        rows.append(("torch", str(t.get("version", "?")), build, str(t.get("location", ""))))
    for name, m in (env.get("modules") or {}).items():
        if not isinstance(m, Mapping):
            rows.append((str(name), "not installed", "", ""))
            continue
        dist = str(m.get("dist") or "")
        if m.get("editable"):
            dist += f" (editable checkout {m['editable']})"
        rows.append((str(name), str(m.get("version") or "?"), dist, str(m.get("location") or "")))
    return rows


def run_facts(doc: Mapping[str, Any], configs: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The run's facts beside the environment: lane, hosts, GPUs, cores, pd-sessions."""
    hosts = sorted({str(p.get("host")) for c in configs for p in c.get("processes") or [] if p.get("host")})
    gpus = doc.get("gpus") or []
    facts = [
        ("lane", str(doc.get("platform") or "?")),
        ("host", str(doc.get("hostname") or "?")),
        ("addresses served on", ", ".join(hosts) or "-"),
        ("GPUs", ", ".join(map(str, gpus)) if gpus else "none"),
        ("CPU cores", str(doc.get("cpus") or "?")),
        ("pd-sessions", str(doc.get("pd_sessions") or "?")),
    ]
    if doc.get("accuracy_mode"):
        facts.append(("accuracy mode", str(doc["accuracy_mode"])))
    return facts


def timeline(c: Mapping[str, Any]) -> Timeline | None:
    """The config's phases (one row), each process from spawn to ready, each check, placed on one
    axis from the config's start; None when nothing recorded a start (not run, schema 1)."""
    t0 = c.get("started_at")
    if not isinstance(t0, (int, float)):
        return None
    bars: list[Bar] = []
    rows = ["phases"]
    starts = c.get("phase_starts") or {}
    phases = c.get("phases") or {}
    for name in PHASES:
        if name in starts and name in phases:
            bars.append(Bar(0, "phase", name, starts[name] - t0, float(phases[name]), state=name))
    teardown_at = starts.get("teardown")
    for p in c.get("processes") or []:
        if not isinstance(p.get("started_at"), (int, float)):
            continue
        start = p["started_at"] - t0
        ready = p.get("ready_s")
        if ready is None:  # never noticed ready: drawn up to the teardown, if any
            end = (teardown_at - t0) if isinstance(teardown_at, (int, float)) else start
            bars.append(
                Bar(len(rows), "process", str(p.get("name")), start, max(end - start, 0.0), "never-ready")
            )
        else:
            bars.append(Bar(len(rows), "process", str(p.get("name")), start, float(ready), "ready"))
        rows.append(str(p.get("name")))
    for k in c.get("checks") or []:
        if not isinstance(k.get("started_at"), (int, float)):
            continue
        bars.append(
            Bar(
                len(rows),
                "check",
                str(k.get("name")),
                k["started_at"] - t0,
                float(k.get("seconds") or 0.0),
                str(k.get("verdict")),
            )
        )
        rows.append(str(k.get("name")))
    if not bars:
        return None
    total = max(max(b.start_s + b.seconds for b in bars), 1e-3)
    scale = PLOT_W / total
    for b in bars:
        b.place(scale)
    step = tick_step(total)
    ticks = [(LABEL_W + i * step * scale, f"{i * step:g} s") for i in range(int(total // step) + 1)]
    return Timeline(bars, rows, ticks, LABEL_W + PLOT_W + 70, AXIS_H + len(rows) * ROW_H + 4, total)


def tick_step(total: float) -> float:
    """A round step giving at most 8 ticks over ``total`` seconds."""
    for step in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600):
        if total / step <= 8:
            return float(step)
    return float(math.ceil(total / 8 / 3600) * 3600)


def log_files(c: Mapping[str, Any], results_dir: Path) -> list[LogFile]:
    """Every log in the config's run directory, linked; with its tail when the config did not pass
    (the logs of processes named in the failure first)."""
    run_dir = locate_run_dir(c, results_dir)
    if run_dir is None:
        return []
    failed = c.get("outcome") != PASSED
    error = str(c.get("error") or "")  # names the process that died or never got ready
    order = {str(p.get("log")): i for i, p in enumerate(c.get("processes") or [])}
    words = set(re.findall(r"[\w.-]+", error))
    named = {p.name for p in run_dir.glob("*.log") if p.stem in words}
    logs = sorted(
        run_dir.glob("*.log"), key=lambda p: (p.name not in named, order.get(p.name, len(order)), p.name)
    )
    out = []
    for i, path in enumerate(logs):
        try:
            size = human_bytes(path.stat().st_size)
        except OSError:
            size = "?"
        entry = LogFile(path.name, link(path, results_dir), size, named=path.name in named)
        if failed and i < LOGS_WITH_TAILS:
            lines = log_tail(path, TAIL_LINES).splitlines()
            entry.tail = "\n".join(cap(line, LINE_CHARS) for line in lines)
        out.append(entry)
    return out


def locate_run_dir(c: Mapping[str, Any], results_dir: Path) -> Path | None:
    """The config's run directory: where result files put it, or (a results directory that was
    moved or copied) its folder of the same name below ``results_dir``."""
    recorded = str(c.get("run_dir") or "")
    for candidate in ([Path(recorded)] if recorded else []) + [
        results_dir / Path(recorded or str(c.get("name"))).name
    ]:
        if candidate.is_dir() and is_below(candidate, results_dir):
            return candidate
    return None


def is_below(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def link(path: Path, results_dir: Path) -> str | None:
    """A relative link from the page to ``path`` (each segment percent-quoted), or None when
    ``path`` is not below the results directory."""
    try:
        rel = path.resolve().relative_to(results_dir.resolve())
    except ValueError:
        return None
    if any(part in ("", ".", "..") for part in rel.parts):
        return None
    return "/".join(quote(part, safe="") for part in rel.parts)


# ---------------------------------------------------------------- reading and writing


def load(results_dir: Path) -> dict[str, Any]:
    """The summary document of ``results_dir``: summary.json, else one assembled from the
    configs' result.json files (a run killed before its first summary). UsageError (exit 2)
    when there is neither."""
    summary = results_dir / "summary.json"
    if summary.is_file():
        try:
            return dict(json.loads(summary.read_text()))
        except ValueError as e:
            raise UsageError(f"{summary}: not valid JSON ({e}); nothing to render") from None
    configs = []
    for path in sorted(results_dir.glob("*/result.json")):
        try:
            configs.append(json.loads(path.read_text()))
        except ValueError:
            continue
    if not configs:
        raise UsageError(
            f"{results_dir}: no summary.json and no */result.json: give a results directory a sweep wrote"
        )
    return {"schema": SCHEMA_VERSION, "sweep": results_dir.name, "passed": False, "configs": configs}


@functools.cache
def template() -> Any:
    """The page's template, compiled once per process (a sweep renders the page as each config
    starts and ends). Jinja2 is imported here only: nothing else in a run needs it."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE.parent), autoescape=True, trim_blocks=True, lstrip_blocks=True
    )
    return env.get_template(TEMPLATE.name)


def render(doc: Mapping[str, Any], results_dir: Path) -> str:
    """The page for ``doc`` (summary.json's shape), its links relative to ``results_dir``."""
    return str(
        template().render(
            page=page_model(doc, results_dir), BAR_H=BAR_H, ROW_H=ROW_H, AXIS_H=AXIS_H, LABEL_W=LABEL_W
        )
    )


def write(results_dir: Path, doc: Mapping[str, Any] | None = None) -> Path:
    """Render ``doc`` (default: what ``results_dir`` holds) into ``results_dir/report.html``,
    replacing it whole (a reader never sees half a page)."""
    html = render(doc if doc is not None else load(results_dir), results_dir)
    path = results_dir / PAGE
    tmp = path.with_name(f".{PAGE}.tmp")
    tmp.write_text(html, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_or_log(results_dir: Path) -> Path | None:
    """:func:`write` from what ``results_dir`` holds; a page that cannot be written is logged (with
    its traceback) and None returned: the result files beside it stand without it."""
    try:
        return write(results_dir)
    except Exception:  # a bug in the page must not cost the run its results
        log.warning("%s could not be written", results_dir / PAGE, exc_info=True)
        return None
