"""Warming every (prefill, decode) pair: one request aimed at each pair, sent as the two
hops upstream's toy proxies make (prefill with ``max_tokens`` 1 and the connector's
``kv_transfer_params``, then decode with the parameters that tell it where to pull from).

Why not through vllm-router: it picks the pair itself (round robin or another policy) and
has no way to name one, so "ready" through it proves only the pairs it happened to pick.
The first transfer from a second prefill is where P/D broke on the CPU lane (2P1D over
Mooncake and NIXL), so readiness warms every pair, and a pair whose path keeps failing
ends the wait within a bounded time (``PD_PATH_BUDGET_S``, about a minute) with the
answer it got and the decode's error lines, instead of running to the 1200 s deadline.

Pure: the error-line filter (the kv_transfer_params of each hop are the connector spec's
``hops``). Edge: the hops.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from pd_sessions.core import connectors
from pd_sessions.core.errors import PdError
from pd_sessions.core.plan import ClusterPlan, ProcessSpec
from pd_sessions.runtime import http, stuck

# Once every instance is healthy, how long a P/D path may keep failing before the wait ends.
PD_PATH_BUDGET_S = 60.0
# One hop's HTTP timeout: a decode stuck on a KV pull never answers on its own. As long as the
# whole budget: abandoning a slow first transfer and retrying made it worse (NIXL on a loaded
# 2-core host: the abandoned request's pull completed ~50 s later, after the prefill had
# released its blocks, and the retry stalled too); answered failures still retry at once.
HOP_TIMEOUT_S = PD_PATH_BUDGET_S
WARM_PROMPT = "Warm the pair"
ERROR_MARKERS = ("ERROR", "Error", "error", "failed", "Traceback", "timed out", "Timeout")


class PdPathFailed(PdError):
    """Every instance is healthy, but requests over a P/D path keep failing."""

    def __init__(
        self,
        what: str,
        *,
        waited_s: float,
        last: str,
        decode_errors: Sequence[str],
        decode: str,
        router_answer: str | None = None,
        prefill_errors: Sequence[str] = (),
        prefill: str | None = None,
    ):
        self.what = what
        self.last = last
        self.decode_errors = list(decode_errors)
        lines = [
            f"{what}: the P/D path kept failing for {waited_s:.0f} s while every instance was "
            f"healthy (last answer: {last}; --pd-path-budget SECONDS sets how long it may)"
        ]
        if router_answer is not None:
            lines.append(f"router's answer to a 1-token completion: {router_answer}")
        lines.append(f"--- {decode}'s error lines ({len(self.decode_errors)}) ---")
        lines += self.decode_errors or ["(none found in its log)"]
        if prefill is not None:
            lines.append(f"--- {prefill}'s error lines ({len(prefill_errors)}) ---")
            lines += list(prefill_errors) or ["(none found in its log)"]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Pair:
    prefill: ProcessSpec
    decode: ProcessSpec

    @property
    def name(self) -> str:
        return f"{self.prefill.name} -> {self.decode.name}"


def pairs(plan: ClusterPlan) -> list[Pair]:
    """Every (prefill, decode) pair, prefill-major."""
    return [Pair(p, d) for p in plan.prefill for d in plan.decode]


def error_lines(log_text: str, limit: int = 15) -> list[str]:
    """The last ``limit`` log lines that look like errors (markers in ERROR_MARKERS)."""
    hits = [line for line in log_text.splitlines() if any(m in line for m in ERROR_MARKERS)]
    return [line[:300] for line in hits[-limit:]]


def log_errors(path: Path | None, limit: int = 15) -> list[str]:
    if path is None or not path.exists():
        return []
    return error_lines(path.read_text(errors="replace"), limit)


def warm_pair(plan: ClusterPlan, pair: Pair, *, timeout: float = HOP_TIMEOUT_S) -> None:
    """Send one request over ``pair``; raises http.HttpError (naming the hop) when it fails."""
    hops = connectors.get(plan.config.connector).hops
    tid = f"pd-warm-{uuid.uuid4().hex}"
    body = {
        "model": plan.served_model_name,
        "prompt": f"{WARM_PROMPT} {pair.name}",
        "max_tokens": 1,
        "temperature": 0.0,
    }
    bootstrap = engine = None
    if hops.bootstrap_query and hops.engine_id:
        bootstrap = f"http://{pair.prefill.host}:{pair.prefill.bootstrap_port}"
        query = f"{bootstrap}{hops.bootstrap_query}"
        try:
            engine = hops.engine_id(json.loads(http.get_text(query, timeout=timeout)))
        except ValueError as e:  # not JSON, or no rank registered yet
            raise http.HttpError(query, str(e)) from None
    # One request id for both hops, as vllm-router and upstream's toy proxy send it: push mode
    # matches the decode's registration to the prefill's finished blocks by it.
    same_id = {"X-Request-Id": tid}
    answer = http.post_json(
        f"{pair.prefill.url}/v1/completions",
        {**body, "kv_transfer_params": hops.prefill_params(tid)},
        timeout=timeout,
        headers=same_id,
    )
    try:
        params = hops.decode_params(tid, answer, bootstrap, engine)
    except ValueError as e:
        raise http.HttpError(f"{pair.prefill.url}/v1/completions", str(e)) from None
    http.post_json(
        f"{pair.decode.url}/v1/completions",
        {**body, "kv_transfer_params": params},
        timeout=timeout,
        headers=same_id,
    )


def warm_pairs(
    plan: ClusterPlan,
    *,
    deadline: float,
    logs: dict[str, Path | None],
    guard: Callable[[Callable[[], None]], None] = lambda call: call(),
    say: Callable[[str], None] = lambda msg: None,
    tick: float = 0.5,
    warm: Callable[..., None] = warm_pair,
) -> dict[str, float]:
    """Warm each pair, retrying until ``deadline`` (time.monotonic()); returns pair -> seconds.
    Raises PdPathFailed naming the pair, its last answer and its decode's error lines."""
    took = {}
    for pair in pairs(plan):
        t0 = time.monotonic()
        last = "not tried"
        held = ""  # what the instances held when a hop first timed out (while it was still stuck)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PdPathFailed(
                    f"pair {pair.name}",
                    waited_s=time.monotonic() - t0,
                    last=last + (f"; stuck: {held}" if held else ""),
                    decode=pair.decode.name,
                    decode_errors=log_errors(logs.get(pair.decode.name)),
                    prefill=pair.prefill.name,
                    prefill_errors=log_errors(logs.get(pair.prefill.name)),
                )
            try:
                guard(partial(warm, plan, pair, timeout=min(remaining, HOP_TIMEOUT_S)))
                break
            except http.HttpError as e:
                if stuck.is_timeout(e) and not held:
                    held = stuck.gather(plan)
                if str(e) != last:
                    say(f"pair {pair.name}: {e} (retrying until {remaining:.0f} s have passed)")
                last = str(e)
            time.sleep(min(tick, max(0.0, deadline - time.monotonic())))
        took[pair.name] = time.monotonic() - t0
    return took
