"""pd_sessions.runtime.pairs: the error-line filter (the per-pair warm-up parameters are the
connector specs', tests/test_connectors.py), the retry
loop's budget (with a fake hop), and the whole readiness path against the fake stack: a
cluster whose every instance is healthy but whose P/D path keeps failing ends the wait
within the budget, with the answer and the decode's error lines."""

from __future__ import annotations

import re
import time

import pytest
from helpers.builders import live_plan
from helpers.fake_runs import fake_stack_env
from helpers.waiting import within

from pd_sessions.core.config import ClusterConfig
from pd_sessions.runtime import http, pairs
from pd_sessions.runtime.cluster import running_cluster


def test_error_lines_keep_the_last_matching_ones():
    log = "INFO fine\nERROR one\nWARNING handshake_setup_failed\nINFO ok\n(EngineCore) Traceback\nERROR two\n"
    assert pairs.error_lines(log, limit=2) == ["(EngineCore) Traceback", "ERROR two"]
    assert pairs.error_lines("INFO all good\n") == []


def test_every_pair_is_warmed_with_its_own_request(tmp_path):
    plan = live_plan(connector="nixl", num_prefill=2, num_decode=2)
    seen = []
    took = pairs.warm_pairs(
        plan, deadline=time.monotonic() + 5, logs={}, warm=lambda plan, pair, timeout: seen.append(pair.name)
    )
    assert seen == [
        "prefill-0 -> decode-0",
        "prefill-0 -> decode-1",
        "prefill-1 -> decode-0",
        "prefill-1 -> decode-1",
    ]
    assert list(took) == seen


@pytest.mark.procs
def test_a_failing_pair_ends_the_wait_at_the_deadline_naming_pair_and_decode_errors(tmp_path):
    plan = live_plan(connector="nixl", num_prefill=2, num_decode=2)
    log = tmp_path / "decode-0.log"
    log.write_text("INFO start\nERROR nixl handshake_setup_failed: Resource temporarily unavailable\n")
    calls = []

    def warm(plan, pair, timeout):
        calls.append(pair.name)
        if pair.prefill.name == "prefill-1":
            raise http.HttpError(pair.decode.url + "/v1/completions", "HTTP 500: KV transfer failed", 500)

    t0 = time.monotonic()
    with pytest.raises(pairs.PdPathFailed) as e:
        pairs.warm_pairs(plan, deadline=t0 + 1.0, logs={"decode-0": log}, warm=warm, tick=0.1)
    took = time.monotonic() - t0
    assert took >= 1.0
    within(took - 1.0, 5.0, "the wait past the 1 s deadline (the pair fails for ever)")
    msg = str(e.value)
    assert "pair prefill-1 -> decode-0" in msg and "HTTP 500: KV transfer failed" in msg
    assert "decode-0's error lines (1)" in msg and "handshake_setup_failed" in msg
    assert calls.count("prefill-1 -> decode-0") > 2 and "prefill-1 -> decode-1" not in calls


@pytest.mark.procs
@pytest.mark.parametrize("connector", ["mooncake", "nixl"])
def test_fake_cluster_whose_pd_path_fails_ends_readiness_within_the_budget(tmp_path, connector):
    """Every instance healthy, every request with kv_transfer_params answered 500 by the decode:
    readiness ends after the P/D budget (not the 1200 s deadline), naming the pair, the answer
    and the decode's error lines; then everything is torn down."""
    plan = live_plan(connector=connector)
    msg = _readiness_failure(plan, tmp_path, FAKE_DECODE_BEHAVIOR="fail_kv")
    assert "pair prefill-0 -> decode-0" in msg and "HTTP 500" in msg and "kept failing for 3 s" in msg
    assert "ERROR fake decode: handshake_setup_failed" in msg


def _readiness_failure(plan, tmp_path, **behaviors) -> str:
    """Start ``plan`` on the fake stack with a 3 s P/D budget; readiness must fail within 15 s
    (not the 1200 s deadline): its message."""
    t0 = time.monotonic()
    with (
        pytest.raises(pairs.PdPathFailed) as e,
        running_cluster(
            plan, tmp_path / "run", base_env=fake_stack_env(**behaviors), pd_path_budget_s=3.0, grace_s=2
        ),
    ):
        pytest.fail("the cluster must not become ready")
    within(time.monotonic() - t0, 60.0, "a failing readiness with a 3 s P/D budget (deadline: 1200 s)")
    return str(e.value)


