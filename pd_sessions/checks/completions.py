"""Smoke and greedy-parity checks (pure evaluation of completion responses)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pd_sessions.checks.base import FAIL, PASS, CheckResult

# Distinct prompts (distinct prefixes too) so no router request can be served from
# the decode instance's own prefix cache; one is longer than a 128-token block.
PARITY_PROMPTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog near the river",
    "Seven plus five equals twelve, and twelve plus one equals",
    "Question: how many apples are left if each of the ten birds takes one? Answer:",
    " ".join(f"Row {i}: the {w} stone sits under the old tree." for i, w in
             enumerate(["red", "blue", "green", "small", "large", "old", "new", "quick",
                        "slow", "happy", "quiet", "bright", "dark", "warm", "cold", "red"])),
)
SMOKE_PROMPT = "Hello from pd-sessions: the smoke test says"
MAX_TOKENS = 16


@dataclass(frozen=True)
class Completion:
    """What we keep of one /v1/completions answer."""

    text: str
    token_ids: tuple[int, ...] | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None

    @classmethod
    def from_response(cls, resp: dict[str, Any]) -> Completion:
        choice = (resp.get("choices") or [{}])[0]
        usage = resp.get("usage") or {}
        ids = choice.get("token_ids")
        return cls(text=choice.get("text") or "", token_ids=tuple(ids) if ids is not None else None,
                   prompt_tokens=int(usage.get("prompt_tokens") or 0),
                   completion_tokens=int(usage.get("completion_tokens") or 0),
                   finish_reason=choice.get("finish_reason"))


def evaluate_smoke(c: Completion, *, max_tokens: int = MAX_TOKENS) -> CheckResult:
    """Pass when the router answered with exactly ``max_tokens`` generated tokens."""
    details = {"text": c.text, "completion_tokens": c.completion_tokens,
               "prompt_tokens": c.prompt_tokens}
    if c.completion_tokens != max_tokens:
        return CheckResult("smoke", FAIL, f"router returned {c.completion_tokens} tokens, "
                           f"expected {max_tokens} (finish_reason {c.finish_reason!r})", details)
    if not c.text:
        return CheckResult("smoke", FAIL, "router returned empty text", details)
    return CheckResult("smoke", PASS, f"router completed {c.completion_tokens} tokens: {c.text[:60]!r}",
                       details)


def _first_diff(a: Sequence[Any], b: Sequence[Any]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def evaluate_parity(pairs: Sequence[tuple[str, Completion, Completion]], *, baseline: str) -> CheckResult:
    """Token-for-token equality of (prompt, P/D completion, baseline completion) pairs.

    Compares token ids when both sides have them, else text.
    """
    if not pairs:
        return CheckResult("parity", FAIL, "no prompts were compared")
    mismatches = []
    rows = []
    for prompt, pd, base in pairs:
        use_ids = pd.token_ids is not None and base.token_ids is not None
        a = pd.token_ids if use_ids else pd.text
        b = base.token_ids if use_ids else base.text
        same = a == b and len(a or ()) > 0
        rows.append({"prompt": prompt[:60], "same": same, "pd_text": pd.text, "baseline_text": base.text,
                     "pd_token_ids": list(pd.token_ids or ()), "baseline_token_ids": list(base.token_ids or ())})
        if not same:
            at = _first_diff(a or (), b or ())
            mismatches.append(f"prompt {prompt[:40]!r}: differ at {'token' if use_ids else 'char'} {at} "
                              f"(P/D {pd.text!r} vs {baseline} {base.text!r})")
    details = {"baseline": baseline, "prompts": rows}
    if mismatches:
        return CheckResult("parity", FAIL, f"{len(mismatches)}/{len(pairs)} prompts differ: "
                           + "; ".join(mismatches), details)
    return CheckResult("parity", PASS, f"{len(pairs)}/{len(pairs)} prompts identical token for token "
                       f"(P/D via router vs {baseline})", details)
