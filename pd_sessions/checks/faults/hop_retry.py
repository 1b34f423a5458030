"""fault_hop_retry: a retry at the router -> decode hop masks a failing decode, and pd_calls must
see it.

The user's deployment it reproduces: a proxy or load balancer in front of the decode retries a
call that failed, so the client gets its answer while the decode was called twice. The check
starts, next to the cluster and bound to 127.0.0.1, a fault proxy (runtime/hop_fault.py: each
decode call's first attempt dropped halfway through its body, then retried) in front of every decode, and a
second vllm-router planned like the cluster's (core/plan/router.py) whose decodes are those
proxies; it sends pd_calls' requests through that router, then stops both by process group and
verifies them gone. Each proxy's log proves the fault happened (one line per retried call).

The promise it holds is pd_calls' (checks/pd_calls.py), judged on what went through the faulty
hop: with ``declared_retries = 0`` pd_calls must FAIL naming each extra decode call (detection
k/N of the requests); with retries declared it must pass.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pd_sessions.checks import pd_calls
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import connectors
from pd_sessions.core.plan import ClusterPlan
from pd_sessions.core.plan.router import router_argv
from pd_sessions.core.results import FAIL, NOT_RUN, PASS, CheckResult, Figure, Table, pick, reporting
from pd_sessions.runtime import http, process
from pd_sessions.runtime.hop_fault import LOG_PREFIX
from pd_sessions.runtime.ports import PortAllocator

NAME = "fault_hop_retry"
HOST = "127.0.0.1"
READY_S = 60.0
_RETRIED = re.compile(re.escape(LOG_PREFIX) + r"\d+: first attempt (.+); retry -> HTTP (\d+)")


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    rows = details.get("requests", [])
    return [
        *pick(details, ("detected", ""), ("retried_calls", ""), ("declared_retries", "")),
        *(
            [Table("through the faulty hop", ("request", "client", "prefill calls", "decode calls"),
                   tuple((r["index"], r["client"], r["prefill"], r["decode"]) for r in rows))]
            if rows else []
        ),
    ]  # fmt: skip


@reporting(numbers)
def evaluate(
    requests: list[pd_calls.RequestCalls], retried: list[str], *, declared_retries: int
) -> CheckResult:
    """The verdict of fault_hop_retry from the requests sent through the faulty hop and the
    proxies' lines (one per retried decode call).

    no retried call in the proxies' logs          -> NOT RUN "invalid: the fault did not happen"
    pd_calls could not count                      -> NOT RUN, its reason
    declared_retries = 0: pd_calls FAILs naming every request's extra decode call -> PASS
        ("caught k/N"); a request whose extra call it did not see             -> FAIL
    declared_retries > 0: pd_calls passes         -> PASS; it fails           -> FAIL
    """
    inner = pd_calls.evaluate(requests, declared_retries=declared_retries)
    caught = [r.index for r in requests if (r.role("decode") or 0) > 1 + declared_retries]
    details: dict[str, Any] = {
        **inner.details,
        "pd_calls": {"verdict": inner.verdict, "message": inner.message},
        "retried_calls": len(retried),
        "proxy_lines": retried[:8],
        "detected": f"{len(caught)}/{len(requests)}",
        "masked": [r.index for r in requests if r.ok],
    }
    if not retried:
        return CheckResult(NAME, NOT_RUN, "invalid: no decode call was retried by the fault proxy", details)
    if inner.not_run:
        return CheckResult(NAME, NOT_RUN, f"pd_calls could not count: {inner.message}", details)
    if declared_retries:
        ok = inner.passed
        why = "pd_calls passes: the retries are declared" if ok else f"pd_calls failed: {inner.message}"
        return CheckResult(
            NAME, PASS if ok else FAIL, f"{len(retried)} decode call(s) retried; {why}", details
        )
    if inner.failed and len(caught) == len(requests):
        return CheckResult(
            NAME,
            PASS,
            f"pd_calls caught {len(caught)}/{len(requests)} retried decode calls "
            f"(clients got HTTP 200 for {len(details['masked'])}): {inner.message}",
            details,
        )
    return CheckResult(
        NAME,
        FAIL,
        f"{len(retried)} decode call(s) retried but pd_calls saw {len(caught)}/{len(requests)}: "
        f"{inner.message}",
        details,
    )


def retried_lines(logs: list[Path]) -> list[str]:
    """The proxies' lines for retried calls."""
    out = []
    for log in logs:
        text = log.read_text(errors="replace") if log.exists() else ""
        out += [m.group(0) for m in _RETRIED.finditer(text)]
    return out


def _start(plan: ClusterPlan, run_dir: Path) -> tuple[list[process.Running], str, list[Path]]:
    """The fault proxies (one per decode) and the second router: (their processes, its URL, the
    proxies' logs). Ports are taken on 127.0.0.1 and released right before the spawns."""
    with PortAllocator(HOST) as ports:
        hops = [ports.take(f"hop_fault.{d.name}") for d in plan.decode]
        port, metrics = ports.take("hop_fault.router"), ports.take("hop_fault.router_metrics")
    started: list[process.Running] = []
    logs = []
    try:
        for d, hop in zip(plan.decode, hops, strict=True):
            logs.append(run_dir / f"hop_fault-{d.name}.log")
            argv = [sys.executable, "-m", "pd_sessions.runtime.hop_fault", "--host", HOST]
            argv += ["--port", str(hop), "--upstream", d.url]
            started.append(process.spawn(f"hop_fault-{d.name}", argv, env=_env(), log_path=logs[-1]))
        argv = router_argv(
            plan.router.argv[0],
            [(s.url, s.bootstrap_port) for s in plan.prefill],
            [f"http://{HOST}:{h}" for h in hops],
            kv_connector=connectors.get(plan.config.connector).router_flag,
            host=HOST,
            port=port,
            metrics_port=metrics,
        )
        started.append(
            process.spawn("hop_fault-router", argv, env=_env(), log_path=run_dir / "hop_fault-router.log")
        )
    except BaseException:
        process.stop(started, grace_s=5.0)
        raise
    return started, f"http://{HOST}:{port}", logs


def _env() -> dict[str, str]:
    return dict(os.environ)


def _ready(url: str, plan: ClusterPlan, started: list[process.Running]) -> str | None:
    """None once a completion through the second router answers, else why not within READY_S."""
    deadline, last = time.monotonic() + READY_S, "no answer yet"
    while time.monotonic() < deadline:
        dead = [r.name for r in started if r.poll() is not None]
        if dead:
            return f"{', '.join(dead)} exited (logs beside the cluster's)"
        try:
            http.completion(url, plan.served_model_name, "Ready", max_tokens=1, timeout=30.0)
            return None
        except http.HttpError as e:
            last = str(e)
        time.sleep(0.2)
    return f"the second router at {url} did not answer within {READY_S:g} s (last: {last})"


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    """Gatherer: start the proxies and the second router, send pd_calls' requests through it,
    stop them (verified gone) and judge."""
    plan = window.plan
    started, url, logs = _start(plan, window.cluster.run_dir)
    try:
        why = _ready(url, plan, started)
        if why:
            return CheckResult(NAME, NOT_RUN, f"invalid: {why}")
        before = len(retried_lines(logs))
        got = pd_calls.measure(plan, url, int(options["requests"]), timeout_s=window.timeout_s)
        retried = retried_lines(logs)[before:]
    finally:
        process.stop(started, grace_s=5.0)
    r = evaluate(got, retried, declared_retries=plan.config.declared_retries)
    r.details["stopped"] = [s.name for s in started]
    return r
