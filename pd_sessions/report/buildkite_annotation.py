"""Buildkite: the annotation (the summary table and a link to report.html) and, for steps
without ``artifact_paths``, the upload of the results directory.

Both need ``buildkite-agent`` on PATH (it is, in a Buildkite job; inside a container only where
the agent is mounted) and do nothing without it. The link is the form Buildkite documents for
artifacts in annotations (``<a href="artifact://PATH">``), PATH being the artifact's path as
uploaded: relative to the job's working directory, where the agent runs.

Who uploads the results directory, once: the standalone pipeline's steps name it in
``artifact_paths`` (the agent uploads it after the command); vLLM's test_areas format has no such
field, so those steps pass ``--upload-artifacts`` and the sweep uploads it itself as it ends
(pd_sessions/report/buildkite_pipelines.py; a test keeps each step to one of the two).
"""

from __future__ import annotations

import html
import logging
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from pd_sessions.core.results import PASSED, XFAIL, XPASS, ConfigResult
from pd_sessions.report.writers import table

log = logging.getLogger(__name__)

AGENT = "buildkite-agent"


def artifact_path(path: Path, cwd: Path | None = None) -> str:
    """``path`` as ``buildkite-agent artifact upload`` run in ``cwd`` records it: relative to
    ``cwd`` when below it, else as given."""
    base = (cwd or Path.cwd()).resolve()
    try:
        return path.resolve().relative_to(base).as_posix()
    except ValueError:
        return path.resolve().as_posix()


def annotation(results: Sequence[ConfigResult], *, sweep: str, page: str | None) -> str:
    """The annotation's Markdown: the verdict, the link to the page (``page``: its artifact
    path) and the summary table."""
    ok = all(r.outcome == PASSED for r in results) and bool(results)
    not_run = sum(len(r.not_run) for r in results)
    known = [(r.name, k) for r in results for k in r.known_issues]
    xfail = sum(1 for _, k in known if k["verdict"] == XFAIL)
    extra = [f"{not_run} not run"] * bool(not_run) + [f"{xfail} xfail"] * bool(xfail)
    verdict = ", ".join(["passed", *extra]) if ok else "FAILED"
    link = (
        f' &middot; <a href="artifact://{html.escape(page, quote=True)}">report.html</a> '
        "(timeline, figures, log tails)"
        if page
        else ""
    )
    hits = "".join(
        f"- {html.escape(name)} `{k['check']}`: **{k['verdict'].upper()}** known issue `{k['id']}`: "
        f'<a href="{html.escape(str(k["link"]), quote=True)}">{html.escape(str(k["link"]))}</a>'
        + (" (fixed: retire the entry)" if k["verdict"] == XPASS else "")
        + "\n"
        for name, k in known
    )
    hits = f"\nKnown upstream bugs hit:\n\n{hits}" if hits else ""
    return f"**{html.escape(sweep)}**: {verdict}{link}\n\n```\n{table(results)}\n```\n{hits}"


def annotate(results: Sequence[ConfigResult], *, sweep: str, page: Path | None) -> bool:
    """Add (or replace: one context per sweep) the annotation when buildkite-agent is on PATH.

    Returns whether an annotation was made; without the agent nothing happens."""
    agent = shutil.which(AGENT)
    if agent is None:
        return False
    ok = all(r.outcome == PASSED for r in results) and bool(results)
    partial = any(r.not_run or r.known_issues for r in results)
    style = ("warning" if partial else "success") if ok else "error"
    body = annotation(results, sweep=sweep, page=artifact_path(page) if page else None)
    subprocess.run(
        [agent, "annotate", "--style", style, "--context", f"pd-sessions-{sweep}"],
        input=body,
        text=True,
        check=False,
    )
    return True


def upload(results_dir: Path) -> str:
    """``buildkite-agent artifact upload 'DIR/**/*'``; what happened, in one line."""
    agent = shutil.which(AGENT)
    if agent is None:
        return (
            f"results not uploaded: {AGENT} is not on PATH (not a Buildkite job, or a container without it)"
        )
    pattern = f"{artifact_path(results_dir)}/**/*"
    rc = subprocess.run([agent, "artifact", "upload", pattern], check=False).returncode
    if rc != 0:
        log.warning("%s artifact upload %s exited with status %d", AGENT, pattern, rc)
        return f"results upload failed: `{AGENT} artifact upload {pattern}` exited with status {rc}"
    return f"results uploaded as Buildkite artifacts: {pattern}"
