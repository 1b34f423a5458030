"""Accuracy with lm_eval: baselines that cannot be silently skipped.

Pure parts (tested without lm_eval): baseline lookup, the comparison rules, the
lm_eval model_args, reading lm_eval's result. The run itself (lm_eval against the
router) is in :func:`run_lm_eval`, imported lazily; :func:`run` is the check's gatherer.

Rules:
- tolerance (default): |measured - baseline| <= rtol * baseline (two-sided);
- wilson: the Wilson score lower bound of the measured proportion at the run's
  sample count must reach baseline * (1 - rtol) (a one-sided statistical gate that
  does not flake on small samples the way a fixed band does);
- a model with no baseline FAILS, saying how to record one;
- a sample limit different from the baseline's is refused unless allowed.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import shlex
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pd_sessions.checks.offline_task import TASK as OFFLINE_TASK
from pd_sessions.checks.offline_task import write_task
from pd_sessions.core.config import TINY_MODELS
from pd_sessions.core.errors import ConfigError
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting

if TYPE_CHECKING:  # types only: the CLI imports AccuracyOptions on a bare interpreter (test_bare_imports)
    from pd_sessions.checks.window import CheckWindow
    from pd_sessions.runtime.cluster import Cluster

BASELINES = Path(__file__).resolve().parent.parent / "configs" / "baselines.toml"
RULES = ("tolerance", "wilson")


@dataclass(frozen=True)
class AccuracyOptions:
    mode: str = "enforce"  # enforce | warn (exploratory runs; said in the summary)
    rule: str = "tolerance"  # tolerance | wilson
    task: str = "gsm8k"  # GPU lanes; the CPU lane uses the offline task
    limit: int | None = None  # sample limit; must match the baseline's unless allowed
    allow_sample_mismatch: bool = False
    record_baseline: bool = False  # measure and write the baseline entry instead of comparing
    num_concurrent: int = 100
    baselines: Path = BASELINES


@dataclass(frozen=True)
class Baseline:
    model: str
    task: str
    value: float
    metric: str = "exact_match"
    filter: str = "strict-match"
    samples: int | None = None  # None = the task's full set
    num_fewshot: int = 5
    endpoint: str = "completions"  # completions | chat
    rtol: float = 0.05
    source: str = ""

    @property
    def key(self) -> str:
        return f"{self.metric},{self.filter}"


def load_baselines(path: Path = BASELINES) -> list[Baseline]:
    data = tomllib.loads(path.read_text())
    out = []
    for i, raw in enumerate(data.get("baseline", [])):
        try:
            out.append(Baseline(**raw))
        except TypeError as e:
            raise ConfigError("baseline", f"entry #{i + 1}: {e}", source=str(path)) from None
    return out


def find_baseline(baselines: Sequence[Baseline], model: str, task: str) -> Baseline | None:
    return next((b for b in baselines if b.model == model and b.task == task), None)


def missing_baseline_message(model: str, task: str, path: Path = BASELINES) -> str:
    return (
        f"no accuracy baseline for model {model!r} on task {task!r} in {path}: the check "
        "cannot pass without one. Record it from a trusted run with `--record-baseline` "
        "(writes value, sample count, date and command), or run exploratory sweeps with "
        "`--accuracy=warn`"
    )


def wilson_lower(successes: float, n: int, z: float = 1.96) -> float:
    """Lower bound of the Wilson score interval for a proportion (95% two-sided by default)."""
    if n <= 0:
        return 0.0
    p = successes / n
    denom = 1 + z * z / n
    centre = p + z * z / (2 * n)
    margin = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - margin) / denom)


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the value measured against its baseline and bounds, the samples;
    per-sample identity: the samples and how many differ."""
    out: list[Figure | Table] = [
        *pick(
            details,
            ("metric", ""),
            ("measured", ""),
            ("baseline", ""),
            ("lower", ""),
            ("upper", ""),
            ("wilson_lower", ""),
            ("required", ""),
            ("samples", ""),
            ("baseline_samples", ""),
        )
    ]
    if "differing_doc_ids" in details:
        out.append(Figure("samples_differing", len(details["differing_doc_ids"])))
    return out


