"""Minimal JSON-over-HTTP client for our own loopback servers (edge).

Built on urllib with proxies disabled: traffic must go straight to the
addresses in the plan, whatever http_proxy says. A request to a simulated host's address
(198.18.0.0/15) is checked first to go through its run's bridge (runtime/routeguard.py):
routeguard's RouteError, not HttpError, when it would not.
"""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Collection, Iterator, Mapping
from typing import Any

# Re-exported: callers catch ``http.HttpError``; it lives with the rest of the family in errors.py.
from pd_sessions.core.errors import HttpError as HttpError
from pd_sessions.runtime import routeguard

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_held: dict[tuple[str, int] | None, int] = {}  # address held (None: every one) -> how many hold it
_held_lock = threading.Lock()


@contextlib.contextmanager
def held(addresses: Collection[tuple[str, int]] | None = None) -> Iterator[None]:
    """No request to ``addresses`` ((host, port); None: to anywhere) leaves this process inside the
    block (HttpError "not sent"): while a cluster is torn down, a check's thread left running must
    not open a new request that the stopping servers would then wait for (cluster.teardown).
    Another cluster's requests (configs side by side, run/sweep.py) still go out."""
    keys = [None] if addresses is None else list(dict.fromkeys(addresses))
    with _held_lock:
        for k in keys:
            _held[k] = _held.get(k, 0) + 1
    try:
        yield
    finally:
        with _held_lock:
            for k in keys:
                _held[k] -= 1
                if not _held[k]:
                    del _held[k]


def _is_held(url: str) -> bool:
    if not _held:
        return False
    if None in _held:
        return True
    u = urllib.parse.urlsplit(url)
    return (u.hostname, u.port) in _held


def request(
    url: str,
    *,
    payload: dict[str, Any] | None = None,
    timeout: float = 5.0,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, bytes]:
    if _is_held(url):
        raise HttpError(url, "not sent: the cluster is being torn down")
    routeguard.check(urllib.parse.urlsplit(url).hostname)
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(
        url,
        data=data,
        method="GET" if data is None else "POST",
        headers={**({"Content-Type": "application/json"} if data else {}), **(headers or {})},
    )
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        body = e.read()[:500].decode("utf-8", errors="replace")
        raise HttpError(url, f"HTTP {e.code}: {body}", e.code) from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ConnectionRefusedError):
            raise HttpError(url, "connection refused") from None
        if isinstance(reason, TimeoutError):
            raise HttpError(url, f"no answer within {timeout:g} s") from None
        raise HttpError(url, f"{type(reason).__name__}: {reason}") from None


def get_text(url: str, *, timeout: float = 5.0) -> str:
    return request(url, timeout=timeout)[1].decode("utf-8", errors="replace")


def post_json(
    url: str, payload: dict[str, Any], *, timeout: float = 60.0, headers: Mapping[str, str] | None = None
) -> dict[str, Any]:
    _, body = request(url, payload=payload, timeout=timeout, headers=headers)
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        raise HttpError(url, f"response is not JSON: {body[:200]!r}") from None


def completion(
    base_url: str, model: str, prompt: str, *, max_tokens: int, timeout: float = 120.0
) -> dict[str, Any]:
    """A greedy /v1/completions request; returns the parsed response."""
    return post_json(
        f"{base_url}/v1/completions",
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": 0,
            "ignore_eos": True,
            # vLLM extension: generated token ids, for token-level parity
            "return_token_ids": True,
        },
        timeout=timeout,
    )
