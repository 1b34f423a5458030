"""The check window: what the checks of one ready cluster share, as the runner runs them.

It opens before the first check and kv_transfer closes it; in between only router requests
may reach the decode instances (the edge checks, which prime decode caches and send requests
straight to instances, run after it). It keeps:

- the decode instances' prompt tokens by source at its start (``decode_before``) and the start of
  the success evidence (log offsets, connector metrics: :class:`evidence.Window`);
- the ledger of requests sent through the router (smoke's, parity's): the prompt tokens the
  decode instances must have received by KV transfer;
- the prompt tokens sent straight to an instance inside it (parity's baselines): not counted as
  the router having used that instance;
- the per-instance served counters at the start of the per-instance count;
- the errors of its own scrapes: kv_transfer cannot judge without them;
- the stuck diagnosis: once a check request got no answer, the remaining checks fail at once.

:meth:`CheckWindow.timed` runs one check and records its result, with its seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from pd_sessions.checks import evidence, instances
from pd_sessions.checks.completions import MAX_TOKENS, Completion
from pd_sessions.core.errors import PdError
from pd_sessions.core.kv_identity import Counts
from pd_sessions.core.plan import ClusterPlan
from pd_sessions.core.results import FAIL, NOT_RUN, CheckResult, crashed
from pd_sessions.runtime import http, stuck
from pd_sessions.runtime.cluster import Cluster


class CheckWindow:
    """One cluster's check window. Open it with :meth:`open`; the checks' gatherers take it."""

    def __init__(self, cluster: Cluster, results: list[CheckResult], *, timeout_s: float):
        self.cluster = cluster
        self.plan: ClusterPlan = cluster.plan
        self.results = results  # every check's result is appended as it comes
        self.timeout_s = timeout_s  # a check request with no answer this long is stuck
        self.decode_before: dict[str, Counts] = {}  # decode name -> prompt tokens by source at the start
        self.evidence: evidence.Window | None = None
        self.errors: list[str] = []  # why the window's own scrapes failed
        self.router_requests = 0
        self.router_tokens = 0  # prompt tokens of the router requests
        self.direct: dict[str, float] = {}  # instance name -> prompt tokens sent straight to it
        self.stuck: str | None = None  # what is stuck, once a check request got no answer
        # across hosts: host -> its interface's (rx, tx) bytes before its first process started
        # (checks/kv_link.py: every transfer the connector reports in the window happened since)
        self.link_before: dict[str, tuple[int, int]] | None = None
        self._served_before: dict[str, float] | None = None
        # invariants the runner keeps across the checks, by the check that judges them
        # (checks/conservation.py's ledger of the probes after every check)
        self.invariants: dict[str, Any] = {}

    @classmethod
    def open(cls, cluster: Cluster, results: list[CheckResult], *, timeout_s: float) -> CheckWindow:
        """Scrape the decode instances' counters and start the success evidence. A failed scrape
        is recorded in ``errors`` (kv_transfer then fails naming it); the other checks still run."""
        w = cls(cluster, results, timeout_s=timeout_s)
        try:
            w.decode_before = instances.scrape_decode_counts(w.plan)
            w.evidence = evidence.Window.for_cluster(cluster, http.get_text)
            w.link_before = cluster.launcher.link_baseline()
        except (http.HttpError, instances.MetricMissing) as e:
            w.decode_before, w.errors = {}, [str(e)]
        return w

    @property
    def roles(self) -> dict[str, int]:
        return {"prefill": len(self.plan.prefill), "decode": len(self.plan.decode)}

    def complete(self, url: str, prompt: str) -> Completion:
        """One greedy completion of MAX_TOKENS, bounded by the window's request timeout."""
        model = self.plan.served_model_name
        return Completion.from_response(
            http.completion(url, model, prompt, max_tokens=MAX_TOKENS, timeout=self.timeout_s)
        )

    def via_router(self, prompt: str) -> Completion:
        """A completion through the router, counted in the ledger."""
        c = self.complete(self.plan.router.url, prompt)
        self.router_tokens += c.prompt_tokens
        self.router_requests += 1
        return c

    def sent_direct(self, name: str, prompt_tokens: float) -> None:
        """Record prompt tokens sent straight to instance ``name`` inside the window."""
        self.direct[name] = self.direct.get(name, 0.0) + prompt_tokens

    def served_start(self) -> dict[str, float]:
        """The per-instance served counters at the start of the per-instance count, scraped once,
        when first asked: by parity before its first request, else by kv_transfer (after smoke's
        request either way). A failed scrape is one of ``errors`` and gives {}."""
        if self._served_before is None:
            try:
                self._served_before = instances.scrape_served(self.plan)
            except (http.HttpError, instances.MetricMissing) as e:
                self._served_before = {}
                self.errors.append(str(e))
        return self._served_before

    def count_served(
        self,
        result: CheckResult,
        before: Mapping[str, float],
        after: Mapping[str, float],
        *,
        requests: int,
        direct: Mapping[str, float],
    ) -> CheckResult:
        """``result`` judged per instance over ``requests`` router requests (see instances.apply_served)."""
        return instances.apply_served(
            result, before, after, requests=requests, roles=self.roles, direct=direct
        )

    def timed(
        self,
        name: str,
        check: Callable[[], CheckResult],
        judge: Callable[[CheckResult], CheckResult] | None = None,
    ) -> None:
        """Run one check and append its result (``judge``'s verdict of it, when given: the
        known-issues registry's), with its seconds.

        the path is stuck already            -> FAIL "not run: the P/D path is stuck (...)";
                                                ``check`` is not called
        HttpError or MetricMissing           -> FAIL "could not run: <why>"
        PdError                              -> raised (the config errs, not the check)
        any other exception                  -> FAIL "crashed: ..." (the other checks still run)
        a failure that is a request timeout  -> "; stuck: <diagnosis>" added; the path is stuck
        an XFAIL (a known bug's hang)        -> not stuck: the hang is the bug's own, and the
                                                checks after it reproduce theirs
        """
        if self.stuck:
            r = CheckResult(
                name, FAIL, f"not run: the P/D path is stuck ({self.stuck})", started_at=time.time()
            )
            self.results.append(r)
            return
        r = _run(name, check)
        r = judge(r) if judge is not None else r
        self.results.append(r)
        if r.verdict in (FAIL, NOT_RUN) and stuck.is_timeout(r.message):
            diagnosis = stuck.gather(self.plan)
            r.message += f"; stuck: {diagnosis}"
            r.details["stuck"] = diagnosis
            self.stuck = f"{name} got no answer within {self.timeout_s:g} s: {diagnosis}"


def _run(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    """``check()`` with its start and seconds; what it raised as its result (see CheckWindow.timed)."""
    started, t0 = time.time(), time.monotonic()
    try:
        r = check()
    except (http.HttpError, instances.MetricMissing) as e:
        r = CheckResult(name, FAIL, f"could not run: {e}")
    except PdError:
        raise
    except Exception as e:  # unforeseen (e.g. from lm_eval): this check fails, the others run
        r = crashed(name, e)
    r.seconds = time.monotonic() - t0
    r.started_at = started
    return r
