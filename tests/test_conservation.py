"""The conservation invariant (pd_sessions/checks/conservation.py) and the stranded-blocks
scenario's verdict (checks/faults/strand.py): each bad case fed to the verdict must FAIL naming
the instance and the check after which it appeared; the healthy case PASSes; a part that cannot
be measured is NOT RUN, said, never passed. The runner's probes run here on a fake cluster whose
/metrics and process trees the test sets; on real vLLM: tests/test_e2e_conservation.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import FIXTURES
from helpers.builders import cfg, plan

from pd_sessions.checks import conservation, runner
from pd_sessions.checks.faults import strand
from pd_sessions.checks.faults.promise import CORRECT, Outcome, Recovery
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import check_registry
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.results import FAIL, NOT_RUN, PASS, CheckResult

BOUNDS = {"fds": 64.0, "threads": 32.0, "rss_mib": 512.0}
NIXL = conservation.transfers_unmeasured("nixl")
MOONCAKE = conservation.transfers_unmeasured("mooncake")


def usage(fds=300, threads=80, rss=900.0, pid=11) -> dict:
    return {"pid": pid, "fds": fds, "threads": threads, "rss_mib": rss}


def record(check, *, held=None, idle_s=0.2, use=None, transfers=None, requests=0) -> dict:
    return {
        "check": check,
        "held": held or {"prefill-0": None, "decode-0": None},
        "idle_s": idle_s,
        "bound_s": 30.0,
        "usage": use or {"prefill-0": usage(), "decode-0": usage(pid=12)},
        "transfers": transfers if transfers is not None else {"decode-0": float(requests)},
        "router_requests": requests,
    }


def healthy() -> list[dict]:
    return [
        record("smoke", requests=1),
        record("parity", requests=4),
        record("burst", use={"prefill-0": usage(fds=310, threads=85), "decode-0": usage(pid=12, rss=950)}),
    ]


def test_a_healthy_run_passes_with_the_unmeasurable_part_named_not_run():
    r = conservation.evaluate(healthy(), BOUNDS, transfers=NIXL)
    assert r.verdict == PASS, r.message
    assert r.details["parts"] == {"kv_idle": PASS, "resources": PASS, "transfers": PASS}
    assert "completed transfers = router requests after 2 check(s)" in r.message
    assert "transfers started on the prefill NOT RUN (NIXL: vLLM counts completed READ transfers" in r.message
    assert r.details["warm_up"]["prefill-0"]["after"] == "smoke"
    assert r.tables and r.tables[0].title == "conservation after each check"


def test_a_connector_without_a_transfer_counter_is_not_run_there_never_passed():
    r = conservation.evaluate(healthy(), BOUNDS, transfers=MOONCAKE)
    assert r.verdict == PASS and r.details["parts"]["transfers"] == NOT_RUN
    assert "transfers NOT RUN (Mooncake: vLLM exposes no Prometheus counter" in r.message


def test_stranded_blocks_fail_naming_the_instance_and_the_check_after_which_they_appeared():
    recs = healthy()
    recs[2]["held"] = {"prefill-0": "3 KV blocks in use (idle 0; ...)", "decode-0": None}
    recs.append(record("accuracy", held={"prefill-0": "3 KV blocks in use (idle 0; ...)", "decode-0": None}))
    r = conservation.evaluate(recs, BOUNDS, transfers=NIXL)
    assert r.verdict == FAIL and r.details["parts"]["kv_idle"] == FAIL
    assert r.message.startswith(
        "prefill-0 not idle after burst: 3 KV blocks in use (idle 0; ...) (and after 1 later check(s))"
    )


def test_fd_growth_fails_naming_the_instance_the_values_and_the_check():
    recs = healthy()
    recs.append(record("accuracy", use={"prefill-0": usage(), "decode-0": usage(pid=12, fds=365)}))
    recs.append(record("perf", use={"prefill-0": usage(), "decode-0": usage(pid=12, fds=400)}))
    r = conservation.evaluate(recs, BOUNDS, transfers=NIXL)
    assert r.verdict == FAIL and r.details["parts"]["resources"] == FAIL
    assert "decode-0: fds 365 after accuracy (+65 on 300 after smoke, bound +64)" in r.message
    assert "after perf" not in r.message  # where it first appeared, once


def test_thread_and_rss_growth_fail_too():
    recs = healthy()
    recs.append(record("perf", use={"prefill-0": usage(threads=113, rss=1413.0), "decode-0": usage(pid=12)}))
    r = conservation.evaluate(recs, BOUNDS, transfers=MOONCAKE)
    assert r.verdict == FAIL
    assert "prefill-0: threads 113 after perf (+33 on 80" in r.message
    assert "prefill-0: rss_mib 1413 after perf (+513 on 900" in r.message


def test_a_restarted_instance_is_measured_from_its_own_first_record():
    recs = healthy()
    # fault_restart: a new prefill-0 (another PID) with fewer fds, then its own growth within bounds
    recs.append(record("fault_restart", use={"prefill-0": usage(pid=99, fds=150), "decode-0": usage(pid=12)}))
    recs.append(record("kv_digest", use={"prefill-0": usage(pid=99, fds=200), "decode-0": usage(pid=12)}))
    r = conservation.evaluate(recs, BOUNDS, transfers=NIXL)
    assert r.verdict == PASS, r.message
    recs.append(record("more", use={"prefill-0": usage(pid=99, fds=215), "decode-0": usage(pid=12)}))
    r = conservation.evaluate(recs, BOUNDS, transfers=NIXL)
    assert "prefill-0: fds 215 after more (+65 on 150 after fault_restart" in r.message


def test_unequal_transfer_counts_fail_naming_the_check():
    recs = healthy()
    recs[1]["transfers"] = {"decode-0": 3.0}  # 4 router requests in parity, 3 completed READs
    r = conservation.evaluate(recs, BOUNDS, transfers=NIXL)
    assert r.verdict == FAIL and r.details["parts"]["transfers"] == FAIL
    assert (
        "after parity: 3 completed transfers (vllm:nixl_xfer_time_seconds_count) for 4 router requests"
        in (r.message)
    )


def test_remote_processes_leave_resources_not_run_with_the_reason():
    recs = [{k: v for k, v in rec.items() if k != "usage"} for rec in healthy()]
    for rec in recs:
        rec["usage_not_run"] = (
            "prefill-0, decode-0 on other hosts: their processes are not visible from this one"
        )
    r = conservation.evaluate(recs, BOUNDS, transfers=MOONCAKE)
    assert r.verdict == PASS and r.details["parts"]["resources"] == NOT_RUN
    assert "resources NOT RUN (prefill-0, decode-0 on other hosts" in r.message


def test_nothing_to_judge_is_not_run_and_a_failed_probe_fails():
    assert conservation.evaluate([], BOUNDS, transfers=NIXL).verdict == NOT_RUN
    stuck = [{"check": "smoke", "skipped": "not probed: the P/D path is stuck (x)"}]
    r = conservation.evaluate(stuck, BOUNDS, transfers=NIXL)
    assert r.verdict == NOT_RUN and "not probed after smoke" in r.message
    r = conservation.evaluate([*healthy(), {"check": "perf", "error": "probe failed: NoSuchProcess"}], BOUNDS,
                              transfers=NIXL)  # fmt: skip
    assert r.verdict == FAIL and "after perf: probe failed: NoSuchProcess" in r.message


def test_it_is_a_default_run_last_and_not_required():
    info = check_registry.BY_NAME["conservation"]
    # last but hostile_clients (opt-in), which judges the KV it may leave held itself
    assert check_registry.NAMES[-2:] == ("conservation", "hostile_clients")
    assert "conservation" in check_registry.DEFAULTS and "hostile_clients" not in runner.PROBED
    assert not info.required and not info.faults
    assert set(info.options) == {"idle_bound_s", *conservation.BOUND_OPTION.values()}
    assert "fault_strand" in check_registry.FAULTS


# ---------------------------------------------------------------- the runner's probes (fake cluster)


METRICS = (FIXTURES / "nixl_decode_metrics_after.txt").read_text()  # num_gpu_blocks 4096, usage 0
IDLE_LINE = 'kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0'


@pytest.fixture
def fake(monkeypatch):
    """A window on a planned 1x1 whose /metrics the test sets per instance and whose process
    trees each report the usage the test sets."""
    planned = plan(cfg(connector="nixl"), Inventory(gpus=(), cpus=(0, 1), gpu_source="test"), platform="cpu")
    metrics = {s.name: METRICS for s in planned.instances}
    trees = {s.name: usage(pid=i) for i, s in enumerate(planned.instances)}
    running = [SimpleNamespace(name=s.name, pid=i, node=None) for i, s in enumerate(planned.instances)]
    cluster = SimpleNamespace(plan=planned, instances=running, down={})
    by_url = {s.url: s.name for s in planned.instances}
    monkeypatch.setattr(
        conservation.http, "get_text", lambda url, timeout=0: metrics[by_url[url[: -len("/metrics")]]]
    )
    monkeypatch.setattr(conservation, "tree_usage", lambda r: dict(trees[r.name]))
    monkeypatch.setattr(conservation, "POLL_S", 0.01)
    window = CheckWindow(cluster, [], timeout_s=1.0)  # type: ignore[arg-type]
    return SimpleNamespace(window=window, metrics=metrics, trees=trees)


def test_the_ledger_attaches_each_probe_to_its_check_and_the_check_judges_them(fake, monkeypatch):
    ledger = conservation.Ledger.open(fake.window, {"idle_bound_s": 0.1})
    fake.window.results.append(CheckResult("smoke", PASS, "ok"))
    fake.window.router_requests = 1
    xfers = 'nixl_xfer_time_seconds_count{engine="0",model_name="tiny-llama"} '
    fake.metrics["decode-0"] = METRICS.replace(xfers + "2.0", xfers + "3.0")  # smoke's one READ
    ledger.after("smoke")
    assert fake.window.results[-1].details["conservation"]["held"] == {"prefill-0": None, "decode-0": None}
    # a stranded block on the prefill after burst, and the decode's fds grown past the bound
    fake.window.results.append(CheckResult("burst", PASS, "ok"))
    fake.metrics["prefill-0"] = METRICS.replace(IDLE_LINE, IDLE_LINE.replace("0.0", str(2 / 4095)))
    fake.trees["decode-0"]["fds"] += 100
    ledger.after("burst")
    rec = fake.window.results[-1].details["conservation"]
    assert rec["held"]["prefill-0"].startswith("2 KV blocks in use") and rec["idle_s"] >= 0.1
    monkeypatch.setattr(conservation, "lease_of", lambda connector: 0.05)  # NIXL's is 30 s
    monkeypatch.setattr(conservation, "END_SLACK_S", 0.05)
    r = conservation.run(
        fake.window, {"idle_bound_s": 0.1, "fds_bound": 64, "threads_bound": 32, "rss_bound_mib": 512}
    )
    assert r.verdict == FAIL and r.details["parts"] == {"kv_idle": FAIL, "resources": FAIL, "transfers": PASS}
    # still held once the lease (and END_SLACK_S) was waited out at the end: carried at the end
    assert r.details["carried_at_end"] == {"prefill-0": 2.0} and r.details["end_drain"]["waited_s"] >= 0.05
    assert r.details["records"][0]["transfers"] == {"decode-0": 1.0}
    assert "prefill-0 not idle after burst: 2 KV blocks in use" in r.message
    assert "decode-0: fds 400 after burst (+100 on 300 after smoke, bound +64)" in r.message


def test_a_decode_restarted_during_a_check_leaves_that_checks_transfers_unjudged(fake):
    """The soak restarts the decode, whose NIXL counter is the one counted: it began again from 0,
    so that check's transfers are not counted from it (said), and no inequality is made up."""
    ledger = conservation.Ledger.open(fake.window, {"idle_bound_s": 0.1})
    xfers = 'nixl_xfer_time_seconds_count{engine="0",model_name="tiny-llama"} '
    fake.window.results.append(CheckResult("smoke", PASS, "ok"))
    fake.window.router_requests = 1
    fake.metrics["decode-0"] = METRICS.replace(xfers + "2.0", xfers + "3.0")
    ledger.after("smoke")
    fake.window.results.append(CheckResult("soak", PASS, "ok"))
    fake.window.router_requests = 25
    fake.metrics["decode-0"] = METRICS.replace(xfers + "2.0", xfers + "1.0")  # a new decode: 1 READ
    ledger.after("soak")
    rec = fake.window.results[-1].details["conservation"]
    assert "transfers" not in rec
    assert rec["transfers_not_judged"] == "decode-0 restarted during soak: its counter began again"
    unequal, judged = conservation.unequal_transfers(ledger.records, "c")
    assert unequal == [] and judged == 1


