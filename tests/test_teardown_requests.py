"""Teardown with requests still in flight, on real throwaway processes shaped like the cluster.

A server stopping gracefully (vLLM's API server under uvicorn) stops accepting and waits for
its open connections to close; its requests, once its engine is aborted, never end. Whoever
still holds a connection to it (a check of ours cancelled mid-request, or the router
forwarding someone else's request, itself waiting for that request while it stops) holds it
up until its SIGKILL at the end of the grace: past Buildkite's 10 s, seen on the CPU lane.
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import threading
import time

import psutil
import pytest
from helpers.waiting import free_port, wait_for_text, wait_until, within

from pd_sessions.core.errors import HttpError
from pd_sessions.runtime import http
from pd_sessions.runtime.cluster import ROUTER_CUT_S, teardown
from pd_sessions.runtime.process import cut_connections, spawn, stop

# Accepts connections and never answers; on SIGTERM stops accepting and exits once every
# connection it has is closed by its peer (uvicorn's "Waiting for connections to close").
GRACEFUL_SERVER = textwrap.dedent("""
    import signal, socket, sys, time
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", int(sys.argv[1])))
    ls.listen()
    ls.setblocking(False)
    stopping, conns = [], []
    signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))
    print("serving".upper(), flush=True)  # the log echoes argv: not the marker itself
    while True:
        if not stopping:
            try:
                c, _ = ls.accept()
                c.setblocking(False)
                conns.append(c)
                print("accepted".upper(), len(conns), flush=True)
            except BlockingIOError:
                pass
        for c in list(conns):
            try:
                if c.recv(65536) == b"":
                    conns.remove(c)
                    c.close()
            except BlockingIOError:
                pass
            except OSError:
                conns.remove(c)
        if stopping and not conns:
            print("every connection closed".upper(), flush=True)
            sys.exit(0)
        time.sleep(0.01)
