"""The bench's report part (pd_sessions/bench/page.py): the page of a 6-config sweep built from
real result files, timed in a fresh interpreter, and its goals in results.md."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pd_sessions.bench import bench_results, page
from pd_sessions.core.errors import BenchError
from pd_sessions.core.results import CheckResult, ConfigResult
from pd_sessions.report import unfinished


def results_dir(tmp_path: Path) -> Path:
    out = tmp_path / "r"
    r = ConfigResult("1x1", "s", "mooncake", "cpu", outcome="passed", started_at=1.0e9)
    r.run_dir = str(out / "1x1")
    r.checks = [CheckResult("smoke", "pass", "ok", started_at=1.0e9 + 1)]
    (out / "1x1").mkdir(parents=True)
    (out / "1x1" / "prefill-0.log").write_text("INFO started\n" * 100)
    unfinished.write_all([r], out, {"sweep": "s"}, suite="s", checks=["smoke"], skipped=[])
    return out


@pytest.mark.procs
def test_the_report_part_measures_a_six_config_page(tmp_path: Path):
    doc = page.run(results_dir(tmp_path), tmp_path / "work", repeats=1, progress=lambda m: None)
    assert doc["configs"] == 6 and doc["cold_s"]["n"] == 1 and doc["warm_s"]["n"] == 3
    text = Path(doc["page"]).read_text()
    assert text.count('class="config-row"') == 6 and text.count('class="log-tail"') == 6  # all failed
    assert doc["page_bytes"] == len(text.encode())
    assert bench_results.page_markdown(doc)[0].startswith("## report.html of 6 configs")
    names = [g.name for g in bench_results.goals({"report_page": doc})]
    assert names == ["report.html: rendering adds to a run", "report.html: size for 6 configs"]


def test_the_report_part_needs_real_run_directories(tmp_path: Path):
    src = results_dir(tmp_path)
    shutil.rmtree(src / "1x1")
    with pytest.raises(BenchError, match="no config with its run directory there"):
        page.six_configs(src, tmp_path / "work")
