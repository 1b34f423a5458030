"""The vLLM plugin's shims: the pure parts with fakes, and NIXL's progress thread for real.

The real test starts a NIXL agent (UCX backend, as vLLM's NIXL connector creates it) in a
child process and measures the process's CPU time while it sits idle: NIXL's own setting spins
a core; with PD_SESSIONS_NIXL_PROGRESS_DELAY_US the thread sleeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.needs import needs

from pd_sessions.core.connectors.nixl import HANDSHAKE, KEEP_CORES
from pd_sessions.vllm_side.vllm_plugin import (
    NIXL_DELAY_ENV,
    HandshakeQuery,
    ListenerSocket,
    answering_late,
    apply_nixl_handshake_timeout,
    apply_nixl_keep_cores,
    apply_nixl_progress_delay,
    handshake_timeout_s,
    keeping_cores,
    listener_delay_s,
    nixl_delay_us,
    shim_needed,
    with_handshake_timeout,
    with_progress_delay,
)

ROOT = Path(__file__).resolve().parent.parent


def test_mooncake_shim_only_without_an_accelerator_and_once():
    assert shim_needed(False, False)
    assert not shim_needed(True, False)
    assert not shim_needed(False, True)


@pytest.mark.parametrize(("raw", "want"), [(None, None), ("", None), (" ", None), ("1000", 1000), ("5", 5)])
def test_delay_read_from_the_environment(raw, want):
    assert nixl_delay_us({} if raw is None else {NIXL_DELAY_ENV: raw}) == want


@pytest.mark.parametrize("raw", ["0", "-1", "1ms", "1.5"])
def test_a_bad_delay_names_the_variable_and_the_fix(raw):
    with pytest.raises(ValueError, match=rf"{NIXL_DELAY_ENV}='{raw}'.*whole number of microseconds above 0"):
        nixl_delay_us({NIXL_DELAY_ENV: raw})


def test_a_bad_delay_is_ignored_by_the_plugin_with_its_reason(capsys):
    assert not apply_nixl_progress_delay({NIXL_DELAY_ENV: "soon"})
    assert f"pd_sessions: ignored: {NIXL_DELAY_ENV}='soon'" in capsys.readouterr().err


def _config(prog: bool = True, delay: int = 0) -> SimpleNamespace:
    return SimpleNamespace(useProgThread=prog, pthrDelay=delay)


def test_the_wrapped_constructor_sets_the_delay_where_nixl_left_it_at_zero(capsys):
    made = []
    create = with_progress_delay(lambda name, config: made.append((name, config.pthrDelay)) or "agent", 1000)
    assert create("a", _config()) == "agent"
    create("b", _config(delay=250))  # set by whoever built the config: kept
    create("c", _config(prog=False))  # no progress thread: nothing to delay
    assert made == [("a", 1000), ("b", 250), ("c", 0)]
    err = capsys.readouterr().err
    assert err.count("progress thread polls every 1000 us") == 1 and "NIXL agent a:" in err


_IDLE_AGENT = textwrap.dedent("""
    import json, os, sys, time
    from pd_sessions.vllm_side.vllm_plugin import apply_nixl_progress_delay
    wrapped = apply_nixl_progress_delay(os.environ)
    wrapped_again = apply_nixl_progress_delay(os.environ)
    from nixl._api import nixl_agent, nixl_agent_config
    agent = nixl_agent("idle", nixl_agent_config(num_threads=0))
    time.sleep(0.5)  # let the backend settle
    t0, c0 = time.monotonic(), time.process_time()
    time.sleep(2.0)
    t1, c1 = time.monotonic(), time.process_time()
    print(json.dumps({"wrapped": wrapped, "again": wrapped_again,
                      "cpu_share": (c1 - c0) / (t1 - t0)}), flush=True)
    os._exit(0)  # the agent's threads: no orderly shutdown needed for a measurement
