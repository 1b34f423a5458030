"""Readiness and guarded calls against real processes and a real HTTP server."""

from __future__ import annotations

import http.server
import os
import sys
import threading
import time

import pytest
from helpers.waiting import within

from pd_sessions.core.errors import GuardTimeout, PdError, ProcessExited, ReadinessTimeout
from pd_sessions.runtime.process import spawn, stop
from pd_sessions.runtime.readiness import Target, guarded, health_probe, models_probe, wait_ready


class _Handler(http.server.BaseHTTPRequestHandler):
    healthy = threading.Event()

    def do_GET(self):
        if self.path == "/health":
            code, body = (200, b"") if self.healthy.is_set() else (503, b"starting")
        elif self.path == "/v1/models":
            code, body = 200, b'{"data": [{"id": "tiny"}]}'
        else:
            code, body = 404, b""
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    _Handler.healthy.clear()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture
def sleeper(tmp_path):
    procs = []

    def make(name="sleeper", code="import time; time.sleep(60)"):
        r = spawn(name, [sys.executable, "-c", code], env=os.environ, log_path=tmp_path / f"{name}.log")
        procs.append(r)
        return r

    yield make
    stop(procs, grace_s=2)


@pytest.mark.procs
def test_ready_after_health_then_models(server, sleeper):
    r = sleeper()
    threading.Timer(0.3, _Handler.healthy.set).start()
    t = Target(r, [health_probe(f"{server}/health"), models_probe(server, "tiny")])
    wait_ready([t], deadline=time.monotonic() + 10, tick=0.02)
    assert t.ready_at is not None and t.stage == 2


def test_models_probe_requires_the_model(server):
    _Handler.healthy.set()
    assert "not 'other'" in models_probe(server, "other")()


@pytest.mark.procs
def test_dead_process_fails_fast_with_log_tail(server, sleeper):
    r = sleeper(
        "decode-0", "import sys, time; print('boom: bad flag', flush=True); time.sleep(0.5); sys.exit(3)"
    )
    t = Target(r, [health_probe(f"{server}/health")])
    t0 = time.monotonic()
    with pytest.raises(ProcessExited) as e:
        wait_ready([t], deadline=time.monotonic() + 30, tick=0.05)
    within(time.monotonic() - t0, 10.0, "the failure of a process that exits at 0.5 s (deadline 30 s)")
    msg = str(e.value)
    assert "decode-0" in msg and "status 3" in msg and "boom: bad flag" in msg


@pytest.mark.procs
def test_deadline_is_honoured(server, sleeper):
    r = sleeper()
    t = Target(r, [health_probe(f"{server}/health")])
    t0 = time.monotonic()
    with pytest.raises(ReadinessTimeout) as e:
        wait_ready([t], deadline=t0 + 1.0, tick=0.05)
    took = time.monotonic() - t0
    assert took >= 1.0
    within(took - 1.0, 5.0, "the wait past the 1 s deadline (the process lives 60 s)")
    assert "HTTP 503" in str(e.value) and "sleeper" in str(e.value)


@pytest.mark.procs
def test_progress_lines(server, sleeper):
    r = sleeper()
    lines = []
    with pytest.raises(ReadinessTimeout):
        wait_ready(
            [Target(r, [health_probe(f"{server}/health")])],
            deadline=time.monotonic() + 0.6,
            tick=0.05,
            progress_every=0.2,
            progress=lines.append,
        )
    assert lines and "sleeper (HTTP 503" in lines[0]


@pytest.mark.procs
def test_guarded_fails_when_watched_process_dies(sleeper):
    victim = sleeper("router", "import time; time.sleep(0.3)")
    t0 = time.monotonic()
    with pytest.raises(ProcessExited, match=r"router .* while checks ran"):
        guarded(lambda: time.sleep(30), watch=[victim], when="while checks ran")
    within(time.monotonic() - t0, 10.0, "the failure of a process that exits at 0.3 s (the call: 30 s)")


@pytest.mark.procs
def test_guarded_returns_and_reraises(sleeper):
    r = sleeper()
    assert guarded(lambda: 42, watch=[r], when="x") == 42
    with pytest.raises(ZeroDivisionError):
        guarded(lambda: 1 / 0, watch=[r], when="x")


@pytest.mark.procs
def test_guarded_timeout_is_a_pd_error_naming_the_wait(sleeper):
    r = sleeper()
    t0 = time.monotonic()
    with pytest.raises(PdError, match=r"while my command ran: no answer within 0 s") as info:
        guarded(lambda: time.sleep(30), watch=[r], when="while my command ran", timeout=0.3)
    assert isinstance(info.value, GuardTimeout) and info.value.timeout_s == 0.3
    assert not isinstance(info.value, TimeoutError)  # one family: callers catch GuardTimeout or PdError
    within(time.monotonic() - t0, 10.0, "the failure at the 0.3 s timeout (the call: 30 s)")


@pytest.mark.procs
def test_guarded_reports_a_death_even_when_the_call_returns_first(sleeper):
    victim = sleeper("decode-0", "import sys; sys.exit(5)")
    victim.popen.wait(10)
    with pytest.raises(ProcessExited, match=r"decode-0 .* status 5 while checks ran"):
        guarded(lambda: "checks finished (failing fast)", watch=[victim], when="while checks ran")
