"""The perf check's own logic, on recorded inputs: vLLM's bench result files (0.26 from the H200,
0.32 from the CPU lane), /metrics scrapes, Mooncake's stats lines; the verdict, the baselines,
the selection (perf is a default on cuda only) and the bench driver's protocol."""

from __future__ import annotations

import json
import threading

import pytest
from helpers import FIXTURES

from pd_sessions.checks import perf, perf_baselines
from pd_sessions.checks import perf_figures as pf
from pd_sessions.core import check_registry as registry
from pd_sessions.core import connectors, selection, ucx
from pd_sessions.core.config import load as load_builtin
from pd_sessions.core.config import load_sweep, make_overrides
from pd_sessions.core.connectors.base import MetricEvidence
from pd_sessions.core.errors import ConfigError, PerfError
from pd_sessions.vllm_side import perf_driver

PERF = FIXTURES / "perf"
KEY = ("tiny-llama", "nixl", "1x1", "cpu, 2 cores")


def bench(name: str) -> dict:
    return json.loads((PERF / name).read_text())


def record(
    target: str, c: int, *, ttft: float, itl: float, tok_s: float, transfers=None, completed=8
) -> perf.RunRecord:
    pairs = (("ttft", ttft), ("itl", itl), ("tpot", itl), ("e2el", ttft + 10 * itl))
    figs = {f"{m}_{s}_ms": v for m, v in pairs for s in ("p50", "p99", "mean")}
    figs.update(
        output_tok_s=tok_s, request_s=tok_s / 16, completed=completed, failed=8 - completed, duration_s=1.0
    )
    return perf.RunRecord(target, c, figs, {"e2e": ttft / 2000}, {"ttft": ttft / 4000}, transfers)


TRANSFERS = pf.Transfers("decode /metrics", count=8, seconds=0.04, bytes=8 * 2**20, descriptors=16)
LINK = pf.LinkProbe("NIXL agents (UCX)", 2**20, 2, (0.002, 0.004, 0.003))


def records(**kw) -> list[perf.RunRecord]:
    return [
        record("pd", 1, ttft=40, itl=4, tok_s=200, transfers=TRANSFERS, **kw),
        record("colocated", 1, ttft=20, itl=4, tok_s=250),
        record("pd", 8, ttft=80, itl=5, tok_s=1200, transfers=TRANSFERS, **kw),
        record("colocated", 8, ttft=50, itl=5, tok_s=1500),
    ]


# ---------------------------------------------------------------- the bench's JSON result


@pytest.mark.parametrize("name", ["bench-vllm026-pd-c1.json", "bench-vllm032-pd-c1.json"])
def test_bench_figures_read_both_vllm_versions_result_files(name):
    doc = bench(name)
    figs = pf.bench_figures(doc)
    assert figs["ttft_p50_ms"] == doc["p50_ttft_ms"] and figs["itl_p99_ms"] == doc["p99_itl_ms"]
    assert figs["tpot_mean_ms"] == doc["mean_tpot_ms"] and figs["output_tok_s"] == doc["output_throughput"]
    assert figs["completed"] == doc["num_prompts"] and figs["failed"] == 0


def test_a_result_without_a_figure_names_the_key_and_the_file():
    doc = bench("bench-vllm032-pd-c1.json")
    del doc["p99_itl_ms"]
    with pytest.raises(PerfError, match=r"pd-c1\.json: no number under 'p99_itl_ms'"):
        pf.bench_figures(doc, source="pd-c1.json")


def test_ratios_are_pd_over_colocated_and_none_without_a_colocated_figure():
    pd, co = (
        pf.bench_figures(bench("bench-vllm026-pd-c1.json")),
        pf.bench_figures(bench("bench-vllm032-pd-c1.json")),
    )
    r = pf.pd_over_colocated(pd, co)
    assert r["ttft_p50_ms"] == pytest.approx(pd["ttft_p50_ms"] / co["ttft_p50_ms"])
    assert pf.pd_over_colocated(pd, {**co, "itl_p99_ms": 0.0})["itl_p99_ms"] is None


# ---------------------------------------------------------------- the instances' figures


