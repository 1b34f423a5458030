"""pd_calls, fault_hop_retry and kv_capacity (docs/hop-faults.md): each check fed the bad case
(an extra call, a smaller KV capacity) fails; a declared retry passes; what could not be measured
is NOT RUN. The fault proxy itself runs for real here against a fake upstream and is stopped by
process group, verified gone."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import psutil
import pytest
from helpers.builders import cfg

from pd_sessions.checks import kv_capacity, pd_calls
from pd_sessions.checks.faults import hop_retry
from pd_sessions.core.errors import ConfigError
from pd_sessions.core.results import FAIL, NOT_RUN, PASS
from pd_sessions.runtime import http, process
from pd_sessions.runtime.ports import PortAllocator

# ---------------------------------------------------------------- pd_calls


METRICS = """# TYPE http_requests_total counter
http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 5.0
http_requests_total{handler="/v1/completions",method="POST",status="5xx"} 1.0
http_requests_total{handler="/v1/models",method="GET",status="2xx"} 9.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 4.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 2.0
"""


def test_parse_counts_completion_calls_of_any_status_and_finished_engine_requests():
    assert pd_calls.parse(METRICS) == pd_calls.Calls(http=6.0, engine=6.0)
    assert pd_calls.parse("# nothing\n") == pd_calls.Calls(None, None)


def test_calls_between_takes_the_larger_growth_and_none_when_nothing_is_exposed():
    before = pd_calls.Calls(http=6.0, engine=4.0)
    assert pd_calls.calls_between(before, pd_calls.Calls(http=8.0, engine=5.0)) == 2
    assert pd_calls.calls_between(before, pd_calls.Calls(http=7.0, engine=6.0)) == 2
    assert pd_calls.calls_between(pd_calls.Calls(None, 1.0), pd_calls.Calls(None, 2.0)) == 1
    assert pd_calls.calls_between(pd_calls.Calls(None, None), pd_calls.Calls(None, None)) is None


def req(i, prefill=1, decode=1, ok=True):
    return pd_calls.RequestCalls(
        i, ok, "text" if ok else "HTTP 500: boom", {"prefill-0": prefill, "decode-0": decode}
    )


def test_one_call_per_hop_passes():
    r = pd_calls.evaluate([req(1), req(2), req(3)], declared_retries=0)
    assert r.verdict == PASS, r.message
    assert "each made 1 prefill and 1 decode call" in r.message


def test_an_extra_decode_call_fails_naming_the_request_the_instance_and_the_fix():
    r = pd_calls.evaluate([req(1), req(2, decode=2)], declared_retries=0)
    assert r.verdict == FAIL
    assert "request 2 made 2 decode call(s) (decode-0: 2)" in r.message
    assert "the client got HTTP 200 for request(s) [2]: a retry masked a failing hop" in r.message
    assert "declared_retries = N" in r.message
    assert r.details["masked"] == [2]


def test_an_extra_prefill_call_and_a_missing_decode_call_fail_too():
    r = pd_calls.evaluate([req(1, prefill=2), req(2, decode=0, ok=False)], declared_retries=0)
    assert r.verdict == FAIL
    assert "request 1 made 2 prefill call(s)" in r.message and "request 2 made 0 decode call(s)" in r.message


def test_a_declared_retry_passes_and_one_more_than_declared_fails():
    assert pd_calls.evaluate([req(1, decode=2)], declared_retries=1).verdict == PASS
    r = pd_calls.evaluate([req(1, decode=3)], declared_retries=1)
    assert r.verdict == FAIL and "allowed 1 to 2 per hop (declared_retries = 1)" in r.message


def test_uncounted_calls_are_not_run_naming_the_instance():
    r = pd_calls.evaluate(
        [pd_calls.RequestCalls(1, True, "t", {"prefill-0": 1, "decode-0": None})], declared_retries=0
    )
    assert r.verdict == NOT_RUN and "decode-0" in r.message
    assert pd_calls.evaluate([], declared_retries=0).verdict == NOT_RUN


def test_per_instance_calls_sum_over_a_role():
    r = pd_calls.RequestCalls(1, True, "t", {"prefill-0": 1, "decode-0": 1, "decode-1": 1})
    assert r.role("decode") == 2 and r.role("prefill") == 1


@pytest.mark.parametrize("value", [-1, 11, True, "1", 1.0])
def test_declared_retries_is_validated_and_named(value):
    with pytest.raises(ConfigError) as e:
        cfg(declared_retries=value)
    assert e.value.field == "declared_retries"
    assert "declared_retries: got" in str(e.value) and "an integer from 0 to 10" in str(e.value)


def test_declared_retries_defaults_to_zero():
    assert cfg().declared_retries == 0


# ---------------------------------------------------------------- fault_hop_retry (pure)

RETRIED = ["hop_fault: call 1: first attempt dropped after 20 of 40 body bytes; retry -> HTTP 200"]


def test_hop_retry_passes_when_pd_calls_catches_every_extra_call():
    r = hop_retry.evaluate([req(1, decode=2), req(2, decode=2)], RETRIED * 2, declared_retries=0)
    assert r.verdict == PASS, r.message
    assert r.details["detected"] == "2/2" and r.details["pd_calls"]["verdict"] == FAIL
    assert "pd_calls caught 2/2 retried decode calls (clients got HTTP 200 for 2)" in r.message


def test_hop_retry_fails_when_an_extra_call_goes_unseen():
    r = hop_retry.evaluate([req(1, decode=2), req(2)], RETRIED * 2, declared_retries=0)
    assert r.verdict == FAIL and "pd_calls saw 1/2" in r.message


def test_hop_retry_declared_passes_only_when_pd_calls_passes():
    assert hop_retry.evaluate([req(1, decode=2)], RETRIED, declared_retries=1).verdict == PASS
    assert hop_retry.evaluate([req(1, decode=3)], RETRIED, declared_retries=1).verdict == FAIL


def test_hop_retry_without_a_retried_call_or_counters_is_not_run():
    r = hop_retry.evaluate([req(1, decode=2)], [], declared_retries=0)
    assert r.verdict == NOT_RUN and r.message.startswith("invalid: no decode call was retried")
    unmeasured = pd_calls.RequestCalls(1, True, "t", {"prefill-0": None, "decode-0": None})
    r = hop_retry.evaluate([unmeasured], RETRIED, declared_retries=0)
    assert r.verdict == NOT_RUN and r.message.startswith("pd_calls could not count")


# ---------------------------------------------------------------- the fault proxy, for real


class _Upstream(BaseHTTPRequestHandler):
    """Records each POST body it was sent: whole, or cut short."""

    protocol_version = "HTTP/1.1"
    posts: ClassVar[list[str]] = []

    def log_message(self, *args):
        pass

    def _answer(self, status, body):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._answer(200, b"{}")

    def do_POST(self):
        want = int(self.headers["Content-Length"])
        body = self.rfile.read(want)
        type(self).posts.append("whole" if len(body) == want else f"cut at {len(body)} of {want}")
        if len(body) == want:
            self._answer(200, json.dumps({"posts": type(self).posts}).encode())


@pytest.mark.procs
def test_the_proxy_drops_the_first_attempt_midway_retries_and_the_client_sees_success(tmp_path):
    _Upstream.posts = []
    up = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=up.serve_forever, daemon=True).start()
    with PortAllocator() as ports:
        port = ports.take("hop")
    log = tmp_path / "hop.log"
    argv = [sys.executable, "-m", "pd_sessions.runtime.hop_fault", "--port", str(port)]
    argv += ["--upstream", f"http://127.0.0.1:{up.server_port}"]
    p = process.spawn("hop", argv, env=dict(os.environ), log_path=log)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                http.request(f"{url}/health", timeout=1.0)
                break
            except http.HttpError:
                time.sleep(0.05)
        got = http.post_json(f"{url}/v1/completions", {"prompt": "hello there"}, timeout=10.0)
    finally:
        family = [p.pid, *(q.pid for q in psutil.Process(p.pid).children(recursive=True))]
        process.stop([p], grace_s=5.0)
        up.shutdown()
    assert not [q for q in family if psutil.pid_exists(q) and psutil.Process(q).status() != "zombie"]
    body = len(json.dumps({"prompt": "hello there"}))
    assert got["posts"][-1] == "whole"  # the retry's answer reached the client
    # the cut attempt's handler records it once its connection is dropped, on its own thread: on a
    # busy host after the retry answered (so not always in the answer's snapshot)
    deadline = time.monotonic() + 30.0
    while len(_Upstream.posts) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(_Upstream.posts) == [f"cut at {body // 2} of {body}", "whole"]
    (line,) = hop_retry.retried_lines([log])
    assert (
        line == f"hop_fault: call 1: first attempt dropped after {body // 2} of {body} body bytes; "
        "retry -> HTTP 200"
    )


# ---------------------------------------------------------------- kv_capacity


def cache_info(tokens=None, blocks=None, block_size=128, memory=None):
    labels = {"engine": "0", "block_size": str(block_size), "num_gpu_blocks": str(blocks),
              "kv_cache_size_tokens": str(tokens), "kv_cache_memory_bytes": str(memory)}  # fmt: skip
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{{inner}}} 1.0\n"


def test_capacity_reads_tokens_else_blocks_times_block_size():
    assert kv_capacity.capacity(cache_info(tokens=8192, blocks=64, memory=2**30)) == {
        "tokens": 8192.0,
        "memory_bytes": float(2**30),
    }
    assert kv_capacity.capacity(cache_info(blocks=64))["tokens"] == 64 * 128
    assert kv_capacity.capacity("# nothing\n") == {"tokens": None, "memory_bytes": None}


def measured(decode_tokens, ref=8192.0):
    return {
        "prefill-0": {"tokens": ref, "memory_bytes": 2.0**30},
        "decode-0": {"tokens": decode_tokens, "memory_bytes": 2.0**29},
    }


TP1 = {"prefill-0": 1, "decode-0": 1}


def test_a_decode_with_half_the_kv_fails_naming_it_and_the_numbers():
    r = kv_capacity.evaluate(measured(4096.0), TP1, min_ratio=0.9)
    assert r.verdict == FAIL
    assert "decode-0 holds 4096 tokens of KV (kv_cache_memory_bytes 536870912) against prefill-0's 8192" in (
        r.message
    )
    assert "50%" in r.message and "below 90%" in r.message


def test_the_same_capacity_passes():
    r = kv_capacity.evaluate(measured(8192.0), TP1, min_ratio=0.9)
    assert r.verdict == PASS and "100% or more of prefill-0's 8192 tokens" in r.message


def test_capacity_that_could_not_be_measured_or_compared_is_not_run():
    assert kv_capacity.evaluate(measured(None), TP1, min_ratio=0.9).verdict == NOT_RUN
    r = kv_capacity.evaluate(measured(4096.0, ref=None), TP1, min_ratio=0.9)
    assert r.verdict == NOT_RUN and "prefill-0 exposes no KV capacity" in r.message
    r = kv_capacity.evaluate(measured(4096.0), {"prefill-0": 1, "decode-0": 2}, min_ratio=0.9)
    assert r.verdict == NOT_RUN and "no instance shares its TP" in r.message
    assert r.details["instances"]["decode-0"]["judged"] == "no: another TP than the reference"


def test_the_failure_says_whether_memory_or_layout_lost_the_capacity():
    less_memory = kv_capacity.evaluate(measured(4096.0), TP1, min_ratio=0.9)
    assert (
        "the same tokens per byte as the reference: its KV cache memory is 50% of it" in less_memory.message
    )
    same_memory = {
        "prefill-0": {"tokens": 8192.0, "memory_bytes": 2.0**30},
        "decode-0": {"tokens": 4096.0, "memory_bytes": 2.0**30},
    }
    r = kv_capacity.evaluate(same_memory, TP1, min_ratio=0.9)
    assert r.verdict == FAIL
    assert "50% of the reference's tokens per byte: its KV cache memory laid out otherwise" in r.message
    unknown = {
        "prefill-0": {"tokens": 8192.0, "memory_bytes": None},
        "decode-0": {"tokens": 4096.0, "memory_bytes": None},
    }
    assert "cause unknown" in kv_capacity.evaluate(unknown, TP1, min_ratio=0.9).message