# ---------------------------------------------------------------- fault_strand's verdict


def invariant(held: dict) -> CheckResult:
    rec = record("fault_strand", held=held)
    return conservation.evaluate([rec], BOUNDS, transfers=NIXL)


WHOLE = Recovery({"prefill-0": "ok", "decode-0": "ok", "router": "ok"}, {"prefill-0": None, "decode-0": None},
                 Outcome("probe", CORRECT, 0.2, 200, "x"), 0.6, 30)  # fmt: skip
STRANDED = {"prefill-0": "4 KV blocks in use (idle 0; ...)", "decode-0": None}


def stranded(**kw) -> strand.Stranded:
    base = {"requests": 2, "stalled": 2, "reached": 2, "got_token": 0, "stranded": 2, "released": 2,
            "invariant": invariant(STRANDED), "prefills": ["prefill-0"]}  # fmt: skip
    return strand.Stranded(**{**base, **kw})


def test_the_scenario_passes_only_when_the_invariant_caught_the_stranded_blocks_on_the_prefill():
    r = strand.evaluate(stranded(), WHOLE)
    assert r.verdict == PASS, r.message
    assert (
        "the conservation invariant failed on it (prefill-0 not idle after fault_strand: 4 KV blocks in use "
        "(idle 0; ...)); 2 handed back" in r.message
    )
    assert r.details["caught_on"] == ["prefill-0"]
    # an invariant blind to them (every instance idle): the scenario fails
    blind = strand.evaluate(stranded(invariant=invariant({"prefill-0": None, "decode-0": None})), WHOLE)
    assert blind.verdict == FAIL and "did not catch the stranded blocks on prefill-0 (pass:" in blind.message
    # caught on the decode only: not the injection
    decode = {"prefill-0": None, "decode-0": "1 KV blocks in use"}
    assert strand.evaluate(stranded(invariant=invariant(decode)), WHOLE).verdict == FAIL