""")


def _idle_agent(env_delay: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != NIXL_DELAY_ENV}
    env["PYTHONPATH"] = str(ROOT)
    if env_delay is not None:
        env[NIXL_DELAY_ENV] = env_delay
    return subprocess.Popen(
        [sys.executable, "-c", _IDLE_AGENT],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _measured(agent: subprocess.Popen) -> dict:
    out, err = agent.communicate(timeout=120)
    assert agent.returncode == 0, err[-3000:]
    return {**json.loads(out.strip().splitlines()[-1]), "stderr": err}


@pytest.mark.procs
def test_an_idle_nixl_agent_spins_a_core_unless_the_delay_is_set():
    """Both agents run side by side, so they share whatever load the machine has, and each is the
    other's baseline: a bound on the spinning agent's own share failed on 2 busy cores (0.49, and
    0.14 beside two busy loops, where an idle machine gives 1.0: its progress thread polls with
    syscalls and gets less than a plain busy loop). A sleeping thread's share is not raised by load."""
    needs("nixl._api")
    spinning, calm = (_measured(a) for a in (_idle_agent(None), _idle_agent("1000")))
    assert not spinning["wrapped"] and calm["wrapped"] and not calm["again"], (spinning, calm)
    assert "progress thread polls every 1000 us" in calm["stderr"]
    # NIXL's own setting: its progress thread alone keeps a core busy; with the delay it sleeps
    assert spinning["cpu_share"] > 5 * calm["cpu_share"], (spinning, calm)
    assert calm["cpu_share"] < 0.2, calm
    print(
        f"\nidle NIXL agent, CPU share: {spinning['cpu_share']:.2f} as NIXL sets it, "
        f"{calm['cpu_share']:.3f} with {NIXL_DELAY_ENV}=1000 (the two side by side)"
    )


@pytest.mark.procs
def test_a_nixl_without_the_binding_we_wrap_is_said_not_silently_skipped(monkeypatch, capsys):
    """A NIXL whose Python API changed shape: the delay cannot be applied, and the log says so."""
    needs("nixl._api")
    import nixl._api

    module = sys.modules[nixl._api.nixl_agent.__module__]
    monkeypatch.setattr(module, "nixlBind", SimpleNamespace())
    assert not apply_nixl_progress_delay({NIXL_DELAY_ENV: "1000"})
    assert f"{NIXL_DELAY_ENV} not applied" in capsys.readouterr().err


def _affinity_in_a_thread(call):
    """(cores before, cores after) of a fresh thread that runs ``call`` (affinity is per thread:
    the test's own stays as it is)."""
    import threading

    out = {}

    def run():
        out["before"] = os.sched_getaffinity(0)
        call()
        out["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    return out["before"], out["after"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move a thread between")
def test_the_nixl_worker_leaves_its_thread_on_its_cores(capsys):
    """A worker __init__ that moves its thread to the last core (as vLLM's NIXL worker does on a
    CPU host) leaves it where it was once wrapped, and says so once; unwrapped, it moves."""
    last = max(os.sched_getaffinity(0))

    class Worker:
        def __init__(self, x):
            self.x = x
            os.sched_setaffinity(0, {last})

    def build():
        Worker(1)

    before, after = _affinity_in_a_thread(build)
    assert after == {last} != before  # the can-fail side: NIXL's move, unwrapped
    Worker.__init__ = keeping_cores(Worker.__init__)
    before, after = _affinity_in_a_thread(build)
    assert after == before != {last}
    err = capsys.readouterr().err
    assert f"stays on cores {sorted(before)} (the worker moved it to [{last}]; {KEEP_CORES.env})" in err


@pytest.mark.procs
def test_the_plugin_wraps_vllms_nixl_worker_only_when_asked():
    """In a fresh interpreter: with the variable, vLLM's own NIXL worker class is wrapped (once);
    without it, left alone."""
    needs("vllm")
    needs("nixl._api")
    code = textwrap.dedent(f"""
        import importlib, json, os
        from pd_sessions.vllm_side import vllm_plugin
        first = vllm_plugin.apply_nixl_keep_cores(os.environ)
        again = vllm_plugin.apply_nixl_keep_cores(os.environ)
        cls = getattr(importlib.import_module({KEEP_CORES.module!r}), {KEEP_CORES.worker_class!r})
        print(json.dumps([first, again, getattr(cls.__init__, "_pd_sessions_keeps_cores", False)]))
    """)
    for value, want in (("1", [True, False, True]), ("", [False, False, False])):
        env = {**os.environ, KEEP_CORES.env: value, "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
        )
        assert json.loads(out.stdout.strip().splitlines()[-1]) == want, out.stderr[-2000:]
    assert not apply_nixl_keep_cores({})