def test_window_deltas_of_real_scrapes_give_nixl_transfers_and_means():
    before = {"decode-0": (FIXTURES / "nixl_decode_metrics_before.txt").read_text()}
    after = {"decode-0": (FIXTURES / "nixl_decode_metrics_after.txt").read_text()}
    # the connector's histograms come from its spec (push mode: the same ones, on the prefill)
    ev = connectors.NIXL.evidence
    assert isinstance(ev, MetricEvidence) and connectors.NIXL_PUSH.evidence.histograms == ev.histograms
    d = pf.hist_deltas(before, after, ["decode-0"], pf.transfer_histograms(ev))
    t = pf.metric_transfers(d, ev)
    assert t is not None and t.count == 1 and t.bytes == 262144 and t.descriptors == 2
    assert t.descriptor_bytes == 131072 and t.gb_s == pytest.approx(262144 / d["kv_xfer"][0] / 1e9)
    assert t.source == "decode /metrics (vllm:nixl_xfer_time_seconds, vllm:nixl_bytes_transferred)"
    assert t.post_seconds is not None and t.post_source == "decode vllm:nixl_post_time_seconds"
    means = pf.window_means(d)
    assert means["ttft"] == pytest.approx(2.7900941371917725 - 2.7541286945343018)
    nothing = pf.hist_deltas(before, before, ["decode-0"], pf.transfer_histograms(ev))
    assert pf.metric_transfers(nothing, ev) is None  # nothing moved
    assert "kv_xfer" not in pf.hist_deltas(before, after, ["decode-0"])  # only what is asked for


def test_mooncake_transfers_add_up_count_times_average_per_stats_line():
    t = pf.mooncake_transfers([(PERF / "mooncake_prefill_stats.log").read_text(), "no stats here"])
    assert t is not None and t.count == 5 and t.descriptors == 80
    assert t.seconds == pytest.approx((3.396 + 2 * 2.6 + 22.513 + 24.657) / 1000)
    assert t.bytes == pytest.approx((1.0 + 2 * 0.75 + 32 + 32) * 2**20)
    assert (
        pf.mooncake_transfers(["KV Transfer metrics: Num successful transfers=0, Num failed transfers=1"])
        is None
    )


def test_the_ttft_split_says_what_is_per_request_and_what_a_window_mean():
    figs = pf.bench_figures(bench("bench-vllm026-pd-c1.json"))
    rows = {
        r.figure: r for r in pf.ttft_split(figs, {"e2e": 0.012, "queue": 0.001}, {"ttft": 0.02}, TRANSFERS)
    }
    assert rows["client TTFT p50"].kind.startswith("per request") and rows["prefill request"].ms == 12.0
    assert rows["handover"].ms == pytest.approx(figs["ttft_mean_ms"] - 12.0)
    assert rows["KV transfer"].ms == pytest.approx(5.0) and rows["KV transfer"].kind.startswith("window mean")
    assert rows["prefill compute"].ms is None  # not scraped: not invented
    missing = {r.figure: r for r in pf.ttft_split(figs, {}, {}, None)}
    assert missing["KV transfer"].ms is None and "not measured" in missing["KV transfer"].kind


def test_the_raw_transfer_has_the_windows_size_in_its_descriptor_size():
    assert pf.probe_size(TRANSFERS) == (2**20, 2)  # 1 MiB per transfer in 512 KiB pieces
    assert pf.probe_size(TRANSFERS, max_bytes=2**19) == (2**19, 1)
    assert LINK.median_s == 0.003 and pf.link_ratio(TRANSFERS.gb_s, LINK) == pytest.approx(
        TRANSFERS.gb_s / (2**20 / 0.003 / 1e9)
    )


# ---------------------------------------------------------------- the verdict


CPU = [
    perf_baselines.Expectation("cpu", "c1.ratio.itl_p50", 1.5, "measured"),
    perf_baselines.Expectation("cpu", "c1.excess.ttft_p50_ms", 60.0, "the handover budget"),
]


def judged(recs=None, **kw) -> perf.CheckResult:
    """evaluate with the CPU lane's expectations and a baseline of today's figures (PASS when healthy)."""
    recs = records() if recs is None else recs
    today = perf_baselines.from_entry(
        perf_baselines.new_entry(KEY, perf.baseline_figures(records(), 0.6), source="t")
    )
    args = {"link": LINK, "baselines": [today], "expectations": CPU, **kw}
    return perf.evaluate(recs, requests=8, key=KEY, **args)


