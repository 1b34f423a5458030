"""What a stopped or broken sweep still records: every way out leaves summary.json,
summary.txt, junit.xml and report.html.

- A cancel (Ctrl-C, SIGTERM, the parent gone): configs that finished keep their results; the
  one it interrupted is ``cancelled`` (its finished checks kept, the rest errors of type
  Cancelled in junit.xml); those never started are ``not run`` (skipped in junit.xml).
- A hard kill (SIGKILL: nothing runs after it): the summary is also written, provisionally, as
  each config starts and ends, with the config under way marked ``cancelled`` and the rest
  ``not run``, so the last one written stands.
- Refused before anything starts: a results directory that cannot be written (exit 2), and
  ``--deadline``/``--grace`` of 0 or below (exit 2).

Pure decisions first; the two writers at the end.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pd_sessions.core.cliargs import positive_seconds  # noqa: F401  (the sweep's --deadline/--grace type)
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import UsageError
from pd_sessions.core.results import CANCELLED, NOT_RUN, RUNNING, ConfigResult
from pd_sessions.report import html
from pd_sessions.report.writers import write_junit, write_summary

# What a provisional summary says (see Provisional): still there, it means pd-sessions was killed.
KILLED_RUNNING = (
    "cancelled: pd-sessions ended while this config ran, without recording how "
    "(killed with SIGKILL?); this record was written when the config started"
)
KILLED = "pd-sessions ended early, without recording why (killed with SIGKILL?)"


def stop_cause(exc: BaseException) -> str:
    """Why the sweep stopped, from the exception that stopped it.

    | exc                                         | cause                          |
    | KeyboardInterrupt                           | "interrupted (SIGINT)"         |
    | anything with a message (the CLI's Stopped) | its message: "stopped by SIGTERM" |
    | anything else                               | its class name                 |
    """
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (SIGINT)"
    return str(exc) or type(exc).__name__


def interrupted_while(res: ConfigResult) -> str:
    """Which part of a config a stop cut short, from the phases it reached (each phase is
    recorded when it ends, also when it is cut short).

    | phases recorded       | said                              |
    | "checks"              | "while checks ran"                |
    | "plan" (not "checks") | "while the cluster was starting"  |
    | none                  | "while it was being planned"      |
    """
    if "checks" in res.phases:
        return "while checks ran"
    if "plan" in res.phases:
        return "while the cluster was starting"
    return "while it was being planned"


def cancel(res: ConfigResult, cause: str) -> None:
    """Mark ``res`` cancelled by ``cause``, saying where it was cut short; its finished checks
    are kept."""
    done = ", ".join(c.name for c in res.checks) or "none"
    res.outcome = CANCELLED
    res.error = (
        f"cancelled: {cause} {interrupted_while(res)}, {res.total_seconds:.1f} s in; "
        f"checks finished before that: {done}"
    )


def not_run(config: ClusterConfig, platform: str, cause: str) -> ConfigResult:
    return ConfigResult(
        name=config.name,
        shape=config.shape,
        connector=config.connector,
        platform=platform,
        outcome=NOT_RUN,
        error=f"not run: the sweep stopped before this config started ({cause})",
    )


def complete(
    configs: Sequence[ClusterConfig], results: Sequence[ConfigResult], *, platform: str, cause: str
) -> list[ConfigResult]:
    """One record per config, in the sweep's order: its record in ``results`` (a ``running`` one
    becomes cancelled by ``cause``: configs run side by side may be several), else a ``not run``
    one; records of no config in ``configs`` come last. ``results`` is not changed."""
    out = {r.name: dataclasses.replace(r) for r in results}
    for r in out.values():
        if r.outcome == RUNNING:
            cancel(r, cause)
    ordered = [out.pop(c.name) if c.name in out else not_run(c, platform, cause) for c in configs]
    return ordered + list(out.values())


def check_writable(results_dir: Path) -> None:
    """UsageError (exit 2) unless ``results_dir`` can be created and written: said before
    anything starts, rather than after a sweep whose results cannot be kept."""
    probe = results_dir / ".pd-sessions-write-test"
    try:
        results_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(
            f"--results-dir: cannot write to {results_dir} ({e.strerror or e}); "
            "give a directory you can write to"
        ) from None
    if not os.access(results_dir, os.W_OK | os.X_OK):
        raise UsageError(f"--results-dir: cannot write to {results_dir}; give a directory you can write to")


def write_all(
    results: Sequence[ConfigResult],
    results_dir: Path,
    meta: dict[str, object],
    *,
    suite: str,
    checks: Sequence[str],
    skipped: Sequence[str],
) -> Path | None:
    """summary.json, summary.txt, junit.xml and report.html for ``results``; the page's path
    (None if it could not be written: logged)."""
    write_summary(results, results_dir, meta)
    write_junit(
        results, results_dir / "junit.xml", suite=suite, expected_checks=checks, skipped_checks=skipped
    )
    return html.write_or_log(results_dir)


class Provisional:
    """Writes the summary as each config starts and ends (``run_sweep``'s ``on_change``), so a
    sweep killed with SIGKILL still leaves one; the final write replaces it."""

    def __init__(
        self,
        configs: Sequence[ClusterConfig],
        results_dir: Path,
        *,
        suite: str,
        platform: str,
        checks: Sequence[str],
        skipped: Sequence[str],
        meta: Mapping[str, Any] | None = None,
    ):
        """``meta``: what the final summary records (overrides, environment...); kept here too."""
        self.configs = list(configs)
        self.results_dir = results_dir
        self.meta = {
            **(meta or {}),
            "sweep": suite,
            "platform": platform,
            "provisional": "written while the sweep ran; the sweep did not finish",
        }
        self.kw = {"suite": suite, "checks": checks, "skipped": skipped}
        self.platform = platform

    def __call__(self, results: Sequence[ConfigResult]) -> None:
        done = [
            dataclasses.replace(r, outcome=CANCELLED, error=KILLED_RUNNING) if r.outcome == RUNNING else r
            for r in results
        ]
        done = complete(self.configs, done, platform=self.platform, cause=KILLED)
        write_all(done, self.results_dir, self.meta, **self.kw)  # type: ignore[arg-type]


def crash_log(run_dir: Path, name: str, exc: BaseException) -> Path:
    """Append ``exc``'s traceback to ``run_dir/<name>.log``; that path."""
    path = run_dir / f"{name}.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(traceback.format_exception(exc)))
    return path