# --- NIXL's handshake answer timeout (PD_SESSIONS_NIXL_HANDSHAKE_TIMEOUT_S) ----------------------


@pytest.mark.parametrize(("raw", "want"), [(None, None), ("", None), ("20", 20.0), ("5.5", 5.5)])
def test_handshake_timeout_read_from_the_environment(raw, want):
    assert handshake_timeout_s({} if raw is None else {HANDSHAKE.env: raw}) == want


@pytest.mark.parametrize("raw", ["5", "0", "-1", "20s"])
def test_a_handshake_timeout_not_above_vllms_names_the_variable_and_the_fix(raw):
    with pytest.raises(ValueError, match=rf"{HANDSHAKE.env}='{raw}'.*seconds above vLLM's own 5"):
        handshake_timeout_s({HANDSHAKE.env: raw})
    assert not apply_nixl_handshake_timeout({HANDSHAKE.env: raw})


class _Sock:
    """A socket that records its options and answers (or raises) from a list."""

    def __init__(self, answers):
        self.options, self.answers, self.closed = {}, list(answers), False

    def setsockopt(self, opt, value):
        self.options[opt] = value

    def recv_multipart(self):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def send(self, msg):
        self.sent = msg


RCVTIMEO, REQ, ROUTER = 27, 3, 6  # pyzmq's values; any distinct ints do here


def test_the_query_gets_the_longer_timeout_and_says_how_long_each_answer_took(capsys):
    sock = _Sock([[b"meta", b"ts"], TimeoutError("Resource temporarily unavailable")])
    q = HandshakeQuery(sock, RCVTIMEO, 20, "tcp://127.0.0.1:5601")
    q.setsockopt(RCVTIMEO, HANDSHAKE.vllm_ms)  # what vLLM's _nixl_handshake sets
    q.setsockopt(RCVTIMEO, 1234)  # any other value is left alone
    q.setsockopt(99, HANDSHAKE.vllm_ms)  # and so is any other option
    assert sock.options == {RCVTIMEO: 1234, 99: HANDSHAKE.vllm_ms}
    q.setsockopt(RCVTIMEO, HANDSHAKE.vllm_ms)
    assert sock.options[RCVTIMEO] == 20000
    q.send(b"q")  # everything else is the socket's own
    assert sock.sent == b"q" and q.recv_multipart() == [b"meta", b"ts"]
    with pytest.raises(TimeoutError):
        q.recv_multipart()
    err = capsys.readouterr().err
    assert "NIXL handshake query to tcp://127.0.0.1:5601 (sent by " in err
    assert "): answered after 0.0" in err and "(timeout 20 s)" in err
    assert "past vLLM's" not in err  # answered at once
    assert "): no answer within 0.0 s" in err


def test_the_wrapped_factory_wraps_the_query_and_the_listener_and_is_marked(capsys):
    opened = []

    @__import__("contextlib").contextmanager
    def zmq_ctx(socket_type, addr):
        opened.append((socket_type, addr))
        yield _Sock([[b"id", b"", b"q"]])

    wrapped = with_handshake_timeout(zmq_ctx, REQ, RCVTIMEO, 20)
    assert wrapped._pd_sessions_handshake_s == 20
    with wrapped(REQ, "tcp://a:1") as q, wrapped(ROUTER, "tcp://b:2") as listener:
        assert isinstance(q, HandshakeQuery) and isinstance(listener, ListenerSocket)
        assert listener.recv_multipart() == [b"id", b"", b"q"]
    assert opened == [(REQ, "tcp://a:1"), (ROUTER, "tcp://b:2")]
    assert "NIXL side-channel listener read a handshake query at " in capsys.readouterr().err