def test_a_healthy_run_passes_with_figures_tables_and_the_link_ratio():
    r = judged()
    assert r.passed, r.message
    assert "c=1: TTFT p50 40.0 vs 20.0 ms colocated" in r.message and "% of what NIXL" in r.message
    assert (
        "within the cpu lane's expectations: c1.ratio.itl_p50 1 <= 1.5, c1.excess.ttft_p50_ms 20 <= 60"
        in (r.message)
    )
    assert "baseline of tiny-llama, nixl, 1x1, cpu, 2 cores (t): 13/13 figures within tolerance" in r.message
    names = {f.name: f for f in r.figures}
    assert names["c1.ratio.ttft_p50"].value == 2.0 and names["c8.colocated.itl_p50_ms"].unit == "ms"
    assert names["c1.excess.ttft_p50_ms"].value == 20.0 and names["c1.excess.ttft_p50_ms"].unit == "ms"
    assert names["link_ratio"].value == pytest.approx(TRANSFERS.gb_s / LINK.gb_s)
    assert [t.title.split(" (")[0] for t in r.tables] == [
        "P/D vs colocated", "Where P/D TTFT goes", "KV bandwidth against the link"
    ]  # fmt: skip
    assert r.details["baseline_figures"]["c8.pd.output_tok_s"] == 1200
    assert r.details["expectations"]["status"] == "judged" and r.details["baseline"]["status"] == "compared"


def test_a_missing_baseline_is_not_run_never_pass():
    r = judged(baselines=[])
    assert r.not_run and r.message.startswith("no perf baseline for cpu, 2 cores (tiny-llama, nixl, 1x1)")
    assert "within the cpu lane's expectations" in r.message  # what was judged, after the reason
    elsewhere = judged(baselines=[baseline("1x NVIDIA H200", 1e4)])  # another hardware class: not judged
    assert elsewhere.not_run and elsewhere.details["baseline"]["other_hardware"] == ["1x NVIDIA H200"]
    assert r.message.count("no perf baseline") == 1
    # the bad figures still fail without a baseline: NOT RUN only when nothing else was wrong
    failed = judged(baselines=[], link=None)
    assert failed.failed and failed.message.startswith("the transport alone was not measured")
    assert "; not judged: no perf baseline for cpu, 2 cores" in failed.message


def test_a_lane_without_expectations_is_not_run_even_with_a_baseline():
    r = judged(expectations=[perf_baselines.Expectation("cuda", "c1.ratio.itl_p50", 1.5)])
    assert r.not_run and r.message.startswith("no P/D vs colocated expectation for the cpu lane")
    other_level = judged(expectations=[perf_baselines.Expectation("cpu", "c4.ratio.itl_p50", 1.5)])
    assert other_level.not_run and "none of the cpu lane's P/D vs colocated expectations measured" in (
        other_level.message
    )


@pytest.mark.parametrize(
    ("pd_c1", "why"),
    [
        # P/D decodes 3x slower than colocated: ITL 12 ms against 4
        ({"ttft": 40, "itl": 12}, "c1.ratio.itl_p50 = 3x, allowed <= 1.5x (measured)"),
        # P/D's first token 200 ms after colocated's: far beyond the handover budget
        ({"ttft": 220, "itl": 4}, "c1.excess.ttft_p50_ms = 200 ms, allowed <= 60 ms (the handover budget)"),
    ],
)
def test_pd_beyond_the_lanes_expectation_fails_naming_the_figure_value_and_bound(pd_c1, why):
    recs = [record("pd", 1, tok_s=200, transfers=TRANSFERS, **pd_c1), *records()[1:]]
    r = judged(recs)
    assert r.failed and "P/D vs colocated beyond the cpu lane's expectation: " + why in r.message
    assert judged(recs, baselines=[]).failed  # a missing baseline never hides it


def test_expectation_figures_are_ratios_and_differences_at_each_level():
    vs = perf.expectation_figures(records())
    assert vs["c1.ratio.itl_p50"] == 1.0 and vs["c1.excess.ttft_p50_ms"] == 20.0
    assert vs["c8.ratio.ttft_p99"] == pytest.approx(80 / 50) and vs["c8.excess.itl_p99_ms"] == 0.0
    assert all(perf_baselines.EXPECTATION_FIGURE.match(k) for k in vs)
    assert "c8.ratio.itl_p50" not in perf.expectation_figures(records()[:3])  # no colocated c=8


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"recs": records(completed=7)}, "pd c=1: 7/8 requests completed"),
        ({"recs": [*records()[1:2], record("pd", 1, ttft=40, itl=4, tok_s=200)]}, "no KV transfer"),
        ({"link": None, "error": "link probe: NIXL READ ended in state ERR"}, "NIXL READ ended in state ERR"),
        ({"link": None}, "the transport alone was not measured"),
    ],
)
def test_what_fails_the_check(kw, why):
    recs = kw.pop("recs", records())
    r = perf.evaluate(recs, requests=8, **{"link": LINK, **kw}, key=KEY)
    assert not r.passed and why in r.message


