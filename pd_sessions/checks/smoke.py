"""smoke: one completion through the router returns the requested tokens, ended as asked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pd_sessions.checks.completions import MAX_TOKENS, Completion
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting

SMOKE_PROMPT = "Hello from pd-sessions: the smoke test says"


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the completion's token counts."""
    return [*pick(details, ("completion_tokens", "tokens"), ("prompt_tokens", "tokens"))]


@reporting(numbers)
def evaluate(c: Completion, *, max_tokens: int = MAX_TOKENS) -> CheckResult:
    """Pass when the router answered with exactly ``max_tokens`` generated tokens, some text, and
    finish_reason "length" (the request asks ``max_tokens`` with ignore_eos, so no other reason is
    right: "error", "stop" or none at all is an answer the server ended early or broke).

    another token count       -> fail, naming both counts and the finish_reason
    empty text                -> fail
    finish_reason not "length" -> fail, naming it
    """
    details = {
        "text": c.text,
        "completion_tokens": c.completion_tokens,
        "prompt_tokens": c.prompt_tokens,
        "finish_reason": c.finish_reason,
    }
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
    if c.finish_reason != "length":
        return CheckResult(
            "smoke",
            FAIL,
            f"router returned {c.completion_tokens} tokens with finish_reason {c.finish_reason!r}, "
            "not 'length' (the request asks max_tokens with ignore_eos)",
            details,
        )
    return CheckResult(
        "smoke", PASS, f"router completed {c.completion_tokens} tokens: {c.text[:60]!r}", details
    )


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    """Gatherer: one completion through the router, counted in the window's ledger."""
    return evaluate(window.via_router(SMOKE_PROMPT))
