"""Completion responses and the smoke check (pure). Parity lives in :mod:`pd_sessions.checks.parity`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_sessions.core.results import FAIL, PASS, CheckResult

# Distinct prompts (distinct prefixes too) so no router request can be served from
# the decode instance's own prefix cache; one is longer than a 128-token block.
PARITY_PROMPTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog near the river",
    "Seven plus five equals twelve, and twelve plus one equals",
    "Question: how many apples are left if each of the ten birds takes one? Answer:",
    " ".join(
        f"Row {i}: the {w} stone sits under the old tree."
        for i, w in enumerate(
            [
                "red",
                "blue",
                "green",
                "small",
                "large",
                "old",
                "new",
                "quick",
                "slow",
                "happy",
                "quiet",
                "bright",
                "dark",
                "warm",
                "cold",
                "red",
            ]
        )
    ),
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
    prompt_token_ids: tuple[int, ...] | None = None

    @classmethod
    def from_response(cls, resp: dict[str, Any]) -> Completion:
        choice = (resp.get("choices") or [{}])[0]
        usage = resp.get("usage") or {}
        ids = choice.get("token_ids")
        return cls(
            text=choice.get("text") or "",
            token_ids=tuple(ids) if ids is not None else None,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            finish_reason=choice.get("finish_reason"),
            prompt_token_ids=(
                tuple(choice["prompt_token_ids"]) if choice.get("prompt_token_ids") is not None else None
            ),
        )


def evaluate_smoke(c: Completion, *, max_tokens: int = MAX_TOKENS) -> CheckResult:
    """Pass when the router answered with exactly ``max_tokens`` generated tokens."""
    details = {"text": c.text, "completion_tokens": c.completion_tokens, "prompt_tokens": c.prompt_tokens}
    if c.completion_tokens != max_tokens:
        return CheckResult(
            "smoke",
            FAIL,
            f"router returned {c.completion_tokens} tokens, "
            f"expected {max_tokens} (finish_reason {c.finish_reason!r})",
            details,
        )
    if not c.text:
        return CheckResult("smoke", FAIL, "router returned empty text", details)
    return CheckResult(
        "smoke", PASS, f"router completed {c.completion_tokens} tokens: {c.text[:60]!r}", details
    )