def baseline(hardware: str, tok_s: float, ttft: float = 40.0) -> perf_baselines.PerfBaseline:
    return perf_baselines.PerfBaseline(
        "tiny-llama",
        "nixl",
        "1x1",
        hardware,
        {
            "c1.pd.output_tok_s": perf_baselines.FigureBaseline(tok_s, 0.5, "higher"),
            "c1.pd.ttft_p50_ms": perf_baselines.FigureBaseline(ttft, 0.5, "lower"),
        },
    )


def test_a_baseline_far_above_todays_figures_fails_only_on_the_same_hardware():
    r = judged(baselines=[baseline("cpu, 2 cores", tok_s=10_000)])
    assert r.failed and "c1.pd.output_tok_s 200 vs baseline 1e+04 (allowed >= 5000)" in r.message
    elsewhere = judged(baselines=[baseline("1x NVIDIA H200", 1e4)])
    assert elsewhere.not_run and elsewhere.details["baseline"]["other_hardware"] == ["1x NVIDIA H200"]
    slower = judged(baselines=[baseline("cpu, 2 cores", 200, 10)])
    assert slower.failed and "c1.pd.ttft_p50_ms 40 vs baseline 10 (allowed <= 15)" in slower.message
    same = judged(baselines=[baseline("cpu, 2 cores", 200)])
    assert same.passed and same.details["baseline"]["status"] == "compared"


# ---------------------------------------------------------------- the baselines file


def test_record_then_load_round_trips_and_refuses_a_second_entry(tmp_path):
    path = tmp_path / "perf_baselines.toml"
    path.write_text((perf_baselines.BASELINES).read_text())  # the shipped file: other keys' entries
    measured = perf.baseline_figures(records(), 0.6)
    perf_baselines.record(path, perf_baselines.new_entry(KEY, measured, source="test"))
    (b,) = [b for b in perf_baselines.load(path) if b.key == KEY]
    assert b.key == KEY and b.figures["link_ratio"] == perf_baselines.FigureBaseline(0.6, 0.5, "higher")
    assert b.figures["c8.pd.ttft_p99_ms"].better == "lower" and set(b.figures) == set(measured)
    assert perf_baselines.judge(measured, [b], KEY)[0] is None
    with pytest.raises(ConfigError, match="already has a perf baseline"):
        perf_baselines.record(path, perf_baselines.new_entry(KEY, measured, source="again"))


def test_record_baseline_writes_one_run_and_stays_not_run(tmp_path):
    path = tmp_path / "b.toml"
    r = perf.record(judged(baselines=[]), KEY, path)
    assert r.not_run and r.message.startswith(
        f"recorded the perf baseline of {KEY} in {path}; no perf baseline"
    )
    (b,) = perf_baselines.load(path)
    assert b.key == KEY and b.figures["c1.pd.itl_p50_ms"].value == 4.0
    again = perf.record(judged(baselines=[]), KEY, path)
    assert again.failed and "already has a perf baseline" in again.message


def test_a_bad_entry_names_the_field(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text('[[baseline]]\nmodel="m"\nconnector="nixl"\nconfig="1x1"\nhardware="h"\n'
                    '[baseline.figures]\n"x" = { value = 1, better = "faster" }\n')  # fmt: skip
    with pytest.raises(ConfigError, match=r"baseline #1\.figures\.x.*better in \('lower', 'higher'\)"):
        perf_baselines.load(path)
    assert perf_baselines.load(tmp_path / "absent.toml") == []
    assert perf_baselines.load_expectations(tmp_path / "absent.toml") == []


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ('lane = "gpu"\nfigure = "c1.ratio.itl_p50"\nmax = 1.5', r"expectation #1\.lane: got 'gpu'"),
        ('lane = "cpu"\nfigure = "c1.itl_p50"\nmax = 1.5', r"expectation #1\.figure: got 'c1\.itl_p50'"),
        ('lane = "cpu"\nfigure = "c1.excess.ttft_p50"\nmax = 1.5', r"expectation #1\.figure.*_ms"),
        ('lane = "cpu"\nfigure = "c1.ratio.itl_p50"\nmax = "1.5"', r"expectation #1\.max: got '1\.5'"),
    ],
)
def test_a_bad_expectation_names_the_field(tmp_path, entry, error):
    path = tmp_path / "b.toml"
    path.write_text(f"[[expectation]]\n{entry}\n")
    with pytest.raises(ConfigError, match=error):
        perf_baselines.load_expectations(path)