@pytest.mark.procs
def test_a_stuck_kv_pull_at_readiness_names_the_decode_and_what_it_waits_for(tmp_path):
    plan = live_plan(connector="mooncake")
    msg = _readiness_failure(plan, tmp_path, FAKE_DECODE_BEHAVIOR="stuck_pull:0")
    boot = f"bootstrap http://127.0.0.1:{plan.prefill[0].bootstrap_port}"
    assert "pair prefill-0 -> decode-0" in msg and "no answer within" in msg
    assert f"stuck: decode-0 waits for KV from prefill-0 ({boot}) (1 deferred" in msg
    assert "no prefill is computing: the KV pull is stuck" in msg


@pytest.mark.procs
def test_a_stuck_kv_pull_during_checks_fails_fast_naming_the_instance(tmp_path, monkeypatch):
    """Readiness passes (two pulls: the pair warm-up and the router probe), then every pull
    hangs: the first check fails after the request bound with what is stuck, the rest at once."""
    from pd_sessions.checks import runner

    monkeypatch.setattr(runner, "CHECK_REQUEST_TIMEOUT_S", 2.0)
    plan = live_plan(connector="mooncake")
    results = []
    with running_cluster(
        plan, tmp_path / "run", base_env=fake_stack_env(FAKE_DECODE_BEHAVIOR="stuck_pull:2"), grace_s=2
    ) as cluster:
        t0 = time.monotonic()
        runner.run_checks(cluster, results, skip=("accuracy",))
        took = time.monotonic() - t0
    within(took, 12.0, "11 checks, the first stuck for its 2 s bound (each stuck: 22 s)")
    by = {r.name: r for r in results}
    # 10 checks and conservation, which probes nothing on a stuck path
    assert [r.verdict for r in results] == ["fail"] * len(results) and len(results) == 11
    assert by["conservation"].message.startswith("not run: the P/D path is stuck")
    assert "no answer within 2 s" in by["smoke"].message
    assert "stuck: decode-0 waits for KV from prefill-0" in by["smoke"].message
    assert by["parity"].message.startswith("not run: the P/D path is stuck (smoke got no answer within 2 s")


@pytest.mark.procs
def test_a_router_whose_pd_hop_keeps_failing_ends_readiness_with_its_answer(tmp_path):
    """The pairs warm (direct hops work), but every completion through the router gets HTTP 500:
    readiness ends after the budget with the router's answer and the decode's error lines."""
    plan = live_plan(connector="nixl")
    msg = _readiness_failure(plan, tmp_path, FAKE_ROUTER_BEHAVIOR="fail_pd")
    # the budget is shared with the pair warm-up before it: under load the router phase gets less
    head = rf"router \({re.escape(plan.router.url)}\): the P/D path kept failing for \d+ s"
    assert re.match(head, msg), msg
    assert "router's answer to a 1-token completion:" in msg and "HTTP 500" in msg
    assert "decode hop failed: KV transfer error" in msg and "--- decode-0's error lines" in msg


@pytest.mark.procs
def test_both_hops_carry_one_request_id_and_the_specs_params():
    """A real HTTP server stands in for both instances: the prefill hop asks for a remote decode,
    the decode hop carries what the prefill answered, and both carry the same X-Request-Id (push
    mode matches the decode's registration to the prefill's finished blocks by it; vllm-router
    sends it too)."""
    import json as _json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    seen: list[tuple[str, str | None, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = _json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers.get("X-Request-Id"), body["kv_transfer_params"]))
            out = {"kv_transfer_params": {"remote_engine_id": "p0", "transfer_mode": "push"}}
            data = _json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        spec = lambda name: SimpleNamespace(name=name, url=url, host="127.0.0.1", bootstrap_port=None)
        plan = SimpleNamespace(
            config=ClusterConfig(name="c", model="m", connector="nixl_push"), served_model_name="m"
        )
        pairs.warm_pair(plan, pairs.Pair(spec("prefill-0"), spec("decode-0")), timeout=10)
    finally:
        server.shutdown()
        server.server_close()
    (_, pid, pparams), (_, did, dparams) = seen
    assert pid == did and pid.startswith("pd-warm-")
    assert pparams["do_remote_decode"] is True
    assert dparams == {"remote_engine_id": "p0", "transfer_mode": "push"}
