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

Comparisons follow the parity check's mode (checks/parity.py): token for token when prefill and
decode share one numeric layout, teacher-forced through the direct instance within the margin
when they do not (the P/D output mixes the prefill's KV with the decode's arithmetic).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pd_sessions.checks import parity
from pd_sessions.checks.completions import MAX_TOKENS, Completion
from pd_sessions.checks.instances import REQUEST_TIMEOUT_S, block_size, tokenize
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting
from pd_sessions.runtime import http

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
    base: parity.Reference  # its completion (exact mode) or its scores of pd's tokens (margin)


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


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the mode and a row per prefix-cache situation."""
    situations = details.get("situations") or []
    out: list[Figure | Table] = [*pick(details, ("mode", ""))]
    if situations:
        out.append(
            Table(
                "situations",
                ("situation", "prompt tokens", "block size", "compared with", "same"),
                tuple(
                    (
                        s.get("name"),
                        s.get("prompt_tokens"),
                        s.get("block_size"),
                        s.get("baseline"),
                        s.get("same"),
                    )
                    for s in situations
                ),
            )
        )
    return out


@reporting(numbers)
def evaluate(
    situations: Sequence[Situation],
    build_errors: Sequence[str] = (),
    *,
    judge: parity.Judge | None = None,
    max_tokens: int = MAX_TOKENS,
) -> CheckResult:
    """Every situation arose and its P/D output matches its direct baseline: token for token
    (exact mode, the default) or within the margin of its forced scores (margin mode)."""
    j = judge or parity.Judge("exact", "same numeric layout", parity.DEFAULT_MARGIN)
    verdicts = [
        parity.judge(j, [(s.name, s.pd, s.base)], baseline=s.baseline, max_tokens=max_tokens)
        for s in situations
    ]
    details: dict[str, Any] = {
        "mode": j.mode,
        "mode_reason": j.why,
        "situations": [
            {
                "name": s.name,
                "prompt_tokens": s.prompt_tokens,
                "block_size": s.block_size,
                "baseline": s.baseline,
                "same": v.passed,
                "pd_token_ids": list(s.pd.token_ids or ()),
                "comparison": v.details,
            }
            for s, v in zip(situations, verdicts, strict=True)
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
    bad = [
        f"{s.name} ({s.prompt_tokens} tokens, block {s.block_size}): {v.message}"
        for s, v in zip(situations, verdicts, strict=True)
        if not v.passed
    ]
    if bad:
        return CheckResult("cache_paths", FAIL, f"{len(bad)}/3 situations differ: " + "; ".join(bad), details)
    parts = ", ".join(f"{s.name} {s.prompt_tokens} tok" for s in situations)
    how = (
        "identical token for token"
        if j.mode == "exact"
        else f"within {j.margin:g} nats of the direct instance's top-1 (margin mode: {j.why})"
    )
    return CheckResult(
        "cache_paths",
        PASS,
        f"3/3 prefix-cache situations {how} (block {situations[0].block_size}: {parts})",
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


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    plan = window.plan
    model = plan.served_model_name
    block = block_size(plan)
    want = lengths(block)
    p0, d0 = plan.prefill[0], plan.decode[0]

    j = parity.Judge.for_config(plan.config)

    def complete(url: str, prompt: str) -> Completion:
        return Completion.from_response(
            http.completion(url, model, prompt, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT_S)
        )

    def situation(
        name: str, tokens: int, direct: Any, prompt: str, primed: Completion | None = None
    ) -> Situation:
        """Through the router, then the direct side: in exact mode ``direct``'s own completion
        (``primed``, when it was already asked), in margin mode its scores of the P/D tokens."""
        pd = complete(plan.router.url, prompt)
        if j.mode == "exact" and primed is not None:
            base: parity.Reference = primed
        else:
            base = parity.reference(
                j, direct.url, model, prompt, pd, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT_S
            )
        return Situation(name, tokens, block, f"{direct.name} direct", pd, base)

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
    try:
        out = [situation("short", len(short_t), p0, short)]
        # prime every decode (the router may pick any of them); decode-0's answer is the baseline
        primes = {d.name: complete(d.url, primed) for d in plan.decode}
        out.append(situation("primed", len(primed_t), d0, primed, primes[d0.name]))
        out.append(situation("partial", len(partial_t), p0, partial))
    except ValueError as e:  # margin mode without token ids
        return evaluate([], [f"could not score the P/D tokens: {e}"], judge=j)
    return evaluate(out, judge=j)