def test_the_shipped_file_has_expectations_per_lane():
    exp = perf_baselines.load_expectations()
    for lane in ("cpu", "cuda"):
        assert {e.figure for e in exp if e.lane == lane} >= {"c1.ratio.itl_p50", "c1.excess.ttft_p50_ms"}
    assert all(e.why for e in exp)  # each bound says where it comes from
    cpu = {e.figure: e.max for e in exp if e.lane == "cpu"}
    # a real break fails on the CPU lane: P/D ITL 3x colocated, TTFT 1 s beyond colocated
    assert cpu["c1.ratio.itl_p50"] < 3.0 and cpu["c1.excess.ttft_p50_ms"] < 1000.0


def test_the_shipped_file_has_the_ci_shapes_baseline_from_its_runs():
    ci = ("tiny-llama-remote", "nixl", "1x1", "cpu, 2 cores")  # conftest's nixl_sweep, on CI's 2 cores
    (b,) = [b for b in perf_baselines.load() if b.key == ci]
    assert b.source.startswith("recorded 2026-12-05 from 8 runs by: pd-sessions perf-baseline")
    assert "load" in b.source and "/" + "work/" not in b.source  # how loaded; no machine's folder
    assert set(b.figures) == {f"c{c}.pd.{k}" for c in (1, 8) for k in perf.BASELINED} | {"link_ratio"}
    assert all(f.better == "higher" for n, f in b.figures.items() if n.endswith(("tok_s", "link_ratio")))
    assert all(
        f.rtol >= perf_baselines.DEFAULT_TOLERANCES[n.rsplit(".", 1)[-1]][0] for n, f in b.figures.items()
    )


def test_a_baseline_from_runs_takes_the_median_and_a_tolerance_from_the_spread():
    runs = [{"c1.pd.itl_p50_ms": v, "link_ratio": r, "other": 1.0} for v, r in
            [(4.0, 0.5), (4.2, 0.4), (3.8, 0.6), (4.0, 0.5), (6.0, 0.3)]]  # fmt: skip
    e = perf_baselines.measured_entry(KEY, runs, source="5 runs")
    itl, link = e["figures"]["c1.pd.itl_p50_ms"], e["figures"]["link_ratio"]
    assert itl["value"] == 4.0 and itl["spread"] == 0.5 and itl["rtol"] == 1.5  # 3 x (6 - 4) / 4
    assert itl["runs"] == [4.0, 4.2, 3.8, 4.0, 6.0] and itl["better"] == "lower"
    assert link["value"] == 0.5 and link["rtol"] == 0.9  # 3 x 0.4 capped: a bound of 0 would pass anything
    assert "other" not in e["figures"]  # no known direction: not baselined
    quiet = perf_baselines.measured_entry(KEY, [{"c1.pd.itl_p50_ms": 4.0}] * 5, source="")
    assert quiet["figures"]["c1.pd.itl_p50_ms"]["rtol"] == 0.5  # never below the figure's default
    b = perf_baselines.from_entry(e)
    assert b.figures["c1.pd.itl_p50_ms"].bound() == 10.0 and not b.figures["c1.pd.itl_p50_ms"].ok(10.5)
    with pytest.raises(ConfigError, match=r"--runs: got 4 run\(s\).*at least 5"):
        perf_baselines.measured_entry(KEY, runs[:4], source="")


def _results(folder, verdict="pass", figures=None, model="tiny-llama"):
    (folder / "1x1").mkdir(parents=True)
    key = {"model": model, "connector": "nixl", "config": "1x1", "hardware": "cpu, 2 cores"}
    perf_check = {"name": "perf", "verdict": verdict, "message": "m", "details": {
        "baseline": {"key": key}, "baseline_figures": figures or {"c1.pd.itl_p50_ms": 4.0}}}  # fmt: skip
    (folder / "1x1" / "result.json").write_text(json.dumps({"checks": [{"name": "smoke"}, perf_check]}))
    return folder


