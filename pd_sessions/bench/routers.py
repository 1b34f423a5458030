"""vllm-router versus a minimal Python proxy, in front of the same fake backends (edge).

Started here: two fake OpenAI-compatible backends (prefill, decode), vllm-router
in vLLM P/D mode (NIXL-style two-stage hop) and the aiohttp proxy
(:mod:`pd_sessions.bench.py_proxy`) making the same hop. The backends answer at
once with ``max_tokens`` dummy tokens, so the proxies are what is measured.
"direct" is the load generator making both hops itself: the latency a proxy
adds is its latency minus direct's.

1. single requests: one at a time, ``requests`` per target, in rounds that
   alternate the targets (so drift hits all alike): p50 / p99 latency;
2. throughput: ``concurrent_requests`` requests, ``concurrency`` in flight, per
   round and target: requests per second.
Everything shares this host's cores (client, proxies, backends), so throughput
is that of the whole loop, compared under identical conditions.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from pd_sessions.bench.py_proxy import PREFILL_KV
from pd_sessions.bench.stats import percentile, summary
from pd_sessions.core.connectors import NIXL
from pd_sessions.core.errors import BenchError
from pd_sessions.core.plan import router_argv
from pd_sessions.runtime import http, process
from pd_sessions.runtime.ports import PortAllocator
from pd_sessions.runtime.readiness import Target, health_probe, wait_ready

MODEL = "fake"
TARGETS = ("direct", "vllm-router", "python-proxy")


def _backend_argv(python: str, host: str, port: int, role: str) -> list[str]:
    """A fake vLLM instance of ``role`` (prefill or decode) on ``host:port``."""
    argv = [python, "-m", "pd_sessions.bench.fake_backend", "--host", host, "--port", str(port)]
    return [*argv, "--model", MODEL, "--role", role]


def _start(python: str, log_dir: Path, host: str) -> tuple[dict[str, str], list[Target]]:
    """Start the four servers; the URL of each role, and a readiness target per server."""
    ports = PortAllocator(host)
    try:
        pp, dp, rp, rm, yp = (
            ports.take(n) for n in ("prefill", "decode", "router", "router.metrics", "python-proxy")
        )
    finally:
        ports.release()
    url = lambda p: f"http://{host}:{p}"
    urls = {"prefill": url(pp), "decode": url(dp), "vllm-router": url(rp), "python-proxy": url(yp)}
    specs = [
        ("prefill", _backend_argv(python, host, pp, "prefill")),
        ("decode", _backend_argv(python, host, dp, "decode")),
        (
            "vllm-router",
            router_argv(
                python,
                [(urls["prefill"], None)],
                [urls["decode"]],
                kv_connector=NIXL.router_flag,
                host=host,
                port=rp,
                metrics_port=rm,
            ),
        ),
        (
            "python-proxy",
            [
                python,
                "-m",
                "pd_sessions.bench.py_proxy",
                "--host",
                host,
                "--port",
                str(yp),
                "--prefill",
                urls["prefill"],
                "--decode",
                urls["decode"],
            ],
        ),
    ]
    targets = [
        Target(
            process.spawn(name, argv, env=dict(os.environ), log_path=log_dir / f"{name}.log", url=urls[name]),
            [health_probe(f"{urls[name]}/health")],
        )
        for name, argv in specs
    ]
    return urls, targets


async def _one(
    session: aiohttp.ClientSession, target: str, urls: dict[str, str], body: dict[str, Any]
) -> float:
    t = time.perf_counter()
    if target == "direct":
        first = {**body, "max_tokens": 1, "kv_transfer_params": PREFILL_KV}
        async with session.post(f"{urls['prefill']}/v1/completions", json=first) as r:
            r.raise_for_status()
            kv = (await r.json()).get("kv_transfer_params")
        async with session.post(
            f"{urls['decode']}/v1/completions", json={**body, "kv_transfer_params": kv}
        ) as r:
            r.raise_for_status()
            await r.read()
    else:
        async with session.post(f"{urls[target]}/v1/completions", json=body) as r:
            r.raise_for_status()
            data = await r.json()
            if not data.get("choices"):
                raise BenchError(f"{target}: answer without choices: {data}")
    return time.perf_counter() - t


async def _measure(
    urls: dict[str, str],
    *,
    requests: int,
    concurrent_requests: int,
    concurrency: int,
    rounds: int,
    max_tokens: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0.0}
    lat: dict[str, list[float]] = {t: [] for t in TARGETS}
    round_p50: dict[str, list[float]] = {t: [] for t in TARGETS}
    rps: dict[str, list[float]] = {t: [] for t in TARGETS}
    errors: dict[str, int] = dict.fromkeys(TARGETS, 0)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn, trust_env=False) as session:
        for t in TARGETS:  # warm-up: connections, caches
            for _ in range(20):
                await _one(session, t, urls, body)
        per_round = max(1, requests // rounds)
        for rnd in range(rounds):
            order = TARGETS[rnd % len(TARGETS) :] + TARGETS[: rnd % len(TARGETS)]
            for t in order:
                got = [await _one(session, t, urls, body) for _ in range(per_round)]
                lat[t] += got
                round_p50[t].append(percentile(got, 50))
            for t in order:
                todo = iter(range(concurrent_requests))

                async def worker(target: str = t) -> None:
                    for _ in todo:  # noqa: B023 (shared by this round's workers, all awaited below)
                        try:
                            await _one(session, target, urls, body)
                        except (TimeoutError, aiohttp.ClientError, BenchError):
                            errors[target] += 1

                start = time.perf_counter()
                await asyncio.gather(*(worker() for _ in range(concurrency)))
                rps[t].append(concurrent_requests / (time.perf_counter() - start))
            progress(
                f"router bench: round {rnd + 1}/{rounds}: "
                + ", ".join(
                    f"{t} p50 {round_p50[t][-1] * 1e3:.2f} ms, {rps[t][-1]:.0f} req/s" for t in TARGETS
                )
            )
    out: dict[str, Any] = {}
    for t in TARGETS:
        out[t] = {
            "p50_ms": round(percentile(lat[t], 50) * 1e3, 3),
            "p99_ms": round(percentile(lat[t], 99) * 1e3, 3),
            "round_p50_ms": summary([v * 1e3 for v in round_p50[t]]),
            "throughput_rps": summary(rps[t], digits=1),
            "errors": errors[t],
            "samples": len(lat[t]),
        }
    for t in TARGETS[1:]:
        out[t]["added_p50_ms"] = round(out[t]["p50_ms"] - out["direct"]["p50_ms"], 3)
        out[t]["added_p99_ms"] = round(out[t]["p99_ms"] - out["direct"]["p99_ms"], 3)
    return out


def run(
    log_dir: Path,
    *,
    python: str = sys.executable,
    host: str = "127.0.0.1",
    requests: int = 600,
    concurrent_requests: int = 2000,
    concurrency: int = 100,
    rounds: int = 3,
    max_tokens: int = 2,
    progress: Callable[[str], None] = lambda m: None,
) -> dict[str, Any]:
    urls, targets = _start(python, log_dir, host)
    try:
        wait_ready(targets, deadline=time.monotonic() + 60, tick=0.05)
        # vllm-router answers /health before its workers are checked: wait for a real hop
        end = time.monotonic() + 60
        while True:
            try:
                http.completion(urls["vllm-router"], MODEL, "warm", max_tokens=1, timeout=5)
                break
            except http.HttpError as e:
                if time.monotonic() > end:
                    raise BenchError(f"router bench: vllm-router never completed a request: {e}") from e
                time.sleep(0.1)
        progress(
            f"router bench: fake backends, vllm-router and python proxy up; "
            f"{requests} single requests and {rounds} x {concurrent_requests} at "
            f"concurrency {concurrency} per target"
        )
        results = asyncio.run(
            _measure(
                urls,
                requests=requests,
                concurrent_requests=concurrent_requests,
                concurrency=concurrency,
                rounds=rounds,
                max_tokens=max_tokens,
                progress=progress,
            )
        )
    finally:
        process.stop([t.running for t in targets], grace_s=5)
    return {
        "backend": "fake OpenAI-compatible backends (pd_sessions.bench.fake_backend): "
        "answers at once; the proxies are what is measured, not vLLM",
        "hop": "prefill (max_tokens=1, kv_transfer_params.do_remote_decode) then decode "
        f"(vllm-router --vllm-pd-disaggregation --kv-connector {NIXL.router_flag})",
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "rounds": rounds,
        "targets": results,
    }
