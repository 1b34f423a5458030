"""A minimal Python P/D proxy (aiohttp), the comparison point for vllm-router in the benchmark.

    python -m pd_sessions.bench.py_proxy --port P --prefill URL --decode URL [--host 127.0.0.1]

The same two-stage hop vllm-router makes in ``--vllm-pd-disaggregation`` mode
with the NIXL connector (and vLLM's example toy proxy): the request goes to the
prefill instance with ``max_tokens=1`` and ``kv_transfer_params.do_remote_decode``,
then to the decode instance with the original ``max_tokens`` and the
``kv_transfer_params`` the prefill answer carried; the decode answer is returned.
One pooled client session, non-streaming only: just enough to compare.

Why ``python -m`` (not a ``pd-sessions`` subcommand): a process boundary. The router benchmark
(pd_sessions.bench.routers) starts it as a server process of its own, never a user.
"""

from __future__ import annotations

import argparse
import uuid

import aiohttp
from aiohttp import web

from pd_sessions.core.connectors import NIXL

# The prefill hop's kv_transfer_params as the NIXL connector's spec makes them (no transfer id).
PREFILL_KV = NIXL.hops.prefill_params("")


def make_app(prefill: str, decode: str) -> web.Application:
    app = web.Application()

    async def start(app: web.Application) -> None:
        app["client"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def close(app: web.Application) -> None:
        await app["client"].close()

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        client: aiohttp.ClientSession = request.app["client"]
        headers = {"X-Request-ID": str(uuid.uuid4())}
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV}
        async with client.post(f"{prefill}/v1/completions", json=first, headers=headers) as r:
            if r.status != 200:
                return web.Response(status=r.status, body=await r.read())
            kv = (await r.json()).get("kv_transfer_params")
        async with client.post(
            f"{decode}/v1/completions", json={**body, "kv_transfer_params": kv}, headers=headers
        ) as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    app.on_startup.append(start)
    app.on_cleanup.append(close)
    app.add_routes([web.get("/health", health), web.post("/v1/completions", completions)])
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    args = ap.parse_args(argv)
    web.run_app(
        make_app(args.prefill.rstrip("/"), args.decode.rstrip("/")),
        host=args.host,
        port=args.port,
        access_log=None,
        print=lambda *_: None,
    )


if __name__ == "__main__":
    main()