def test_the_perf_baseline_tool_reads_each_runs_figures_and_refuses_a_failed_run(tmp_path):
    from pd_sessions.bench import perf_baseline

    folders = [_results(tmp_path / f"r{i}", figures={"c1.pd.itl_p50_ms": 4.0 + i / 10}) for i in range(5)]
    folders[1] = _results(tmp_path / "not-run", verdict="not run", figures={"c1.pd.itl_p50_ms": 4.4})
    (e,) = perf_baseline.entries(folders, margin=3.0, source="s")
    assert (e["model"], e["hardware"]) == ("tiny-llama", "cpu, 2 cores") and e["source"] == "s"
    assert e["figures"]["c1.pd.itl_p50_ms"]["runs"] == [4.0, 4.4, 4.2, 4.3, 4.4]
    with pytest.raises(PerfError, match=r"perf fail: m \(whole runs only\)"):
        perf_baseline.perf_of(_results(tmp_path / "failed", verdict="fail"))
    with pytest.raises(PerfError, match="no config with a perf result"):
        perf_baseline.perf_of(tmp_path / "empty")
    out = tmp_path / "out"
    args = ["--from", str(folders[0]), "--out", str(out), "--print-only"]
    assert perf_baseline.main(args) == 2  # fewer than 5 runs: refused, naming --runs
    args = [a for f in folders for a in ("--from", str(f))] + [
        "--out",
        str(out),
        "--baselines",
        str(tmp_path / "b.toml"),
    ]
    assert perf_baseline.main(args) == 0
    (b,) = perf_baselines.load(tmp_path / "b.toml")
    assert (
        b.figures["c1.pd.itl_p50_ms"].value == 4.3
        and "from 5 runs by: pd-sessions perf-baseline; read from 5 earlier sweeps'" in b.source
    )
    assert perf_baseline.main(args) == 2  # the key is there already: remove it first
    assert str(tmp_path) not in b.source  # no machine's folder in the repo's file
    argv = ["--runs", "5", "--out", "/x", "--baselines=/y", "--", "s", "--results-dir", "/z", "--only", "1x1"]
    assert perf_baseline.without_paths(argv) == ["--runs", "5", "--", "s", "--only", "1x1"]


