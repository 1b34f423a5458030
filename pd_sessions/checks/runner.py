"""Gathers the inputs of every check from a ready cluster, in one order:

1. scrape decode /metrics (before)
2. smoke: one completion through the router
3. parity: each prompt through the router, then straight to prefill-0 (exact mode), or the
   router's tokens teacher-forced through prefill-0 (margin mode; see checks/parity.py)
4. scrape decode /metrics (after): the window held only router requests
5. control: one request straight to decode-0 must leave the counter still
6. the registry's other checks (cache_paths, too_long, burst, abort_frees_kv...), each
   with its own gatherer and options; they run after the KV window on purpose (they prime
   decode caches and send requests straight to instances)
7. accuracy (lm_eval through the router): on the CPU lane an offline task run through
   the router and straight to prefill-0 must give identical samples; elsewhere the
   measured value is compared with the recorded baseline

Results are appended to ``results`` as they come, so a run cut short by a
dying process still reports the checks that finished.
"""

from __future__ import annotations

import datetime
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pd_sessions.checks import abort_frees_kv, burst, cache_paths, kv_transfer, parity, per_instance, too_long
from pd_sessions.checks import accuracy as acc
from pd_sessions.checks.completions import (
    MAX_TOKENS,
    PARITY_PROMPTS,
    SMOKE_PROMPT,
    Completion,
    evaluate_smoke,
)
from pd_sessions.checks.instances import REQUEST_TIMEOUT_S
from pd_sessions.checks.offline_task import TASK as OFFLINE_TASK
from pd_sessions.checks.offline_task import write_task
from pd_sessions.core import check_registry as registry
from pd_sessions.core.config import TINY_MODELS
from pd_sessions.core.errors import PdError
from pd_sessions.core.results import FAIL, PASS, CheckResult, crashed
from pd_sessions.runtime import http, stuck
from pd_sessions.runtime.cluster import Cluster

# The checks with a gatherer of their own, run(cluster, options) -> CheckResult, after the KV
# window; smoke, parity, kv_transfer and accuracy are gathered here (they share its window).
GATHERERS: dict[str, Callable[[Cluster, dict[str, Any]], CheckResult]] = {
    "cache_paths": cache_paths.run,
    "too_long": too_long.run,
    "burst": burst.run,
    "abort_frees_kv": abort_frees_kv.run,
}

CONTROL_PROMPT = "A request sent straight to the decode instance, not through the router:"


# A check request that gets no answer this long is stuck (a KV pull that never completes):
# the config fails then, naming what each instance holds, and the remaining checks do not wait.
CHECK_REQUEST_TIMEOUT_S = REQUEST_TIMEOUT_S


def _complete(base_url: str, model: str, prompt: str) -> Completion:
    return Completion.from_response(
        http.completion(base_url, model, prompt, max_tokens=MAX_TOKENS, timeout=CHECK_REQUEST_TIMEOUT_S)
    )


def _timed(name: str, results: list[CheckResult], fn: Callable[[], CheckResult]) -> None:
    t0 = time.monotonic()
    try:
        r = fn()
    except (http.HttpError, kv_transfer.MetricMissing) as e:
        r = CheckResult(name, FAIL, f"could not run: {e}")
    except PdError:
        raise
    except Exception as e:  # unforeseen (e.g. from lm_eval): this check fails, the others run
        r = crashed(name, e)
    r.seconds = time.monotonic() - t0
    results.append(r)