def test_the_scenario_fails_when_the_blocks_are_not_handed_back_and_is_invalid_unfired():
    r = strand.evaluate(stranded(released=1), WHOLE)
    assert r.verdict == FAIL and "only 1 of 2 kept sends were handed back" in r.message
    held = Recovery(WHOLE.health, {"prefill-0": "4 KV blocks in use", "decode-0": None}, None, 30, 30)
    assert strand.evaluate(stranded(), held).verdict == FAIL
    r = strand.evaluate(stranded(stranded=0, released=0), WHOLE)
    assert r.verdict == NOT_RUN and r.message.startswith("invalid: the fault did not fire")


def test_blocks_already_reported_are_not_reported_again_after_the_next_checks(fake):
    ledger = conservation.Ledger.open(fake.window, {"idle_bound_s": 0.05})
    two = METRICS.replace(IDLE_LINE, IDLE_LINE.replace("0.0", str(2 / 4095)))
    fake.metrics["prefill-0"] = two
    for check in ("request_features", "cache_paths"):  # the same 2 blocks, still held after the next
        fake.window.results.append(CheckResult(check, PASS, "ok"))
        ledger.after(check)
    held = {r["check"]: r["held"]["prefill-0"] for r in ledger.records}
    assert held["request_features"].startswith("2 KV blocks in use") and held["cache_paths"] is None
    assert ledger.records[-1]["carried"] == {"prefill-0": 2.0}
    # one block more than was reported: a new strand, after that check
    fake.metrics["prefill-0"] = METRICS.replace(IDLE_LINE, IDLE_LINE.replace("0.0", str(3 / 4095)))
    fake.window.results.append(CheckResult("burst", PASS, "ok"))
    ledger.after("burst")
    assert ledger.records[-1]["held"]["prefill-0"].startswith("3 KV blocks in use (idle 2;")
    # freed at last: nothing carried any more
    fake.metrics["prefill-0"] = METRICS
    fake.window.results.append(CheckResult("too_long", PASS, "ok"))
    ledger.after("too_long")
    assert ledger.records[-1]["held"]["prefill-0"] is None and ledger.reference() == {}