def test_perf_is_not_required_unless_a_sweep_names_it(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('name = "s"\n[defaults]\nmodel = "tiny-llama"\n[[config]]\nname = "1x1"\n')
    # a GPU sweep runs perf by default; without a baseline for the GPU it is NOT RUN, not a failure
    assert "perf" in load_sweep(p).checks_on("cuda") and "perf" not in load_sweep(p).required_on("cuda")
    assert load_builtin("perf_single_gpu").required_on("cuda") == ("smoke", "kv_transfer")
    assert "perf" not in load_builtin("kimi_linear_nightly").required_on("cuda")
    p.write_text('name = "s"\nchecks = ["smoke", "perf"]\nrequired_checks = ["perf"]\n'
                 '[defaults]\nmodel = "tiny-llama"\n[[config]]\nname = "1x1"\n')  # fmt: skip
    assert load_sweep(p).required_on("cpu") == ("perf",)  # named: its NOT RUN fails the config


def test_the_hardware_class_is_the_gpus_or_the_cores():
    assert perf_baselines.hardware_class(["NVIDIA H200"], 16) == "1x NVIDIA H200"
    assert perf_baselines.hardware_class(["NVIDIA H200", "NVIDIA H200"], 32) == "2x NVIDIA H200"
    assert perf_baselines.hardware_class([], 2) == "cpu, 2 cores"


# ---------------------------------------------------------------- selection


def test_perf_is_a_default_on_cuda_and_opt_in_on_the_cpu_lane(tmp_path):
    assert "perf" in registry.defaults("cuda") and "perf" not in registry.defaults("cpu")
    assert "perf" not in registry.DEFAULTS
    p = tmp_path / "s.toml"
    p.write_text('name = "s"\n[defaults]\nmodel = "tiny-llama"\n[[config]]\nname = "1x1"\n')
    s = load_sweep(p)
    assert s.checks_on("cuda") == registry.defaults("cuda") and s.checks_on("cpu") == registry.defaults("cpu")
    p.write_text(
        'name = "s"\nchecks = ["perf", "smoke"]\n[defaults]\nmodel = "tiny-llama"\n[[config]]\nname = "1x1"\n'
    )
    assert load_sweep(p).checks_on("cpu") == ("smoke", "perf")
    over = make_overrides(sets=['checks=["perf", "smoke"]'])
    assert over.checks == ("smoke", "perf") and over.describe() == ["checks = ['smoke', 'perf']"]
    with pytest.raises(ConfigError, match=r"command line: checks: unknown check 'perff' \(did you mean"):
        make_overrides(sets=['checks=["perff"]'])
    # --check adds to the platform's list or to --set's, in running order (perf before the faults)
    assert selection.checks(registry.defaults("cpu"), ["perf"]) == (
        *registry.DEFAULTS[:-1],
        "perf",
        "kv_digest",
        "conservation",
    )
    assert selection.checks(["smoke"], ["faults,perf"]) == ("smoke", "perf", *registry.FAULTS)


def test_perf_options_take_a_list_of_concurrency_levels():
    opts = registry.resolve_options({"perf": {"concurrency": [1, 4, 16], "requests": 32}})
    assert opts["perf"]["concurrency"] == (1, 4, 16) and opts["perf"]["requests"] == 32
    for bad in ([], [0], [1.5], 8):
        with pytest.raises(ConfigError, match=r"check_options\.perf\.concurrency.*a list of positive ints"):
            registry.resolve_options({"perf": {"concurrency": bad}})


def test_each_run_gets_its_own_dataset_seed(tmp_path):
    from pd_sessions.core.config import ClusterConfig

    cfg = ClusterConfig(name="1x1", model="tiny-llama", trust_remote_code=True)
    spec = type("S", (), {"url": "http://127.0.0.1:2"})
    plan = type("P", (), {"router": type("R", (), {"url": "http://127.0.0.1:1"}), "prefill": (spec,),
                          "served_model_name": "tiny-llama", "model": "/m", "config": cfg})  # fmt: skip
    runs = perf.planned_runs(plan, (8, 1, 8))
    assert [(r.label, r.url) for r in runs] == [
        ("pd-c1", "http://127.0.0.1:1"), ("colocated-c1", "http://127.0.0.1:2"),
        ("pd-c8", "http://127.0.0.1:1"), ("colocated-c8", "http://127.0.0.1:2"),
    ]  # fmt: skip
    assert len({r.seed for r in runs}) == 4
    argv = perf.bench_argv(plan, runs[0], registry.BY_NAME["perf"].options, tmp_path)
    assert argv[argv.index("--max-concurrency") + 1] == "1" and argv[-1] == "--trust-remote-code"
    assert argv[argv.index("--result-filename") + 1] == "pd-c1.json" and "--save-result" in argv


# ---------------------------------------------------------------- the bench driver's protocol


def test_the_driver_answers_each_request_reports_failures_and_quits(tmp_path):
    ran = []

    def run(argv):
        ran.append(argv)
        if argv == ["--bad"]:
            raise SystemExit(2)  # what argparse does on a bad flag

    t = threading.Thread(target=lambda: ran.append(perf_driver.serve_requests(tmp_path, run, idle_s=30)))
    t.start()
    for n, doc in enumerate([{"argv": ["--ok"]}, {"argv": ["--bad"]}]):
        perf._write_json(tmp_path / f"run-{n}.json", doc)
        while not (tmp_path / f"done-{n}.json").exists():
            t.join(0.01)
    perf._write_json(tmp_path / "run-2.json", {"quit": True})
    t.join(10)
    assert not t.is_alive() and ran == [["--ok"], ["--bad"], 2]
    assert json.loads((tmp_path / "done-0.json").read_text()) == {"ok": True}
    bad = json.loads((tmp_path / "done-1.json").read_text())
    assert bad["ok"] is False and bad["error"] == "SystemExit: 2"


def test_the_driver_exits_when_nobody_asks(tmp_path):
    now = [0.0]
    assert perf_driver.serve_requests(tmp_path, lambda argv: None, idle_s=5, clock=lambda: now[0],
                                      sleep=lambda s: now.__setitem__(0, now[0] + 1)) == 0  # fmt: skip


def test_a_level_without_a_figure_keeps_its_column_empty():
    nixl = pf.Transfers(
        "decode /metrics", count=8, seconds=0.04, bytes=8 * 2**20, descriptors=16, post_seconds=0.01
    )
    recs = [
        record("pd", 1, ttft=40, itl=4, tok_s=200),
        *records()[1:2],
        record("pd", 8, ttft=80, itl=5, tok_s=1, transfers=nixl),
    ]
    r = perf.evaluate(recs, requests=8, link=LINK, key=KEY)
    split = {row[0]: row[2:] for row in r.tables[1].rows}  # a Table checks its rows' lengths itself
    assert split["KV transfer post"] == (None, 1.25) and split["KV transfer"][0] is None


# ---------------------------------------------------------------- the transport and the physical limit


def test_a_finding_is_reported_in_message_figures_and_details_and_the_verdict_stays():
    # the same transfer timings as test_perf's LINK (the baseline's link ratio holds), a limit
    # 100x above the transport: a finding, and the check still PASSES
    base = pf.LinkProbe("NIXL agents (UCX)", 2**20, 2, (0.002, 0.004, 0.003))
    limit = pf.LinkLimit("shared-memory copy between two processes", 2**20, (0.00003,))
    slow = pf.LinkProbe(*[getattr(base, f) for f in ("transport", "bytes", "descriptors", "seconds")],
                        ("tcp/lo",), "UCX", ucx.advice(("tcp/lo",), "cpu"), limit,
                        {"interface": "lo", "gb_s": None, "note": "loopback"})  # fmt: skip
    r = judged(link=slow)
    assert r.passed, r.message
    assert "% of what NIXL agents (UCX) moves here (0.35 GB/s, over tcp/lo)" in r.message
    assert "physical limit: shared-memory copy between two processes 35 GB/s (KV 0.6 % of it" in r.message
    assert "finding (reported, not judged): NIXL agents (UCX) moved 0.35 GB/s, 1 % of the" in r.message
    assert "it used tcp, not shared memory" in r.message
    link = r.details["link"]
    assert link["transports"] == ["tcp/lo"] and link["limit"]["gb_s"] == pytest.approx(34.95, rel=0.01)
    assert link["finding"] and link["transport_of_limit"] == pytest.approx(0.01, rel=0.01)
    figures = {f.name: f for f in r.figures}
    assert figures["link.limit_gb_s"].unit == "GB/s" and figures["c1.kv.of_limit"].unit == "fraction"
    assert figures["c1.kv.of_limit"].value == pytest.approx(TRANSFERS.gb_s / limit.gb_s, rel=1e-3)
    bandwidth = r.tables[2]
    assert bandwidth.columns[-3:] == (
        "physical limit GB/s",
        "% of the limit",
        "transport alone, % of the limit",
    )
    assert bandwidth.rows[0][-1] == pytest.approx(1.0, rel=0.01)
    # the same run with the limit in reach: no finding anywhere
    fast = pf.LinkProbe(*[getattr(slow, f) for f in ("transport", "bytes", "descriptors", "seconds")],
                        ("cma/memory",), "UCX", None, pf.LinkLimit("copy", 2**20, (0.0006,)))  # fmt: skip
    ok = judged(link=fast)
    assert ok.passed and "finding" not in ok.message and ok.details["link"]["finding"] is None
    # a finding never hides a failure, nor turns one
    assert judged(link=slow, baselines=[]).not_run
    assert KEY[3] == "cpu, 2 cores"


def test_a_push_probe_says_it_wrote_in_the_message_and_details_and_its_finding_advises_a_write():
    # the H100's push sweep, 2026-12-05: KV 0.109 GB/s against a probe that READ over tcp/lo; the
    # probe now WRITEs as push does, and says so; a write over tcp is a finding with the write's advice
    limit = pf.LinkLimit("GPU 0 to GPU 1 peer copy", 2**20, (0.00003,))
    lanes = ("tcp/lo",)
    write = pf.LinkProbe("NIXL agents (UCX), VRAM to VRAM, WRITE", 2**20, 2, (0.002, 0.004, 0.003), lanes,
                         "UCX", ucx.advice(lanes, "cuda", None, "write"), limit, op="WRITE")  # fmt: skip
    r = judged(link=write)
    assert r.passed, r.message
    assert "% of what NIXL agents (UCX), VRAM to VRAM, WRITE moves here (0.35 GB/s, over tcp/lo)" in r.message
    assert (
        "finding (reported, not judged): NIXL agents (UCX), VRAM to VRAM, WRITE moved 0.35 GB/s" in r.message
    )
    assert "CUDA IPC writes (put)" in r.message and "set UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in r.message
    assert r.details["link"]["op"] == "WRITE" and r.details["link"]["transport"].endswith(", WRITE")
    assert judged().details["link"]["op"] is None  # an older probe's output names none


def test_the_nic_is_named_with_its_line_rate_or_unknown_and_loopback_is_not():
    base = pf.LinkProbe("NIXL agents (UCX)", 2**20, 2, (0.002, 0.004, 0.003))
    limit = pf.LinkLimit("shared-memory copy between two processes", 2**20, (0.001,))

    def with_nic(nic: dict) -> str:
        link = pf.LinkProbe(base.transport, base.bytes, base.descriptors, base.seconds, limit=limit, nic=nic)
        return judged(link=link).message

    assert "; NIC eth0: 3.12 GB/s line rate" in with_nic({"interface": "eth0", "gb_s": 3.125, "note": "x"})
    veth = {"interface": "veth1", "gb_s": None, "note": "unknown: veth1 reports no line rate (...)"}
    assert "; NIC veth1: unknown: veth1 reports no line rate" in with_nic(veth)
    assert "NIC" not in with_nic({"interface": "lo", "gb_s": None, "note": "loopback"})