def run_checks(
    cluster: Cluster,
    results: list[CheckResult],
    accuracy: acc.AccuracyOptions | None = None,
    skip: tuple[str, ...] = (),
    selected: Sequence[str] = registry.DEFAULTS,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Run the ``selected`` checks in the registry's order, except those named in ``skip``
    (the caller records why). ``options``: check -> its options (registry defaults fill gaps)."""
    wanted = {n for n in selected if n not in skip}
    stuck_in: list[str] = []

    def timed(name: str, fn: Callable[[], CheckResult]) -> None:
        """_timed, and once a request got no answer: say what is stuck, fail the rest at once."""
        if stuck_in:
            results.append(CheckResult(name, FAIL, f"not run: the P/D path is stuck ({stuck_in[0]})"))
            return
        _timed(name, results, fn)
        r = results[-1]
        if not r.passed and stuck.is_timeout(r.message):
            diagnosis = stuck.gather(cluster.plan)
            r.message += f"; stuck: {diagnosis}"
            r.details["stuck"] = diagnosis
            stuck_in.append(f"{name} got no answer within {CHECK_REQUEST_TIMEOUT_S:g} s: {diagnosis}")

    plan = cluster.plan
    model = plan.served_model_name
    router = plan.router.url
    baseline = plan.prefill[0]
    ledger = {"tokens": 0, "requests": 0}

    def via_router(prompt: str) -> Completion:
        c = _complete(router, model, prompt)
        ledger["tokens"] += c.prompt_tokens
        ledger["requests"] += 1
        return c

    def scrape() -> dict[str, float]:
        return {s.name: kv_transfer.external_tokens(http.get_text(f"{s.url}/metrics")) for s in plan.decode}

    before_err: list[str] = []
    window: kv_transfer.Window | None = None
    try:
        before = scrape()
        window = kv_transfer.Window.for_cluster(cluster, http.get_text)
    except (http.HttpError, kv_transfer.MetricMissing) as e:
        before, before_err = {}, [str(e)]

    if "smoke" in wanted:
        timed("smoke", lambda: evaluate_smoke(via_router(SMOKE_PROMPT)))

    roles = {"prefill": len(plan.prefill), "decode": len(plan.decode)}
    served_before: dict[str, float] = {}
    try:
        served_before = per_instance.scrape(plan)
    except (http.HttpError, kv_transfer.MetricMissing) as e:
        before_err.append(str(e))

    # prompt tokens sent straight to an instance inside the window (parity's baselines): not
    # counted as the router having used that instance
    direct = {baseline.name: 0.0}

    def parity_check() -> CheckResult:
        p_before = per_instance.scrape(plan)
        j = parity.Judge.for_config(plan.config)
        rows: list[tuple[str, Completion, parity.Reference]] = []
        sent = 0.0
        for p in PARITY_PROMPTS:
            pd = via_router(p)
            try:
                ref = parity.reference(
                    j, baseline.url, model, p, pd, max_tokens=MAX_TOKENS, timeout=CHECK_REQUEST_TIMEOUT_S
                )
            except ValueError as e:
                return CheckResult("parity", FAIL, f"could not run: {e}")
            sent += parity.prompt_tokens_sent(pd, ref)
            rows.append((p, pd, ref))
        r = parity.judge(j, rows, baseline=f"{baseline.name} direct (no disaggregation)")
        direct[baseline.name] += sent
        return per_instance.apply(
            r,
            p_before,
            per_instance.scrape(plan),
            requests=len(PARITY_PROMPTS),
            roles=roles,
            direct={baseline.name: sent},
        )

    if "parity" in wanted:
        timed("parity", parity_check)

    def kv() -> CheckResult:
        if before_err:
            return CheckResult("kv_transfer", FAIL, f"could not read decode metrics: {before_err[0]}")
        after = scrape()
        evidence = (
            window.close(router_requests=ledger["requests"], wait_s=kv_transfer.evidence_wait(before, after))
            if window
            else None
        )
        d0 = plan.decode[0]
        _complete(d0.url, model, CONTROL_PROMPT)
        control_after = scrape()[d0.name]
        r = kv_transfer.evaluate(
            before,
            after,
            router_prompt_tokens=ledger["tokens"],
            router_requests=ledger["requests"],
            control=(d0.name, after[d0.name], control_after),
            evidence=evidence,
        )
        # the control request went to decode-0 only, after the window: compare up to `after`
        served_after = {**per_instance.scrape(plan), **after}
        return per_instance.apply(
            r, served_before, served_after, requests=ledger["requests"], roles=roles, direct=direct
        )

    if "kv_transfer" in wanted:
        timed("kv_transfer", kv)

    for info in registry.CHECKS:
        if info.name not in GATHERERS or info.name not in wanted:
            continue
        opts = {**info.options, **(options or {}).get(info.name, {})}
        gather = GATHERERS[info.name]
        timed(info.name, lambda: gather(cluster, opts))  # noqa: B023 (timed calls it at once)

    if "accuracy" in wanted:
        timed("accuracy", lambda: accuracy_check(cluster, accuracy or acc.AccuracyOptions()))


def accuracy_check(cluster: Cluster, opts: acc.AccuracyOptions) -> CheckResult:
    plan = cluster.plan
    cfg = plan.config
    common: dict[str, Any] = {
        "model": plan.served_model_name,
        "num_concurrent": opts.num_concurrent,
        "trust_remote_code": cfg.trust_remote_code,
        "revision": cfg.revision,
    }
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        return CheckResult(
            "accuracy",
            FAIL,
            f"could not run: lm_eval is not installed ({e}); "
            "install 'lm-eval[api]==0.4.13' or skip it with --skip-check accuracy",
        )
    if cfg.model in TINY_MODELS:
        # Absolute accuracy of a random tiny model means nothing: require greedy identity.
        include = write_task(cluster.run_dir / "lm_eval_task")
        runs = {}
        for label, url in (("router", plan.router.url), (plan.prefill[0].name, plan.prefill[0].url)):
            res = acc.run_lm_eval(
                base_url=url,
                task=OFFLINE_TASK,
                include_path=include,
                tokenizer=plan.model,
                log_samples=True,
                **common,
            )
            runs[label] = acc.responses(res, OFFLINE_TASK)
        return acc.compare_samples(
            runs["router"], runs[plan.prefill[0].name], baseline=f"{plan.prefill[0].name} direct"
        )
    baseline = acc.find_baseline(acc.load_baselines(opts.baselines), cfg.model, opts.task)
    if baseline is None and not opts.record_baseline:
        msg = acc.missing_baseline_message(cfg.model, opts.task, opts.baselines)
        return CheckResult(
            "accuracy",
            PASS if opts.mode == "warn" else FAIL,
            ("WARNING (--accuracy=warn): " if opts.mode == "warn" else "") + msg,
        )
    endpoint = baseline.endpoint if baseline else "completions"
    res = acc.run_lm_eval(
        base_url=plan.router.url,
        task=opts.task,
        endpoint=endpoint,
        limit=opts.limit,
        num_fewshot=baseline.num_fewshot if baseline else 5,
        tokenizer=None,
        **common,
    )
    key = baseline.key if baseline else "exact_match,strict-match"
    value, n = acc.read_result(res, opts.task, key)
    if opts.record_baseline:
        new = acc.Baseline(model=cfg.model, task=opts.task, value=value, samples=n, endpoint=endpoint)
        acc.record_baseline(
            opts.baselines, new, command=shlex.join(sys.argv), date=datetime.date.today().isoformat()
        )
        return CheckResult(
            "accuracy",
            PASS,
            f"recorded baseline {cfg.model}/{opts.task} = {value:.4f} on {n} samples in {opts.baselines}",
            {"measured": value, "samples": n},
        )
    assert baseline is not None  # both ways without one returned above
    return acc.compare(
        value, n, baseline, rule=opts.rule, mode=opts.mode, allow_sample_mismatch=opts.allow_sample_mismatch
    )
