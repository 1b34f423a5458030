"""A small, fast OpenAI-compatible backend for the router benchmark (never used to claim P/D works).

    python -m pd_sessions.bench.fake_backend --port P [--host 127.0.0.1] [--model NAME]
        [--role prefill|decode]

Answers /health, /v1/models and /v1/completions at once with ``max_tokens`` dummy
tokens, so that what a benchmark in front of it measures is the proxy, not the
backend. A prefill request (``kv_transfer_params.do_remote_decode``) is answered
with the ``kv_transfer_params`` a decode instance would be handed, as vLLM's
NIXL connector does.

Why ``python -m`` (not a ``pd-sessions`` subcommand): a process boundary. The router benchmark
(pd_sessions.bench.routers) starts it as a server process of its own, never a user.
"""

from __future__ import annotations

import argparse
import itertools

from aiohttp import web


def make_app(model: str, role: str) -> web.Application:
    ids = itertools.count()

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        n = max(1, int(body.get("max_tokens") or 1))
        kv_in = body.get("kv_transfer_params") or {}
        out = {
            "id": f"cmpl-{role}-{next(ids)}",
            "object": "text_completion",
            "model": model,
            "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n},
        }
        if kv_in.get("do_remote_decode"):
            out["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": f"fake-{role}",
                "remote_block_ids": [0],
                "remote_host": "127.0.0.1",
                "remote_port": 1,
                "tp_size": 1,
            }
        return web.json_response(out)

    app = web.Application()
    app.add_routes(
        [web.get("/health", health), web.get("/v1/models", models), web.post("/v1/completions", completions)]
    )
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="fake")
    ap.add_argument("--role", default="backend")
    args = ap.parse_args(argv)
    web.run_app(
        make_app(args.model, args.role),
        host=args.host,
        port=args.port,
        access_log=None,
        print=lambda *_: None,
    )


if __name__ == "__main__":
    main()