_LATE_LISTENER = """
import json, os, sys, threading, time, zmq
from pd_sessions.vllm_side import vllm_plugin
first = vllm_plugin.apply_nixl_handshake_timeout(os.environ)
again = vllm_plugin.apply_nixl_handshake_timeout(os.environ)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker, base_scheduler
path = "tcp://127.0.0.1:" + sys.argv[1]
def listen():  # vLLM's listener, answering late (as a starved peer engine's thread does)
    with base_scheduler.zmq_ctx(zmq.ROUTER, path) as sock:
        identity, _, msg = sock.recv_multipart()
        time.sleep(float(sys.argv[2]))
        sock.send_multipart((identity, b"", b"meta", b"ts"))
threading.Thread(target=listen, daemon=True).start()
time.sleep(0.5)
with base_worker.zmq_ctx(zmq.REQ, path) as sock:  # as vLLM's _nixl_handshake does
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.send(b"GET_META_MSG")
    try:
        answer = sock.recv_multipart()[0].decode()
    except zmq.Again:
        answer = "zmq.Again"
print(json.dumps([first, again, answer]))
"""


@pytest.mark.procs
def test_a_handshake_answered_after_vllms_5_s_fails_unless_the_plugin_waits_longer():
    """vLLM's own zmq_ctx and socket options, in a fresh interpreter: a listener that answers 6 s
    after the query fails vLLM's handshake (zmq.Again after its fixed 5 s) and succeeds once the
    plugin gives it 20 s; the query's log says it came past vLLM's 5 s."""
    needs("vllm")
    needs("nixl._api")
    import socket

    for value, want in (("20", [True, False, "meta"]), ("", [False, False, "zmq.Again"])):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, HANDSHAKE.env: value, "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, "-c", _LATE_LISTENER, str(port), "6"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert json.loads(out.stdout.strip().splitlines()[-1]) == want, out.stderr[-2000:]
        if value:
            assert "answered after 6." in out.stderr and "past vLLM's 5 s" in out.stderr, out.stderr[-2000:]
            assert "side-channel listener read a handshake query at " in out.stderr


@pytest.mark.parametrize(("raw", "want"), [(None, 0.0), ("", 0.0), ("0", 0.0), ("8", 8.0), ("0.5", 0.5)])
def test_the_decode_listeners_delay_read_from_the_environment(raw, want):
    assert listener_delay_s({} if raw is None else {HANDSHAKE.decode_delay_env: raw}) == want


@pytest.mark.parametrize("raw", ["-1", "soon"])
def test_a_bad_listener_delay_names_the_variable_and_is_ignored(raw, capsys):
    with pytest.raises(ValueError, match=rf"{HANDSHAKE.decode_delay_env}='{raw}': give a number of seconds"):
        listener_delay_s({HANDSHAKE.decode_delay_env: raw})
    assert not apply_nixl_handshake_timeout({HANDSHAKE.decode_delay_env: raw})
    assert f"pd_sessions: ignored: {HANDSHAKE.decode_delay_env}" in capsys.readouterr().err


def test_only_a_decodes_listener_answers_late(monkeypatch, capsys):
    """The fault reaches the listener of a KV consumer only (the decode's), not a producer's or a
    kv_both's, and the listener holds each query that long before answering."""
    from pd_sessions.vllm_side import vllm_plugin

    monkeypatch.setitem(vllm_plugin._LISTENER, "delay_s", 0.0)
    started = []

    def set_metadata(self, metadata):
        started.append(vllm_plugin._LISTENER["delay_s"])

    wrapped = answering_late(set_metadata, 0.2)
    for consumer, producer in ((False, True), (True, True), (True, False)):
        kv = SimpleNamespace(is_kv_consumer=consumer, is_kv_producer=producer)
        wrapped(SimpleNamespace(vllm_config=SimpleNamespace(kv_transfer_config=kv)), {})
    assert started == [0.0, 0.0, 0.2]
    listener = ListenerSocket(_Sock([[b"id", b"", b"q"]]), vllm_plugin._LISTENER["delay_s"])
    import time

    start = time.monotonic()
    assert listener.recv_multipart() == [b"id", b"", b"q"]
    assert time.monotonic() - start >= 0.2
    assert f"answers it 0.2 s late (a fault: {HANDSHAKE.decode_delay_env})" in capsys.readouterr().err