@reporting(numbers)
def compare(
    measured: float,
    n: int,
    baseline: Baseline,
    *,
    rule: str = "tolerance",
    allow_sample_mismatch: bool = False,
    mode: str = "enforce",
) -> CheckResult:
    """Verdict of a measured value against its baseline."""
    if rule not in RULES:
        raise ConfigError("--accuracy-rule", f"got {rule!r}; allowed: {', '.join(RULES)}")
    details: dict[str, Any] = {
        "measured": measured,
        "samples": n,
        "baseline": baseline.value,
        "baseline_samples": baseline.samples,
        "rule": rule,
        "rtol": baseline.rtol,
        "metric": baseline.key,
        "source": baseline.source,
    }
    if baseline.samples is not None and n != baseline.samples and not allow_sample_mismatch:
        return CheckResult(
            "accuracy",
            FAIL,
            f"refused: measured on {n} samples but the baseline "
            f"was set on {baseline.samples}; thresholds do not carry across sample "
            "sizes (allow explicitly with --allow-sample-mismatch)",
            details,
        )
    if rule == "tolerance":
        lo, hi = baseline.value * (1 - baseline.rtol), baseline.value * (1 + baseline.rtol)
        ok = lo <= measured <= hi
        details.update(lower=lo, upper=hi)
        how = f"{measured:.4f} vs {baseline.value} (allowed {lo:.4f}..{hi:.4f})"
    else:
        bound = wilson_lower(measured * n, n)
        need = baseline.value * (1 - baseline.rtol)
        ok = bound >= need
        details.update(wilson_lower=bound, required=need)
        how = (
            f"{measured:.4f} on {n} samples: Wilson lower bound {bound:.4f} vs required "
            f"{need:.4f} (baseline {baseline.value})"
        )
    verdict = PASS if ok or mode == "warn" else FAIL
    prefix = "" if ok else ("WARNING (--accuracy=warn): " if mode == "warn" else "")
    details["verdict_without_warn"] = PASS if ok else FAIL
    return CheckResult("accuracy", verdict, f"{prefix}{baseline.task} {baseline.key} {how}", details)


def model_args(
    *,
    model: str,
    base_url: str,
    endpoint: str = "completions",
    num_concurrent: int = 100,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
) -> str:
    """lm_eval's model_args string for the router's OpenAI endpoint."""
    path = "chat/completions" if endpoint == "chat" else "completions"
    args = [
        f"model={model}",
        f"base_url={base_url}/v1/{path}",
        f"num_concurrent={num_concurrent}",
        "tokenized_requests=False",
    ]
    if endpoint == "chat":
        args.append("tokenizer_backend=huggingface")
    if tokenizer:
        args.append(f"tokenizer={tokenizer}")
    if trust_remote_code:
        args.append("trust_remote_code=True")
    if revision:
        args.append(f"revision={revision}")
    return ",".join(args)


def lm_eval_model(endpoint: str) -> str:
    return "local-chat-completions" if endpoint == "chat" else "local-completions"


def read_result(results: Mapping[str, Any], task: str, key: str) -> tuple[float, int]:
    """(value, sample count) for ``task``/``key`` from lm_eval's simple_evaluate output."""
    try:
        value = float(results["results"][task][key])
    except KeyError:
        got = sorted(results.get("results", {}).get(task, {}))
        raise KeyError(f"lm_eval result has no {task}/{key}; it has {got}") from None
    n_samples = results.get("n-samples", {}).get(task, {})
    n = int(n_samples.get("effective") or n_samples.get("original") or 0)
    return value, n


def responses(results: Mapping[str, Any], task: str) -> dict[int, list[Any]]:
    """doc_id -> the model's raw responses, from a run with log_samples=True."""
    return {int(s["doc_id"]): s.get("resps") for s in results.get("samples", {}).get(task, [])}


@reporting(numbers)
def compare_samples(pd: Mapping[int, Any], base: Mapping[int, Any], *, baseline: str) -> CheckResult:
    """Per-sample identity of two greedy runs (the CPU lane's accuracy rule)."""
    details: dict[str, Any] = {"samples": len(pd), "baseline": baseline}
    if not pd or set(pd) != set(base):
        return CheckResult(
            "accuracy",
            FAIL,
            f"sample sets differ or are empty ({len(pd)} via router, {len(base)} via {baseline})",
            details,
        )
    diff = sorted(d for d in pd if pd[d] != base[d])
    details["differing_doc_ids"] = diff[:50]
    if diff:
        d = diff[0]
        return CheckResult(
            "accuracy",
            FAIL,
            f"{len(diff)}/{len(pd)} samples differ between the P/D "
            f"router and {baseline} (first: doc {d}: {str(pd[d])[:80]!r} vs "
            f"{str(base[d])[:80]!r})",
            details,
        )
    return CheckResult(
        "accuracy",
        PASS,
        f"{len(pd)}/{len(pd)} lm_eval samples identical through the P/D router and {baseline} (greedy)",
        details,
    )