""")

# A proxy in the middle of forwarding a request: connected to the server, it does not stop
# on SIGTERM while that request is open (vllm-router's graceful shutdown).
FORWARDING_PROXY = textwrap.dedent("""
    import signal, socket, sys, time
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    s.sendall(b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 0\\r\\n\\r\\n")
    signal.signal(signal.SIGTERM, lambda *a: print("SIGTERM: waiting for the request", flush=True))
    print("forwarding".upper(), flush=True)
    time.sleep(600)
""")


def _server(tmp_path, name="decode-0"):
    port = free_port()
    log = tmp_path / f"{name}.log"
    r = spawn(name, [sys.executable, "-c", GRACEFUL_SERVER, str(port)], env=os.environ, log_path=log)
    r.url = f"http://127.0.0.1:{port}"
    wait_for_text(log, "SERVING")
    return r, port


def _proxy(tmp_path, port):
    log = tmp_path / "router.log"
    r = spawn("router", [sys.executable, "-c", FORWARDING_PROXY, str(port)], env=os.environ, log_path=log)
    r.url = f"http://127.0.0.1:{free_port()}"
    wait_for_text(log, "FORWARDING")
    wait_for_text(tmp_path / "decode-0.log", "ACCEPTED 1")  # the server holds it: it will wait for it
    return r


def _request_in_flight(url: str) -> tuple[threading.Thread, list[BaseException]]:
    """A request of ours, blocked in a thread (as a check cancelled mid-request leaves it)."""
    errors: list[BaseException] = []

    def call():
        try:
            http.request(url + "/v1/completions", payload={"prompt": "x"}, timeout=60)
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=call, daemon=True)
    th.start()
    return th, errors


@pytest.mark.procs
def test_a_proxy_still_forwarding_is_cut_early_so_the_server_behind_it_can_end(tmp_path):
    server, port = _server(tmp_path)
    proxy = _proxy(tmp_path, port)
    t0 = time.monotonic()
    rep = stop([proxy, server], grace_s=8.0, early={"router": 0.5})
    took = time.monotonic() - t0
    assert rep.cut == ["router"] and rep.killed == [], rep
    assert took >= 0.5, took
    within(took - 0.5, 3.0, "the stop past the router's cut at 0.5 s (its grace: 8 s)")
    assert "EVERY CONNECTION CLOSED" in (tmp_path / "decode-0.log").read_text()


@pytest.mark.procs
def test_without_the_cut_both_wait_for_each_other_until_sigkill(tmp_path):
    """The deadlock itself: what the cut is for."""
    server, port = _server(tmp_path)
    proxy = _proxy(tmp_path, port)
    t0 = time.monotonic()
    rep = stop([proxy, server], grace_s=1.5)
    # (the server may still see the router's SIGKILL before its own: the router's group is
    # signalled first)
    assert "router" in rep.killed and rep.cut == [], rep
    assert time.monotonic() - t0 >= 1.5


@pytest.mark.procs
def test_early_after_the_grace_is_the_grace(tmp_path):
    server, port = _server(tmp_path)
    proxy = _proxy(tmp_path, port)
    rep = stop([proxy, server], grace_s=1.0, early={"router": 30.0})
    assert rep.killed == ["decode-0", "router"] and rep.cut == [], rep
    within(rep.seconds, 10.0, "the stop with its 1 s grace (the cut: at 30 s)")


@pytest.mark.procs
def test_cut_connections_ends_our_own_request_and_spares_other_connections(tmp_path):
    server, port = _server(tmp_path)
    other, other_port = _server(tmp_path, "bystander")
    try:
        th, errors = _request_in_flight(server.url)
        kept = socket.create_connection(("127.0.0.1", other_port))
        n = wait_until(lambda: cut_connections([("127.0.0.1", port)]), 10, "the request to connect")
        assert n == 1
        th.join(5)
        assert not th.is_alive(), "the request still blocks after its connection was cut"
        assert len(errors) == 1 and isinstance(errors[0], HttpError), errors
        kept.sendall(b"still open")  # not ours to cut: another address
        assert cut_connections([("127.0.0.1", free_port())]) == 0
        kept.close()
    finally:
        stop([server, other], grace_s=2.0)


@pytest.mark.procs
@pytest.mark.parametrize("with_router", [False, True])
def test_teardown_with_requests_in_flight_is_done_in_seconds(tmp_path, with_router):
    """Our request to an instance (a cancelled check), and with the router also forwarding
    another client's request: the teardown ends well inside Buildkite's 10 s, no SIGKILL to
    an instance."""
    server, port = _server(tmp_path)
    router = _proxy(tmp_path, port) if with_router else None
    th, errors = _request_in_flight(server.url)
    wait_for_text(tmp_path / "decode-0.log", "ACCEPTED 2" if with_router else "ACCEPTED 1")
    t0 = time.monotonic()
    teardown(router, [server], grace_s=10.0)
    took = time.monotonic() - t0
    cut = ROUTER_CUT_S if with_router else 0.0  # the router still forwards: SIGKILLed then
    assert took >= cut, took
    within(took - cut, 5.0, "the teardown past the router's cut (its grace: 10 s)")
    assert "EVERY CONNECTION CLOSED" in (tmp_path / "decode-0.log").read_text()
    th.join(5)
    assert errors and isinstance(errors[0], HttpError), errors


def _established(port: int) -> bool:
    return any(
        c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
        for c in psutil.Process().net_connections(kind="tcp")
    )


@pytest.mark.procs
def test_no_request_of_ours_leaves_while_held(tmp_path):
    """A check's thread still running while the cluster is torn down opens no new request."""
    server, port = _server(tmp_path)
    try:
        with http.held():
            with pytest.raises(HttpError, match="not sent: the cluster is being torn down"):
                http.request(server.url + "/health", timeout=1)
            assert not _established(port)
        _request_in_flight(server.url)  # after the block, requests leave again
        wait_until(lambda: _established(port), 10, "a request to leave after the block")
    finally:
        stop([server], grace_s=2.0)


def test_held_addresses_hold_only_that_clusters_requests():
    """Configs side by side: one cluster's teardown holds requests to its own servers only."""
    held, other = ("127.0.0.1", free_port()), ("127.0.0.1", free_port())
    with http.held([held]):
        with pytest.raises(HttpError, match="not sent: the cluster is being torn down"):
            http.request(f"http://{held[0]}:{held[1]}/health", timeout=1)
        with pytest.raises(HttpError, match="connection refused"):  # it left: nobody listens there
            http.request(f"http://{other[0]}:{other[1]}/health", timeout=1)
    with pytest.raises(HttpError, match="connection refused"):  # after the block, requests leave again
        http.request(f"http://{held[0]}:{held[1]}/health", timeout=1)
