"""``pd-sessions soak [SWEEP] --cycles N``: leaks across restarts, as a sweep of its own (`nox -s soak`).

A sweep (default: the built-in NIXL sweep's 1x1) whose checks are smoke, the soak and the KV digest
(checks/soak.py: N cycles of the prefill and the decode restarted in place, parity and the digest
after each restart, the growth per cycle of each process's fds, threads, RSS and KV blocks in use
bounded). Everything a sweep writes is written (summary.json, junit.xml, report.html, each config's
result.json: the soak's per-cycle figures are its tables); then the per-cycle table and the
verdict are printed. Exit status as the sweep's, run with --strict: 0 passed (an XFAIL, a known
upstream bug, included), 1 failed (a FAIL, an XPASS, or a check NOT RUN), 2 refused.

Why NIXL: restart in place over Mooncake is a known upstream bug (configs/known_issues.toml,
router-stale-mooncake-engine-id): P/D never answers again after the prefill restarts, so a soak
there could judge no cycle (the check says NOT RUN citing it). Over NIXL the restarts work.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pd_sessions.core import connectors
from pd_sessions.core.errors import UsageError
from pd_sessions.run import sweep
from pd_sessions.runtime.console import say

SWEEP = connectors.SOAK.sweep  # the built-in sweep of the connector the soak runs over
CONFIG = "1x1"
CHECKS = ("smoke", "soak", "kv_digest")


def soak_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` of ``pd-sessions soak`` as the sweep's: the soak's checks (unless ``--set checks=``
    names others), its cycles, the 1x1 (unless ``--only``), results under results/soak-<time>,
    and --strict: a check NOT RUN fails the config."""
    if args.cycles < 1:
        raise UsageError(f"--cycles {args.cycles}: give 1 or more restart cycles (CI runs 3)")
    fields = list(args.set_fields)
    if not any(f.split("=", 1)[0].strip() == "checks" for f in fields):
        fields.append("checks=[" + ", ".join(f'"{c}"' for c in CHECKS) + "]")
    fields.append(f"check_options.soak.cycles={args.cycles}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return argparse.Namespace(
        **{
            **vars(args),
            "sweep": args.sweep or SWEEP,
            "set_fields": fields,
            "strict": True,  # a soak that could not look (NOT RUN) fails: this run is for it
            "only": args.only or [CONFIG],
            "results_dir": args.results_dir or Path("results") / f"soak-{stamp}",
        }
    )


def run(args: argparse.Namespace) -> int:
    """The sweep, then the soak's per-cycle table and verdict of each config."""
    swept = soak_args(args)
    rc = sweep.run(swept)
    if swept.dry_run:
        return rc
    summary = Path(swept.results_dir) / "summary.json"
    try:
        configs = json.loads(summary.read_text()).get("configs", [])
    except (OSError, ValueError) as e:
        say(f"soak: no summary to read ({summary}: {e})")
        return rc or 1
    for line in report_lines(configs):
        say(line)
    return rc


def report_lines(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each config's soak: the per-cycle table, the restarts, the mean per cycle against the
    bounds, and the verdict; a config without a soak result says so."""
    out: list[str] = []
    for c in configs:
        got = [k for k in c.get("checks", []) if k.get("name") == "soak"]
        if not got:
            out.append(
                f"{c.get('name')}: soak did not run ({c.get('outcome')}: {c.get('error') or 'no result'})"
            )
            continue
        k = got[0]
        for t in k.get("tables", []):
            out += ["", f"{c.get('name')}: {t['title']}", *render(t["columns"], t["rows"])]
        d = k.get("details", {})
        bounds = d.get("bounds_per_cycle", {})
        rows = [[n, *(per.get(r) for r in bounds)] for n, per in sorted(d.get("mean_growth", {}).items())]
        rows.append(["bound", *bounds.values()])
        out += ["", f"{c.get('name')}: mean growth per cycle", *render(["process", *bounds], rows)]
        out += ["", f"{c.get('name')}: soak {str(k.get('verdict')).upper()}: {k.get('message')}"]
    return out


def render(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A fixed-width table (numbers with a sign where they are growth, '-' for none)."""
    cells = [[str(c) for c in columns]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)