def test_nixl_n_gt_1_stranding_is_the_known_issue_and_nothing_else_is():
    from pd_sessions.core import known_issues
    from pd_sessions.core.results import XFAIL

    (entry,) = [i for i in known_issues.load() if i.id == "nixl-n-gt-1-stranded-kv"]
    assert entry.check == "conservation" and entry.connector == "nixl" and "43509" in entry.link
    after_rf = healthy()
    after_rf[1]["held"] = {"prefill-0": "2 KV blocks in use (idle 0; x of y)", "decode-0": None}
    after_rf[1]["check"] = "request_features"
    r = conservation.evaluate(after_rf, BOUNDS, transfers=NIXL)
    assert r.verdict == FAIL and known_issues.judge(r, entry, "0.32.0").verdict == XFAIL
    for other in ("burst", "smoke"):  # held after another check: not the known issue
        recs = [dict(rec) for rec in after_rf]
        recs[1]["check"] = other
        r = conservation.evaluate(recs, BOUNDS, transfers=NIXL)
        assert known_issues.judge(r, entry, "0.32.0").verdict == FAIL
    grown = [*after_rf, record("perf", use={"prefill-0": usage(fds=400), "decode-0": usage(pid=12)})]
    r = conservation.evaluate(grown, BOUNDS, transfers=NIXL)  # and an fd leak besides: FAIL
    assert known_issues.judge(r, entry, "0.32.0").verdict == FAIL
    # still carried at the last probe: the check waits the lease out (drain_at_end). Freed by
    # then, the strand is the known issue's; still held, it is another leak
    kept = [dict(rec) for rec in after_rf]
    kept[-1]["carried"] = {"prefill-0": 2.0}
    freed = {"bound_s": 35.0, "waited_s": 3.1, "held": {"prefill-0": None}, "carried": {}}
    r = conservation.evaluate(kept, BOUNDS, transfers=NIXL, end=freed)
    assert r.details["carried_at_end"] == {} and known_issues.judge(r, entry, "0.32.0").verdict == XFAIL
    leaked = dict(freed, held={"prefill-0": "2 KV blocks in use"}, carried={"prefill-0": 2.0})
    r = conservation.evaluate(kept, BOUNDS, transfers=NIXL, end=leaked)
    assert r.details["carried_at_end"] == {"prefill-0": 2.0}
    assert known_issues.judge(r, entry, "0.32.0").verdict == FAIL
    assert "prefill-0 still held 2 KV blocks 3.1 s after the last check" in r.message
    # no end wait (a connector without a lease): the last probe's carried blocks are the end's
    assert conservation.evaluate(kept, BOUNDS, transfers=NIXL).details["carried_at_end"] == {"prefill-0": 2.0}


