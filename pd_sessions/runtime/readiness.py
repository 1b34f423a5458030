"""Waiting (edge): readiness probes with fail-fast liveness, and guarded calls.

Each tick, every process we wait on is first checked for life; a dead one fails
the wait at once with its exit status and log tail. Then its probes run in
order (e.g. /health 200, then /v1/models lists the model). One overall deadline
covers the whole wait; a progress line is logged periodically.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from pd_sessions.core.errors import GuardTimeout, ProcessExited, ReadinessTimeout
from pd_sessions.runtime import cancel, http
from pd_sessions.runtime.process import Running

log = logging.getLogger(__name__)

T = TypeVar("T")
# A probe returns None when satisfied, else a short reason ("HTTP 503", "connection refused").
Probe = Callable[[], "str | None"]


def health_probe(url: str, timeout: float = 2.0) -> Probe:
    def probe() -> str | None:
        try:
            status, _ = http.request(url, timeout=timeout)
        except http.HttpError as e:
            return e.reason
        return None if status == 200 else f"HTTP {status}"

    probe.__name__ = f"GET {url}"
    return probe


def models_probe(base_url: str, model: str, timeout: float = 2.0) -> Probe:
    def probe() -> str | None:
        try:
            data = json.loads(http.get_text(f"{base_url}/v1/models", timeout=timeout))
        except (http.HttpError, ValueError) as e:
            return f"/v1/models: {e}"
        ids = [m.get("id") for m in data.get("data", [])]
        return None if model in ids else f"/v1/models lists {ids}, not {model!r}"

    return probe


@dataclass
class Target:
    running: Running
    probes: Sequence[Probe]
    ready_at: float | None = None
    last: str = "not probed yet"
    stage: int = 0
    history: list[str] = field(default_factory=list)


def check_alive(running: Sequence[Running], when: str) -> None:
    """Raise ProcessExited for the first process in ``running`` that has exited."""
    for r in running:
        rc = r.poll()
        if rc is not None:
            raise ProcessExited(
                r.name,
                pid=r.pid,
                returncode=rc,
                url=r.url,
                log_path=r.log_path,
                log_tail=r.log_tail(),
                when=when,
            )


def wait_ready(
    targets: Sequence[Target],
    *,
    deadline: float,
    also_alive: Sequence[Running] = (),
    tick: float = 0.1,
    progress_every: float = 15.0,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Block until every target passes all its probes.

    ``deadline`` is a time.monotonic() value. ``also_alive`` are processes that
    must stay alive meanwhile (e.g. instances while the router starts).
    """
    start = time.monotonic()
    next_progress = start + progress_every
    watched = [t.running for t in targets] + list(also_alive)
    while True:
        cancel.check()  # a sweep running configs side by side passes a stop on (runtime/cancel.py)
        check_alive(watched, "while the cluster was starting")
        pending = [t for t in targets if t.ready_at is None]
        for t in pending:
            while t.stage < len(t.probes):
                reason = t.probes[t.stage]()
                if reason is not None:
                    t.last = reason
                    break
                t.stage += 1
            if t.stage == len(t.probes):
                t.ready_at = time.monotonic()
                log.info("%s ready after %.1f s", t.running.name, t.ready_at - t.running.started_at)
                if progress:
                    progress(f"{t.running.name} ready after {t.ready_at - t.running.started_at:.1f} s")
        if all(t.ready_at is not None for t in targets):
            return
        now = time.monotonic()
        if now >= deadline:
            # Check life once more so a death at the deadline is reported as a death.
            check_alive(watched, "while the cluster was starting")
            t = next(t for t in targets if t.ready_at is None)
            raise ReadinessTimeout(
                t.running.name,
                url=t.running.url or "?",
                waited_s=now - t.running.started_at,
                last_probe=t.last,
                log_path=t.running.log_path,
                log_tail=t.running.log_tail(),
            )
        if progress and now >= next_progress:
            waiting = ", ".join(f"{t.running.name} ({t.last})" for t in targets if t.ready_at is None)
            progress(f"waiting {now - start:.0f} s (deadline in {deadline - now:.0f} s) for: {waiting}")
            next_progress = now + progress_every
        time.sleep(max(0.0, min(tick, deadline - time.monotonic())))


def guarded(
    call: Callable[[], T],
    *,
    watch: Sequence[Running] | Callable[[], Sequence[Running]],
    when: str,
    tick: float = 0.05,
    timeout: float | None = None,
    heartbeat: Callable[[], None] | None = None,
    heartbeat_every: float = 15.0,
) -> T:
    """Run ``call`` in a thread while checking every ``tick`` that ``watch`` are alive.

    ``watch`` may be a callable, asked each tick: the processes watched then follow the cluster
    (a planned stop takes one out, a restart puts the new one in; see cluster.Cluster).
    A death raises ProcessExited at once (the caller's teardown then kills the
    servers, which ends the thread's pending request). ``timeout`` bounds the
    whole call (GuardTimeout, a PdError, when it runs out); ``heartbeat`` is called every
    ``heartbeat_every`` seconds meanwhile.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(call())
        except BaseException as e:  # re-raised in the caller's thread below
            error.append(e)

    watched = watch if callable(watch) else (lambda: watch)
    th = threading.Thread(target=target, name="pd-guarded", daemon=True)
    th.start()
    start = time.monotonic()
    beat = start + heartbeat_every
    while th.is_alive():
        cancel.check()
        check_alive(watched(), when)
        now = time.monotonic()
        if timeout is not None and now > start + timeout:
            raise GuardTimeout(when, timeout)
        if heartbeat is not None and now >= beat:
            heartbeat()
            beat = now + heartbeat_every
        th.join(tick)
    # A call that ended quickly because a process died (connection refused...) must still
    # report the death as the cause, not only its symptoms.
    check_alive(watched(), when)
    if error:
        raise error[0]
    return result[0]
