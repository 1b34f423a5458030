"""cache_paths: greedy parity in the three prefix-cache situations upstream's P/D tests use.
A prefix-cache hit on the decode side takes another code path in the connectors (a full hit
means nothing to pull, only blocks to free on the prefill side).

1. short:   a prompt shorter than one block, through the router == prefill-direct;
2. primed:  a prompt of two and a half blocks first sent straight to every decode instance
            (priming their prefix caches), then through the router == decode-0 direct;
3. partial: that prompt extended by a further block and a half (a partial hit on the decode
            side), through the router == prefill-direct.

Prompt lengths derive from the decode's block size (128 on the CPU lane, 16 by default on
GPUs) and are measured with the instance's own tokenizer, so the situations really arise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pd_sessions import http
from pd_sessions.checks.base import FAIL, PASS, CheckResult
from pd_sessions.checks.completions import MAX_TOKENS, Completion
from pd_sessions.checks.instances import REQUEST_TIMEOUT_S, block_size, tokenize
from pd_sessions.checks.parity import evaluate_exact

# One word per token in every tokenizer we have met (the space is part of the word).
WORDS = (
    " apple",
    " river",
    " stone",
    " cloud",
    " green",
    " table",
    " seven",
    " north",
    " light",
    " paper",
    " horse",
    " water",
)
LEAD = {"short": "Short:", "primed": "Primed cache:"}


@dataclass(frozen=True)
class Situation:
    name: str  # short | primed | partial
    prompt_tokens: int
    block_size: int
    baseline: str  # which direct instance the output must equal
    pd: Completion
    base: Completion


def lengths(block: int) -> dict[str, int]:
    """Target prompt lengths in tokens for each situation.

    short   : block // 2            (< one block: nothing to cache)
    primed  : 2 * block + block // 2 (two full blocks cached on decode, a partial third)
    partial : primed + block + block // 2 (the primed blocks hit, the rest is new)
    """
    half = max(1, block // 2)
    primed = 2 * block + half
    return {"short": half, "primed": primed, "partial": primed + block + half}


def situation_errors(
    name: str, tokens: int, block: int, *, primed_tokens: int | None = None, prefix_ok: bool = True
) -> list[str]:
    """Why a built prompt would not make its situation arise (empty = it does)."""
    errors = []
    if name == "short" and not 0 < tokens < block:
        errors.append(f"short prompt has {tokens} tokens, not fewer than one block ({block})")
    if name == "primed" and tokens < 2 * block:
        errors.append(f"primed prompt has {tokens} tokens, fewer than two blocks ({2 * block})")
    if name == "partial":
        if primed_tokens is None or tokens < primed_tokens + block:
            errors.append(
                f"partial prompt has {tokens} tokens, not a block more than the primed one ({primed_tokens})"
            )
        if not prefix_ok:
            errors.append("partial prompt's tokens do not start with the primed prompt's tokens")
    return errors


def evaluate(situations: Sequence[Situation], build_errors: Sequence[str] = ()) -> CheckResult:
    """Every situation arose and its P/D output equals its direct baseline, token for token."""
    details: dict[str, Any] = {
        "situations": [
            {
                "name": s.name,
                "prompt_tokens": s.prompt_tokens,
                "block_size": s.block_size,
                "baseline": s.baseline,
                "same": s.pd.token_ids == s.base.token_ids and bool(s.pd.token_ids),
                "pd_token_ids": list(s.pd.token_ids or ()),
                "baseline_token_ids": list(s.base.token_ids or ()),
            }
            for s in situations
        ],
        "build_errors": list(build_errors),
    }
    if build_errors:
        return CheckResult(
            "cache_paths", FAIL, "could not build the situations: " + "; ".join(build_errors), details
        )
    if {s.name for s in situations} != {"short", "primed", "partial"}:
        return CheckResult(
            "cache_paths",
            FAIL,
            f"ran {[s.name for s in situations]}, not all of short, primed, partial",
            details,
        )
    bad = []
    for s in situations:
        r = evaluate_exact([(s.name, s.pd, s.base)], baseline=s.baseline)
        if not r.passed:
            bad.append(f"{s.name} ({s.prompt_tokens} tokens, block {s.block_size}): {r.message}")
    if bad:
        return CheckResult("cache_paths", FAIL, f"{len(bad)}/3 situations differ: " + "; ".join(bad), details)
    parts = ", ".join(f"{s.name} {s.prompt_tokens} tok" for s in situations)
    return CheckResult(
        "cache_paths",
        PASS,
        f"3/3 prefix-cache situations identical token for token (block {situations[0].block_size}: {parts})",
        details,
    )


def _text(lead: str, n_words: int, offset: int = 0) -> str:
    return lead + "".join(WORDS[(offset + i) % len(WORDS)] for i in range(n_words))


def _rate(url: str, model: str) -> float:
    """Tokens per word of WORDS in this tokenizer (not one each in every tokenizer)."""
    sample = 48
    return max(1.0, len(tokenize(url, model, _text("", sample)).tokens) / sample)


def _fit(
    url: str, model: str, lead: str, target: int, rate: float, *, offset: int = 0
) -> tuple[str, tuple[int, ...]]:
    """``lead`` + words, with a token count from ``target`` to a few words' worth above it."""
    base = len(tokenize(url, model, lead).tokens)
    words = max(1, round((target - base) / rate))
    text = lead
    toks: tuple[int, ...] = ()
    for _ in range(8):
        text = _text(lead, words, offset)
        toks = tokenize(url, model, text).tokens
        if target <= len(toks) <= target + 2 * rate + 2:
            break
        step = round((target - len(toks)) / rate)
        words = max(1, words + (step if step else (1 if len(toks) < target else -1)))
    return text, toks


def run(cluster: Any, options: Mapping[str, Any]) -> CheckResult:
    plan = cluster.plan
    model = plan.served_model_name
    block = block_size(plan)
    want = lengths(block)
    p0, d0 = plan.prefill[0], plan.decode[0]

    def complete(url: str, prompt: str) -> Completion:
        return Completion.from_response(
            http.completion(url, model, prompt, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT_S)
        )

    rate = _rate(p0.url, model)
    short, short_t = _fit(p0.url, model, LEAD["short"], want["short"], rate)
    primed, primed_t = _fit(p0.url, model, LEAD["primed"], want["primed"], rate)
    half = want["partial"] - want["primed"]  # a block and a half more than the primed prompt
    partial, partial_t = _fit(p0.url, model, primed, len(primed_t) + half, rate, offset=3)
    errors = (
        situation_errors("short", len(short_t), block)
        + situation_errors("primed", len(primed_t), block)
        + situation_errors(
            "partial",
            len(partial_t),
            block,
            primed_tokens=len(primed_t),
            prefix_ok=partial_t[: len(primed_t)] == primed_t,
        )
    )
    if errors:
        return evaluate([], errors)
    out = [
        Situation(
            "short",
            len(short_t),
            block,
            f"{p0.name} direct",
            complete(plan.router.url, short),
            complete(p0.url, short),
        )
    ]
    # prime every decode (the router may pick any of them); decode-0's answer is the baseline
    primes = {d.name: complete(d.url, primed) for d in plan.decode}
    out.append(
        Situation(
            "primed",
            len(primed_t),
            block,
            f"{d0.name} direct",
            complete(plan.router.url, primed),
            primes[d0.name],
        )
    )
    out.append(
        Situation(
            "partial",
            len(partial_t),
            block,
            f"{p0.name} direct",
            complete(plan.router.url, partial),
            complete(p0.url, partial),
        )
    )
    return evaluate(out)
