"""Completion responses (pure): what the checks keep of one /v1/completions answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Tokens each check completion generates (greedy, ignore_eos).
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
