"""Results: one record per config, rendered as a table and JSON files."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pd_sessions.core.results import (
    CANCELLED,
    ERROR,
    NOT_RUN,
    PASSED,
    PHASES,
    SCHEMA_VERSION,
    XFAIL,
    XPASS,
    CheckResult,
    ConfigResult,
)
from pd_sessions.runtime.logtail import log_tail


def table(results: Sequence[ConfigResult]) -> str:
    """Fixed-width summary: config, outcome, checks, seconds per phase."""
    head = ["config", "outcome", "checks", *PHASES, "total"]
    rows = [head]
    for r in results:
        checks = " ".join(f"{c.name}:{c.verdict.replace(' ', '-')}" for c in r.checks) or "-"
        rows.append(
            [
                r.name,
                r.label.upper(),
                checks,
                *(f"{r.phases[p]:.1f}" if p in r.phases else "-" for p in PHASES),
                f"{r.total_seconds:.1f}",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + known_issue_lines(results))


def known_issue_lines(results: Sequence[ConfigResult]) -> list[str]:
    """Every known upstream bug a check hit (XFAIL: still broken; XPASS: fixed, retire it), with
    its link; [] when none was hit."""
    hits = [(r.name, k) for r in results for k in r.known_issues]
    if not hits:
        return []
    return ["", "known upstream bugs hit (pd_sessions/configs/known_issues.toml):"] + [
        f"  {name} {k['check']}: {k['verdict'].upper()} {k['id']}: {k['link']}"
        + ("  <- fixed: retire the entry" if k["verdict"] == XPASS else "")
        for name, k in hits
    ]


def write_config_result(r: ConfigResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r.to_dict(), indent=2) + "\n")


def write_summary(results: Sequence[ConfigResult], results_dir: Path, meta: dict[str, Any]) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / "summary.json"
    doc = {
        "schema": SCHEMA_VERSION,
        **meta,
        "passed": all(r.outcome == PASSED for r in results) and bool(results),
        "not_run": sum(len(r.not_run) for r in results),
        "xfail": sum(1 for r in results for c in r.checks if c.verdict == XFAIL),
        "xpass": sum(1 for r in results for c in r.checks if c.verdict == XPASS),
        "known_issues": [{"config": r.name, **k} for r in results for k in r.known_issues],
        "configs": [r.to_dict() for r in results],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    (results_dir / "summary.txt").write_text(table(results) + "\n")
    return path


def _logs_tail(run_dir: str, lines: int = 20) -> str:
    parts = []
    for log in sorted(Path(run_dir).glob("*.log")) if run_dir else []:
        parts.append(f"--- {log.name} (last {lines} lines) ---\n{log_tail(log, lines)}")
    return "\n".join(parts)


def write_junit(
    results: Sequence[ConfigResult],
    path: Path,
    *,
    suite: str,
    expected_checks: Sequence[str],
    skipped_checks: Sequence[str] = (),
) -> Path:
    """One test case per config and check; a failing check is a <failure> with its message
    and the logs' tails; a known upstream bug still broken (XFAIL) is <skipped> (type pytest.xfail)
    naming the entry and its link, one fixed (XPASS) a <failure> (type KnownIssueFixed) with the
    retire message; a check that could not run (NOT RUN) is <skipped> with its reason, or a
    <failure> (type RequiredNotRun) when the sweep required it or --strict was given; a check that
    never ran because the config errored or was cancelled is an <error> (type ConfigError /
    Cancelled); a config never started is <skipped> ("not run")."""
    cases = []
    for r in results:
        by_name = {c.name: c for c in r.checks}
        for name in expected_checks:
            case = ET.Element("testcase", classname=f"{suite}.{r.name}", name=name)
            c = by_name.get(name)
            if c is not None:
                case.set("time", f"{c.seconds:.3f}")
                if c.not_run and c.name in r.unmet_checks:
                    why = r.unmet[r.unmet_checks.index(c.name)]
                    f = ET.SubElement(case, "failure", message=why[:500], type="RequiredNotRun")
                    f.text = why
                elif c.not_run:
                    ET.SubElement(case, "skipped", message=f"not run: {c.message}"[:500])
                elif c.verdict == XFAIL:  # as pytest writes an xfail: skipped, naming the issue
                    ET.SubElement(case, "skipped", message=f"xfail: {c.message}"[:500], type="pytest.xfail")
                elif c.verdict == XPASS:
                    f = ET.SubElement(case, "failure", message=c.message[:500], type="KnownIssueFixed")
                    f.text = c.message
                elif not c.passed:
                    f = ET.SubElement(case, "failure", message=c.message[:500], type="CheckFailed")
                    trace = c.details.get("traceback") if isinstance(c.details, dict) else None
                    f.text = f"{c.message}\n\n" + (f"{trace}\n" if trace else "") + _logs_tail(r.run_dir)
            elif r.outcome == NOT_RUN:  # never started: nothing failed, nothing to show
                ET.SubElement(case, "skipped", message=(r.error or "not run")[:500])
            else:
                kind = {ERROR: "ConfigError", CANCELLED: "Cancelled"}.get(r.outcome, "NotRun")
                e = ET.SubElement(
                    case, "error", message=(r.error or "did not run").splitlines()[0][:500], type=kind
                )
                e.text = f"{r.error or 'did not run'}\n\n{_logs_tail(r.run_dir)}"
            cases.append(case)
        for c in r.checks:  # test cases from the JUnit a user command wrote (--exec, --pytest)
            cases += external_cases(c, classname=f"{suite}.{r.name}.{c.name}")
        for name in skipped_checks:
            case = ET.Element("testcase", classname=f"{suite}.{r.name}", name=name)
            ET.SubElement(case, "skipped", message="skipped by request (--skip-check)")
            cases.append(case)
    failures = sum(1 for c in cases if c.find("failure") is not None)
    errors = sum(1 for c in cases if c.find("error") is not None)
    root = ET.Element("testsuites")
    skips = sum(1 for c in cases if c.find("skipped") is not None)
    ts = ET.SubElement(
        root,
        "testsuite",
        name=suite,
        tests=str(len(cases)),
        failures=str(failures),
        errors=str(errors),
        skipped=str(skips),
    )
    ts.extend(cases)
    for el in root.iter():  # log tails and model output may hold characters XML 1.0 forbids
        el.text = xml_safe(el.text) if el.text else el.text
        for k, v in el.attrib.items():
            el.set(k, xml_safe(v))
    ET.indent(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
    return path


_XML_INVALID = re.compile("[^\x09\x0a\x0d\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_safe(text: str) -> str:
    """``text`` with the characters XML 1.0 cannot hold (ANSI escapes, NUL...) written as ``\\xNN``."""
    return _XML_INVALID.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def external_cases(check: CheckResult, *, classname: str) -> list[ET.Element]:
    """The test cases of the JUnit file a check's command wrote (``details["junit"]["path"]``),
    their classname prefixed with ``classname``; [] when there is none or it cannot be read
    (the check's own test case still carries the verdict)."""
    path = (check.details.get("junit") or {}).get("path")
    if not path:
        return []
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for case in root.iter("testcase"):
        case.set("classname", f"{classname}.{case.get('classname', '')}".rstrip("."))
        out.append(case)
    return out