def run_lm_eval(
    *,
    model: str,
    base_url: str,
    task: str,
    include_path: Path | None = None,
    endpoint: str = "completions",
    tokenizer: str | None = None,
    num_concurrent: int = 100,
    limit: int | None = None,
    num_fewshot: int | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm_eval.simple_evaluate against an OpenAI-compatible endpoint (imported lazily)."""
    import os

    if include_path:  # a local task needs no hub; make the datasets library not ask it
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    # A local task (the CPU lane's) needs none of lm_eval's own: indexing those takes ~17 s per run.
    tm = (
        TaskManager(include_path=str(include_path), include_defaults=False) if include_path else TaskManager()
    )
    kwargs: dict[str, Any] = {}
    if endpoint == "chat":
        kwargs["apply_chat_template"] = True
    return lm_eval.simple_evaluate(
        model=lm_eval_model(endpoint),
        model_args=model_args(
            model=model,
            base_url=base_url,
            endpoint=endpoint,
            num_concurrent=num_concurrent,
            tokenizer=tokenizer,
            trust_remote_code=trust_remote_code,
            revision=revision,
        ),
        tasks=[task],
        task_manager=tm,
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=log_samples,
        **kwargs,
    )


def record_baseline(path: Path, b: Baseline, *, command: str, date: str) -> None:
    """Append ``b`` to the baselines file with how and when it was measured."""
    if find_baseline(load_baselines(path), b.model, b.task) is not None:
        raise ConfigError(
            "--record-baseline",
            f"{path} already has a baseline for {b.model} on {b.task}; remove it first to re-record",
        )
    import tomli_w  # only here: a TOML writer, never string formatting

    entry = {
        "model": b.model,
        "task": b.task,
        "value": round(b.value, 4),
        "metric": b.metric,
        "filter": b.filter,
        "samples": b.samples,
        "num_fewshot": b.num_fewshot,
        "endpoint": b.endpoint,
        "rtol": b.rtol,
        "source": f"recorded {date} by: {command}",
    }
    entry = {k: v for k, v in entry.items() if v is not None}  # TOML has no null: absent = default
    with open(path, "a") as f:
        f.write("\n" + tomli_w.dumps({"baseline": [entry]}))


# ---------------------------------------------------------------- gatherer (edge)


def as_options(opts: AccuracyOptions) -> dict[str, Any]:
    """The check's options as the runner passes them to :func:`run` (they come from the command
    line, not from a sweep's ``[check_options]``)."""
    return dataclasses.asdict(opts)


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    """Gatherer: :func:`check` with the options of :func:`as_options` (none: the defaults)."""
    return check(window.cluster, AccuracyOptions(**options))


def check(cluster: Cluster, opts: AccuracyOptions) -> CheckResult:
    """The gatherer's work: on a tiny model, the offline task through the router and straight to
    prefill-0 must give identical samples; elsewhere lm_eval through the router is compared with
    the recorded baseline (or records it)."""
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
            res = run_lm_eval(
                base_url=url,
                task=OFFLINE_TASK,
                include_path=include,
                tokenizer=plan.model,
                log_samples=True,
                **common,
            )
            runs[label] = responses(res, OFFLINE_TASK)
        return compare_samples(
            runs["router"], runs[plan.prefill[0].name], baseline=f"{plan.prefill[0].name} direct"
        )
    baseline = find_baseline(load_baselines(opts.baselines), cfg.model, opts.task)
    if baseline is None and not opts.record_baseline:
        msg = missing_baseline_message(cfg.model, opts.task, opts.baselines)
        return CheckResult(
            "accuracy",
            PASS if opts.mode == "warn" else FAIL,
            ("WARNING (--accuracy=warn): " if opts.mode == "warn" else "") + msg,
        )
    endpoint = baseline.endpoint if baseline else "completions"
    res = run_lm_eval(
        base_url=plan.router.url,
        task=opts.task,
        endpoint=endpoint,
        limit=opts.limit,
        num_fewshot=baseline.num_fewshot if baseline else 5,
        tokenizer=None,
        **common,
    )
    key = baseline.key if baseline else "exact_match,strict-match"
    value, n = read_result(res, opts.task, key)
    if opts.record_baseline:
        new = Baseline(model=cfg.model, task=opts.task, value=value, samples=n, endpoint=endpoint)
        record_baseline(
            opts.baselines, new, command=shlex.join(sys.argv), date=datetime.date.today().isoformat()
        )
        return CheckResult(
            "accuracy",
            PASS,
            f"recorded baseline {cfg.model}/{opts.task} = {value:.4f} on {n} samples in {opts.baselines}",
            {"measured": value, "samples": n},
        )
    assert baseline is not None  # both ways without one returned above
    return compare(
        value, n, baseline, rule=opts.rule, mode=opts.mode, allow_sample_mismatch=opts.allow_sample_mismatch
    )
