"""A fault proxy for one hop of the P/D path (vllm-router -> an instance), run as a process:

    python -m pd_sessions.runtime.hop_fault --port P --upstream URL [--host 127.0.0.1]

It forwards everything to ``--upstream`` (the instance), except that each POST is first sent
once and failed, then retried: the first attempt's connection is dropped halfway through the
request's body. The instance's API server has taken the call (its HTTP counter counts it, a 5xx)
but never hands it to its engine, so no KV is pulled or held for it; the retry, sent whole, is
served, and its answer is what the router gets. So the client sees success while the instance was
called twice: what a retrying load balancer or proxy in front of a failing decode does (the
fault_hop_retry check, checks/faults/hop_retry.py). (A first attempt failed after the instance
had taken it whole is no fault to inject into a shared cluster: over Mooncake its retry waits for
KV the prefill already sent, forever; docs/hop-faults.md.)

One line per POST goes to stdout (``hop_fault: call N: first attempt <how>; retry -> HTTP S``):
the check reads them as the proof that the fault happened. Standard library only; it binds
``--host`` (127.0.0.1 unless told otherwise) and stops on SIGTERM.

Why ``python -m`` (not a ``pd-sessions`` subcommand): a process boundary. The check starts it as a
server process of its own, beside the cluster, stopped by its process group; never a user.
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The line prefix the check counts (one per POST the proxy handled).
LOG_PREFIX = "hop_fault: call "
# How long the first attempt's connection stays open with half its body sent: the instance has
# read the headers (its API server takes the call) before the drop.
CUT_AFTER_S = 0.05
TIMEOUT_S = 120.0
# Headers not passed on (hop-by-hop, or recomputed for the body sent).
_SKIP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def make_handler(upstream: str) -> type[BaseHTTPRequestHandler]:
    """The request handler class forwarding to ``upstream`` (scheme://host:port), failing each
    POST's first attempt."""
    target = urllib.parse.urlsplit(upstream)
    host, port = target.hostname or "127.0.0.1", target.port or 80
    calls = iter(range(1, 1 << 62))
    lock = threading.Lock()

    class Hop(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _send(self, body: bytes | None) -> tuple[int, list[tuple[str, str]], bytes]:
            conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _SKIP}
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                return r.status, [(k, v) for k, v in r.getheaders() if k.lower() not in _SKIP], r.read()
            finally:
                conn.close()

        def _fail_first(self, body: bytes) -> str:
            """The first attempt of a POST, its connection dropped halfway through the body."""
            with socket.create_connection((host, port), timeout=TIMEOUT_S) as s:
                head = [f"{self.command} {self.path} HTTP/1.1", f"Host: {host}:{port}"]
                head += [f"{k}: {v}" for k, v in self.headers.items() if k.lower() not in _SKIP]
                head += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
                s.sendall("\r\n".join(head).encode() + body[: len(body) // 2])
                time.sleep(CUT_AFTER_S)
            return f"dropped after {len(body) // 2} of {len(body)} body bytes"

        def _relay(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            try:
                self._relay(*self._send(None))
            except OSError as e:
                self._relay(502, [], f"hop_fault: upstream {upstream}: {e}".encode())

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with lock:
                n = next(calls)
            try:
                first = self._fail_first(body)
                status, headers, data = self._send(body)
            except OSError as e:
                print(f"{LOG_PREFIX}{n}: upstream {upstream}: {e}", flush=True)
                self._relay(502, [], f"hop_fault: upstream {upstream}: {e}".encode())
                return
            print(f"{LOG_PREFIX}{n}: first attempt {first}; retry -> HTTP {status}", flush=True)
            self._relay(status, headers, data)

    return Hop


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="the instance's URL, e.g. http://127.0.0.1:8100")
    args = ap.parse_args(argv)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(args.upstream.rstrip("/")))
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # it holds nothing to close
    print(f"hop_fault: listening on {args.host}:{args.port} -> {args.upstream}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
