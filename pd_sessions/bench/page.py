"""The bench's ``report`` part: what report.html costs a run, and how big it gets.

From a real results directory (``--report-from DIR``, or the first one this bench's cluster runs
wrote) it builds a 6-config sweep: each config a copy of a real one, logs and all, marked failed
so that every log's tail is on the page (the largest page a sweep of real configs makes). Then:

- cold: a fresh interpreter renders and writes the page (importing the writer and Jinja2,
  compiling the template), which is what a sweep's first page write adds to its run;
- warm: the page again in that process (each later write of the same run);
- the page's size.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pd_sessions.bench.stats import summary
from pd_sessions.core.errors import BenchError
from pd_sessions.report import html

CONFIGS = 6
PAGE_GOAL_S = 1.0  # what rendering may add to a run
PAGE_GOAL_BYTES = 2 * 1024 * 1024  # a 6-config sweep's page, log tails capped

# Run in a fresh interpreter: one cold write, then warm ones; prints their seconds as JSON.
TIMER = """
import json, sys, time
from pathlib import Path
t = time.perf_counter()
from pd_sessions.report import html
html.write(Path(sys.argv[1]))
times = [time.perf_counter() - t]
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    html.write(Path(sys.argv[1]))
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""


def six_configs(source: Path, work: Path) -> Path:
    """A results directory of CONFIGS configs copied from ``source``'s (round robin), each failed."""
    doc = html.load(source)
    real = [c for c in doc.get("configs") or [] if html.locate_run_dir(c, source) is not None]
    if not real:
        raise BenchError(f"--report-from {source}: no config with its run directory there")
    out = work / "six-configs"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    configs = []
    for i in range(CONFIGS):
        c = dict(real[i % len(real)])
        run_dir = out / f"{c['name']}-{i}"
        shutil.copytree(html.locate_run_dir(c, source), run_dir)  # type: ignore[arg-type]
        configs.append({**c, "name": run_dir.name, "run_dir": str(run_dir), "outcome": "failed"})
    (out / "summary.json").write_text(json.dumps({**doc, "passed": False, "configs": configs}))
    return out


def run(source: Path, work: Path, *, repeats: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Measure the page of a 6-config sweep built from ``source`` (``repeats`` cold starts)."""
    sweep = six_configs(source, work)
    progress(f"report part: report.html of {CONFIGS} configs copied from {source}, {repeats} cold starts")
    cold, warm = [], []
    root = str(Path(__file__).resolve().parents[2])
    for _ in range(repeats):
        r = subprocess.run(
            [sys.executable, "-c", TIMER, str(sweep), "3"],
            capture_output=True,
            text=True,
            cwd=root,
            check=False,
        )
        if r.returncode != 0:
            raise BenchError(f"rendering report.html failed: {r.stderr.strip()[-2000:]}")
        times = json.loads(r.stdout.strip().splitlines()[-1])
        cold.append(times[0])
        warm += times[1:]
    page = sweep / html.PAGE
    return {
        "source": str(source),
        "configs": CONFIGS,
        "cold_s": summary(cold),
        "warm_s": summary(warm),
        "page_bytes": page.stat().st_size,
        "page": str(page),
    }
