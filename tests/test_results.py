"""The results schema (core/results.py): figures and tables any reader can show, start times,
the version in result.json; and what each check reports through it (its ``numbers``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.builders import comp

from pd_sessions.checks import (
    abort_frees_kv,
    burst,
    cache_paths,
    evidence,
    instances,
    kv_transfer,
    parity,
    smoke,
    too_long,
)
from pd_sessions.checks import accuracy as acc
from pd_sessions.core.kv_identity import Counts
from pd_sessions.core.results import (
    FAIL,
    PASS,
    SCHEMA_VERSION,
    CheckResult,
    ConfigResult,
    Figure,
    ProcessRecord,
    Table,
    pick,
    reporting,
)
from pd_sessions.report.writers import write_config_result
from pd_sessions.run import user_commands as uc


def figures(r: CheckResult) -> dict:
    return {f.name: (f.value, f.unit) for f in r.figures}


def test_a_table_row_of_the_wrong_length_names_the_table():
    Table("t", ("a", "b"), ((1, 2),))
    with pytest.raises(ValueError, match="table 'x': row 1 has 1 values for 2 columns"):
        Table("x", ("a", "b"), ((1, 2), (3,)))


def test_pick_keeps_numbers_and_texts_in_order_and_leaves_out_the_rest():
    got = pick(
        {"a": 1, "b": None, "c": "x", "d": [1], "e": 0.1234567891},
        ("e", "s"),
        ("a", ""),
        ("b", ""),
        ("c", ""),
        ("d", ""),
        ("z", ""),
    )
    assert got == [Figure("e", 0.123457, "s"), Figure("a", 1, ""), Figure("c", "x", "")]


def test_reporting_attaches_numbers_to_every_branch():
    def numbers(details):
        return [
            *pick(details, ("n", "tokens")),
            Table("rows", ("k",), tuple((k,) for k in details.get("keys", ()))),
        ]

    @reporting(numbers)
    def evaluate(n):
        if n < 0:
            return CheckResult("x", FAIL, "negative", {})
        return CheckResult("x", PASS, "ok", {"n": n, "keys": ["a", "b"]})

    ok, bad = evaluate(3), evaluate(-1)
    assert ok.figures == [Figure("n", 3, "tokens")] and ok.tables[0].rows == (("a",), ("b",))
    assert bad.figures == [] and bad.tables[0].rows == ()
    assert evaluate.__name__ == "evaluate"


def test_result_json_carries_the_schema_starts_processes_figures_and_tables(tmp_path: Path):
    r = ConfigResult("1x1", "s", "mooncake", "cpu", model="tiny-llama", started_at=1000.0)
    r.phases, r.phase_starts = {"plan": 0.5}, {"plan": 1000.0}
    r.processes = [ProcessRecord("prefill-0", "prefill", "127.0.0.1", "prefill-0.log", 1000.6, 30.25)]
    r.checks = [
        CheckResult(
            "perf",
            PASS,
            "m",
            {"raw": 1},
            2.0,
            figures=[Figure("ttft_p50", 12.5, "ms")],
            tables=[Table("by concurrency", ("concurrency", "ttft p50 (ms)"), ((1, 12.5), (8, 40.0)))],
            started_at=1001.0,
        )
    ]
    write_config_result(r, tmp_path / "result.json")
    doc = json.loads((tmp_path / "result.json").read_text())
    assert doc["schema"] == SCHEMA_VERSION == 4
    assert (
        doc["model"] == "tiny-llama"
        and doc["started_at"] == 1000.0
        and doc["phase_starts"] == {"plan": 1000.0}
    )
    assert doc["processes"] == [
        {
            "name": "prefill-0",
            "role": "prefill",
            "host": "127.0.0.1",
            "log": "prefill-0.log",
            "started_at": 1000.6,
            "ready_s": 30.25,
        }
    ]
    (check,) = doc["checks"]
    assert check["started_at"] == 1001.0 and check["details"] == {"raw": 1}
    assert check["figures"] == [{"name": "ttft_p50", "value": 12.5, "unit": "ms"}]
    assert check["tables"] == [
        {
            "title": "by concurrency",
            "columns": ["concurrency", "ttft p50 (ms)"],
            "rows": [[1, 12.5], [8, 40.0]],
        }
    ]


# ---------------------------------------------------------------- each check's numbers


def test_smoke_reports_its_token_counts():
    assert figures(smoke.evaluate(comp(ids=range(16)), max_tokens=16)) == {
        "completion_tokens": (16, "tokens"),
        "prompt_tokens": (7, "tokens"),
    }
    assert "completion_tokens" in figures(smoke.evaluate(comp(ids=(1,)), max_tokens=16))  # failing too


def test_parity_reports_prompts_and_a_row_each():
    r = parity.evaluate_exact([("p1", comp(), comp()), ("p2", comp((1, 9)), comp((1, 2)))], baseline="b")
    assert figures(r) == {"mode": ("exact", ""), "prompts": (2, ""), "prompts_same": (1, "")}
    assert r.tables[0].rows == (("p1", True), ("p2", False))
    toks = [parity.ForcedToken(0, 11, -2.0, 2, "a", 12, -1.9, "b")]
    m = parity.evaluate_margin([("p", toks)], margin=0.25, baseline="ref")
    f = figures(m)
    assert f["mode"] == ("margin", "") and f["tokens"] == (1, "tokens") and f["margin"] == (0.25, "nats")
    assert f["max_gap"][0] == pytest.approx(0.1) and f["max_gap"][1] == "nats" and f["near_ties"] == (1, "")
    assert m.tables[0].columns == ("prompt", "same", "tokens", "max gap (nats)")


def test_kv_transfer_reports_tokens_evidence_and_a_row_per_decode():
    ok = evidence.Evidence("mooncake", log_stats={"prefill-0": {"Num successful transfers": 5}})
    r = kv_transfer.evaluate(
        {"decode-0": Counts(10)},
        {"decode-0": Counts(110)},
        router_prompt_tokens=100,
        router_requests=5,
        connector="mooncake",
        evidence=ok,
    )
    f = figures(r)
    assert (
        f["delta"] == (100, "tokens") and f["expected"] == (100, "tokens") and f["router_requests"] == (5, "")
    )
    assert f["local_cache_hit"] == (0, "tokens") and f["local_compute"] == (0, "tokens")
    assert f["successful_transfers"] == (5, "") and f["failed_transfers"] == (0, "")
    assert r.tables[0].rows == (("decode-0", 10, 110, 100),)
    silent = kv_transfer.evaluate(
        {"decode-0": Counts(10)},
        {"decode-0": Counts(10)},
        router_prompt_tokens=100,
        router_requests=5,
        connector="mooncake",
    )
    assert not silent.passed and figures(silent)["delta"] == (0, "tokens")


def test_edge_checks_report_their_numbers():
    sit = cache_paths.Situation("short", 10, 128, "x direct", comp(), comp())
    assert cache_paths.evaluate([sit]).tables[0].rows[0] == ("short", 10, 128, "x direct", True)
    r = too_long.evaluate(
        too_long.Answer(None, 10.0, "no answer"),
        bound_s=10,
        prompt_tokens=2100,
        max_model_len=2048,
        health_after={},
        followup=None,
    )
    assert "status" not in figures(r) and figures(r)["seconds"] == (10.0, "s")  # no status: left out
    kv = CheckResult("kv_transfer", PASS, "ok", {"delta": 1})
    failed = [burst.Failure("q", "http://x: HTTP 500: boom", 500, 0.2, 60.0)]
    b = burst.evaluate([("p", comp(), comp())], failed, kv, requests=2, seconds=1.5, max_tokens=2)
    assert figures(b) == {"requests": (2, ""), "failed": (1, ""), "burst_seconds": (1.5, "s")}
    # each failed request recorded as data (its HTTP status), not only as text
    assert b.details["failures"] == [
        {"prompt": "q", "error": "http://x: HTTP 500: boom", "status": 500, "seconds": 0.2, "bound_s": 60.0}
    ] and b.details["failed"] == ["'q': http://x: HTTP 500: boom"]
    a = abort_frees_kv.evaluate(
        4, 4, [], {"prefill-0": None, "decode-0": "KV 0.1"}, bound_s=15, waited_s=15, last={}
    )
    assert figures(a)["waited_s"] == (15, "s") and a.tables[0].rows == (
        ("prefill-0", "idle"),
        ("decode-0", "KV 0.1"),
    )


def test_accuracy_and_user_commands_report_their_numbers(tmp_path: Path):
    b = acc.Baseline(model="m", task="gsm8k", value=0.41, samples=100, rtol=0.05)
    f = figures(acc.compare(0.40, 100, b))
    assert f["measured"] == (0.4, "") and f["baseline"] == (0.41, "") and f["samples"] == (100, "")
    assert figures(acc.compare_samples({1: "a", 2: "b"}, {1: "a", 2: "c"}, baseline="p"))[
        "samples_differing"
    ] == (1, "")
    cmd = uc.UserCommand(index=0, argv=("pytest", "x.py"), given="pytest x.py")
    r = uc.evaluate(
        cmd,
        returncode=1,
        seconds=1.0,
        timed_out=False,
        timeout_s=10,
        log_path=tmp_path / "x.log",
        log_tail="",
        junit={"tests": 3, "failures": 1, "errors": 0, "skipped": 0, "first_failure": "t::x: boom"},
    )
    assert figures(r) == {
        "given": ("pytest x.py", ""),
        "returncode": (1, ""),
        "tests": (3, ""),
        "failures": (1, ""),
        "errors": (0, ""),
        "skipped": (0, ""),
    }


def test_an_idle_instance_turns_a_pass_into_a_fail_keeping_its_numbers():
    r = smoke.evaluate(comp(ids=range(16)), max_tokens=16)
    before = {"prefill-0": 0, "prefill-1": 7, "decode-0": 0}
    after = {"prefill-0": 50, "prefill-1": 7, "decode-0": 25}
    out = instances.apply_served(r, before, after, requests=4, roles={"prefill": 2, "decode": 1})
    assert not out.passed and out.figures == r.figures
    assert out.tables[-1].rows == (("prefill-0", 50), ("prefill-1", 0), ("decode-0", 25))