def test_the_end_wait_sees_carried_blocks_freed_by_the_lease_and_names_those_that_stay(fake, monkeypatch):
    monkeypatch.setattr(conservation, "END_SLACK_S", 0.05)
    ledger = conservation.Ledger.open(fake.window, {"idle_bound_s": 0.05})
    two = METRICS.replace(IDLE_LINE, IDLE_LINE.replace("0.0", str(2 / 4095)))
    fake.metrics["prefill-0"] = two
    fake.window.results.append(CheckResult("request_features", PASS, "ok"))
    ledger.after("request_features")
    carried = ledger.records[-1]["carried"]
    assert carried == {"prefill-0": 2.0}
    stays = conservation.drain_at_end(fake.window, carried, 0.05)
    assert stays["carried"] == {"prefill-0": 2.0} and stays["bound_s"] == 0.05 + conservation.END_SLACK_S
    fake.metrics["prefill-0"] = METRICS  # the lease ran out: freed
    freed = conservation.drain_at_end(fake.window, carried, 0.05)
    assert freed["carried"] == {} and freed["held"]["prefill-0"] is None
    # an instance not seen at the end (down: not probed) keeps what it carried: never called freed
    fake.window.cluster.down = {"prefill-0"}
    unseen = conservation.drain_at_end(fake.window, carried, 0.05)
    assert unseen["carried"] == {"prefill-0": 2.0} and "prefill-0" not in unseen["held"]


def test_mooncake_n_gt_1_stranding_is_its_known_issue_and_nothing_else_is():
    from pd_sessions.core import known_issues
    from pd_sessions.core.results import XFAIL

    (entry,) = [i for i in known_issues.load() if i.id == "mooncake-n-gt-1-stranded-kv"]
    assert entry.check == "conservation" and entry.connector == "mooncake"
    recs = healthy()
    recs[1]["check"] = "request_features"
    for held in (  # the prefill and the decode, or either (the CPU lane held 5 and 2 blocks)
        {"prefill-0": "5 KV blocks in use (idle 0; x)", "decode-0": "2 KV blocks in use (idle 0; x)"},
        {"prefill-0": "5 KV blocks in use (idle 0; x)", "decode-0": None},
        {"prefill-0": None, "decode-0": "1 requests still running (vllm:num_requests_running)"},
    ):
        recs[1]["held"] = held
        r = conservation.evaluate(recs, BOUNDS, transfers=MOONCAKE)
        assert known_issues.judge(r, entry, "0.32.0").verdict == XFAIL, r.message
    recs[2]["held"] = {"prefill-0": "1 KV blocks in use (idle 0; x)", "decode-0": None}  # and after burst
    r = conservation.evaluate(recs, BOUNDS, transfers=MOONCAKE)
    assert known_issues.judge(r, entry, "0.32.0").verdict == FAIL
