"""The perf check on the CPU lane, once in CI: it runs in the shared NIXL sweep (conftest's
nixl_sweep, where `--set checks=[..., "perf"]` adds it), and these tests read what it recorded.
No cluster of its own."""

from __future__ import annotations

import json

import pytest
from helpers.e2e_runs import SweepRun

from pd_sessions.checks import perf_baselines

pytestmark = pytest.mark.e2e


def _perf(run: SweepRun) -> dict:
    return run.checks["perf"]


def test_perf_passes_with_pd_and_colocated_figures_at_both_levels(nixl_sweep: SweepRun):
    perf = _perf(nixl_sweep)
    assert perf["verdict"] == "pass", perf["message"]
    figures = {f["name"]: f for f in perf["figures"]}
    for c in (1, 8):
        for target in ("pd", "colocated"):
            for name in (
                "ttft_p50_ms",
                "ttft_p99_ms",
                "itl_p50_ms",
                "itl_p99_ms",
                "tpot_p50_ms",
                "tpot_p99_ms",
            ):
                f = figures[f"c{c}.{target}.{name}"]
                assert f["unit"] == "ms" and f["value"] > 0, f
            assert figures[f"c{c}.{target}.output_tok_s"]["value"] > 0
        assert figures[f"c{c}.ratio.ttft_p50"]["unit"] == "x" and figures[f"c{c}.ratio.ttft_p50"]["value"] > 0
    assert "c=1: TTFT p50" in perf["message"] and "c=8: TTFT p50" in perf["message"]
    assert any(c["name"] == "perf" for c in nixl_sweep.summary["configs"][0]["checks"])


def test_perf_figures_come_from_vllm_bench_serves_result_files(nixl_sweep: SweepRun):
    perf = _perf(nixl_sweep)
    folder = nixl_sweep.run_dir / "perf"
    runs = {(r["target"], r["concurrency"]): r["figures"] for r in perf["details"]["runs"]}
    for (target, c), figs in runs.items():
        doc = json.loads((folder / f"{target}-c{c}.json").read_text())
        assert doc["max_concurrency"] == c and doc["completed"] == doc["num_prompts"] == figs["completed"]
        assert figs["ttft_p50_ms"] == doc["p50_ttft_ms"] and figs["itl_p99_ms"] == doc["p99_itl_ms"]
    assert set(runs) == {("pd", 1), ("colocated", 1), ("pd", 8), ("colocated", 8)}


def test_the_ttft_split_and_the_link_ratio_are_measured(nixl_sweep: SweepRun):
    perf = _perf(nixl_sweep)
    details = perf["details"]
    split = {row[0]: row for row in perf["tables"][1]["rows"]}
    for figure in ("prefill compute", "prefill request", "KV transfer", "decode TTFT", "handover"):
        assert all(v is not None for v in split[figure][2:]), split[figure]
    assert split["KV transfer"][1].startswith("window mean per transfer")
    assert split["client TTFT p50"][1].startswith("per request")
    link = details["link"]
    assert link["transport"] == "NIXL agents (UCX), DRAM to DRAM" and len(link["seconds"]) == 10
    ratio = {f["name"]: f["value"] for f in perf["figures"]}["link_ratio"]
    assert 0 < ratio < 100  # effective / what the transport alone moves (noisy: never judged here)
    assert "% of what NIXL agents (UCX), DRAM to DRAM moves here" in perf["message"]


def test_a_baseline_far_above_todays_figures_fails_and_todays_passes(nixl_sweep: SweepRun):
    details = _perf(nixl_sweep)["details"]
    measured = details["baseline_figures"]
    key = tuple(details["baseline"]["key"].values())
    assert key == ("tiny-llama-remote", "nixl", "1x1", key[3]) and key[3].startswith("cpu, ")
    assert details["baseline"]["status"].startswith("no baseline")  # none recorded: nothing judged
    today = perf_baselines.from_entry(perf_baselines.new_entry(key, measured, source="today"))
    assert perf_baselines.judge(measured, [today], key)[0] is None
    above = {k: v * 1000 if k.endswith("tok_s") else v for k, v in measured.items()}
    far = perf_baselines.from_entry(perf_baselines.new_entry(key, above, source="far above"))
    message, _ = perf_baselines.judge(measured, [far], key)
    assert message and "c1.pd.output_tok_s" in message and "regressed beyond tolerance" in message
