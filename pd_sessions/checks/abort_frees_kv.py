"""abort_frees_kv: N streaming requests through the router whose client disconnects after the
first tokens. Within a bounded time every prefill and decode instance must report no running
request (``vllm:num_requests_running``) and KV cache usage (``vllm:kv_cache_usage_perc``) back
at its idle value. Aborted P/D requests that strand KV blocks (on the prefill waiting for a
pull that never comes, or on the decode) fill the cache until a long timeout.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pd_sessions.checks.instances import KV_USAGE, RUNNING, scrape_gauges
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting
from pd_sessions.runtime import http as pdhttp

# KV usage is a fraction of blocks in use; one block of 1 GiB CPU cache is far below this.
USAGE_SLACK = 1e-3
POLL_S = 0.2


def settled(idle: Mapping[str, float], now: Mapping[str, float]) -> str | None:
    """None when one instance's gauges are back to idle, else what is still held.

    running requests > 0                      -> "N requests still running"
    kv usage > idle usage + slack             -> "KV cache usage U (idle I)"
    a gauge missing from the scrape           -> "metric M not exposed"
    """
    for name in (RUNNING, KV_USAGE):
        if name not in now:
            return f"metric {name} not exposed"
    if now[RUNNING] > 0:
        return f"{now[RUNNING]:g} requests still running ({RUNNING})"
    if now[KV_USAGE] > idle.get(KV_USAGE, 0.0) + USAGE_SLACK:
        return f"KV cache usage {now[KV_USAGE]:.4f} (idle {idle.get(KV_USAGE, 0.0):.4f}, {KV_USAGE})"
    return None


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the streams aborted, how long the instances took to be idle, and
    what each held at the end."""
    out: list[Figure | Table] = [
        *pick(
            details, ("requests", ""), ("aborted_after_first_tokens", ""), ("waited_s", "s"), ("bound_s", "s")
        )
    ]
    held = details.get("held") or {}
    if held:
        out.append(
            Table("held at the end", ("instance", "held"), tuple((n, h or "idle") for n, h in held.items()))
        )
    return out


@reporting(numbers)
def evaluate(
    aborted: int,
    requests: int,
    stream_errors: list[str],
    held: Mapping[str, str | None],
    *,
    bound_s: float,
    waited_s: float,
    last: Mapping[str, Mapping[str, float]],
) -> CheckResult:
    """Verdict after the wait: ``held`` is instance -> what it still held at the end (None = idle)."""
    details: dict[str, Any] = {
        "requests": requests,
        "aborted_after_first_tokens": aborted,
        "stream_errors": stream_errors,
        "bound_s": bound_s,
        "waited_s": round(waited_s, 3),
        "held": dict(held),
        "last_gauges": {k: dict(v) for k, v in last.items()},
    }
    if aborted < requests:
        return CheckResult(
            "abort_frees_kv",
            FAIL,
            f"only {aborted}/{requests} streams produced a first "
            f"token before the disconnect: {'; '.join(stream_errors[:2])}",
            details,
        )
    still = {n: h for n, h in held.items() if h is not None}
    if still:
        return CheckResult(
            "abort_frees_kv",
            FAIL,
            f"{bound_s:g} s after {requests} clients disconnected: "
            + "; ".join(f"{n}: {h}" for n, h in still.items()),
            details,
        )
    return CheckResult(
        "abort_frees_kv",
        PASS,
        f"{requests} streams aborted after their first tokens; every "
        f"instance idle again after {waited_s:.1f} s (no running request, KV usage at idle)",
        details,
    )


def stream_then_disconnect(
    base_url: str, model: str, prompt: str, *, max_tokens: int = 512, timeout: float = 60.0
) -> str:
    """Start a streaming completion, read until the first token's chunk arrives, close the socket.
    Returns its text; raises pdhttp.HttpError when none arrived."""
    u = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout)
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
    )
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise pdhttp.HttpError(base_url, f"HTTP {resp.status}: {resp.read(300)!r}", resp.status)
        while True:
            line = resp.readline()
            if not line:
                raise pdhttp.HttpError(base_url, "stream ended before any token")
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):  # a generated token (its text may be held back: partial UTF-8)
                    return chunk["choices"][0].get("text") or ""
    except (OSError, ValueError) as e:
        raise pdhttp.HttpError(base_url, f"{type(e).__name__}: {e}") from None
    finally:
        conn.close()  # the disconnect: the router and vLLM must abort the request


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    plan = window.plan
    n, bound = int(options["requests"]), float(options["bound_s"])
    first_token_s_max = float(options["first_token_s"])
    idle = {s.name: scrape_gauges(s) for s in plan.instances}
    errors: list[str] = []
    first_token_s: list[float] = []

    def one(i: int) -> None:
        t = time.monotonic()
        stream_then_disconnect(
            plan.router.url,
            plan.served_model_name,
            f"Abort test {i}: a long story about the sea begins",
            timeout=first_token_s_max,
        )
        first_token_s.append(round(time.monotonic() - t, 3))

    with ThreadPoolExecutor(max_workers=n) as pool:
        for f in [pool.submit(one, i) for i in range(n)]:
            try:
                f.result()
            except pdhttp.HttpError as e:
                errors.append(str(e))
    t0 = time.monotonic()
    while True:
        last = {s.name: scrape_gauges(s) for s in plan.instances}
        held = {name: settled(idle[name], g) for name, g in last.items()}
        waited = time.monotonic() - t0
        if all(h is None for h in held.values()) or waited >= bound:
            break
        time.sleep(POLL_S)
    result = evaluate(n - len(errors), n, errors, held, bound_s=bound, waited_s=waited, last=last)
    result.details["first_token_s"] = sorted(first_token_s)
    if first_token_s:
        result.figures.append(Figure("first_token_s_max", max(first_token_s), "s"))
    return result
