"""What the request-features check keeps of one answer (pure): a /v1/completions or
/v1/chat/completions answer, whole or streamed (server-sent events), or a refusal (an HTTP
error status with its body).

Both endpoints come down to the same :class:`Answer`: its choices (text, generated token ids,
finish reason, the chosen tokens' logprobs and the top logprobs per position), the usage, the
prompt's token ids (vLLM's ``return_token_ids``), and, when streamed, how many chunks carried
the usage (``stream_options.include_usage``: exactly the last one).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TopLogprobs = tuple[tuple[str, float], ...]  # one position's (token, logprob), sorted by token


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    token_ids: tuple[int, ...] | None
    finish_reason: str | None
    logprobs: tuple[float, ...] | None = None  # the chosen tokens' logprobs, when asked for
    top_logprobs: tuple[TopLogprobs, ...] | None = None


@dataclass(frozen=True)
class Answer:
    status: int  # the HTTP status: 200, or the error's
    error: str = ""  # the error's body (a refusal), else ""
    choices: tuple[Choice, ...] = ()
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    usage_chunks: int | None = None  # streamed: chunks that carried the usage; None: not streamed

    @property
    def ok(self) -> bool:
        return self.status == 200

    @classmethod
    def refused(cls, status: int, body: str) -> Answer:
        """An HTTP error answer; ``error`` is the body's message (the body itself when not JSON)."""
        return cls(status=status, error=error_message(body))

    @classmethod
    def from_response(cls, resp: Mapping[str, Any], *, chat: bool) -> Answer:
        """A whole (not streamed) answer of either endpoint."""
        choices = tuple(_choice(c, chat=chat) for c in resp.get("choices") or ())
        usage = resp.get("usage") or {}
        return cls(
            status=200,
            choices=tuple(sorted(choices, key=lambda c: c.index)),
            prompt_tokens=_int(usage.get("prompt_tokens")),
            completion_tokens=_int(usage.get("completion_tokens")),
            prompt_token_ids=_prompt_ids(resp),
        )

    @classmethod
    def from_stream(cls, body: str, *, chat: bool) -> Answer:
        """A streamed answer: ``data: {json}`` events up to ``data: [DONE]``, joined per choice
        (text, token ids, logprobs in order; the last finish reason). ValueError when the body is
        not such a stream or names an error."""
        events = sse_events(body)
        parts: dict[int, list[Choice]] = {}
        usage: dict[str, Any] = {}
        usage_chunks = 0
        prompt_ids = None
        for ev in events:
            if "error" in ev:
                raise ValueError(f"the stream carried an error: {ev['error']}")
            for c in ev.get("choices") or ():
                parts.setdefault(int(c.get("index", 0)), []).append(_choice(c, chat=chat, delta=True))
            if ev.get("usage"):
                usage_chunks += 1
                usage = ev["usage"]
            prompt_ids = _prompt_ids(ev) or prompt_ids
        choices = tuple(_join(i, ps) for i, ps in sorted(parts.items()))
        return cls(
            status=200,
            choices=choices,
            prompt_tokens=_int(usage.get("prompt_tokens")),
            completion_tokens=_int(usage.get("completion_tokens")),
            prompt_token_ids=prompt_ids,
            usage_chunks=usage_chunks,
        )


def error_message(body: str) -> str:
    """The message of an error body: OpenAI's {"error": {"message": ...}}, vLLM's {"message": ...},
    else the body's text (stripped; "" when empty)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body.strip()
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        if doc.get("message"):
            return str(doc["message"])
    return body.strip()


def sse_events(body: str) -> list[dict[str, Any]]:
    """The JSON events of a server-sent-events body, up to ``data: [DONE]``. ValueError when a
    data line is not JSON or no event came."""
    events = []
    for line in body.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        try:
            events.append(json.loads(data))
        except ValueError:
            raise ValueError(f"not a JSON event: {data[:200]!r}") from None
    if not events:
        raise ValueError(f"no server-sent event in the answer: {body[:200]!r}")
    return events


def _int(v: Any) -> int | None:
    return int(v) if v is not None else None


def _prompt_ids(resp: Mapping[str, Any]) -> tuple[int, ...] | None:
    """vLLM's prompt token ids: at the top (chat) or in the first choice (completions)."""
    ids = resp.get("prompt_token_ids")
    if ids is None:
        first = (resp.get("choices") or [{}])[0]
        ids = first.get("prompt_token_ids")
    return tuple(ids) if ids is not None else None


def _choice(c: Mapping[str, Any], *, chat: bool, delta: bool = False) -> Choice:
    if chat:
        msg = c.get("delta" if delta else "message") or {}
        text = msg.get("content") or ""
    else:
        text = c.get("text") or ""
    ids = c.get("token_ids")
    lps, tops = _logprobs(c.get("logprobs"), chat=chat)
    return Choice(
        index=int(c.get("index", 0)),
        text=text,
        token_ids=tuple(ids) if ids is not None else None,
        finish_reason=c.get("finish_reason"),
        logprobs=lps,
        top_logprobs=tops,
    )


def _logprobs(lp: Any, *, chat: bool) -> tuple[tuple[float, ...] | None, tuple[TopLogprobs, ...] | None]:
    """(chosen logprobs, top logprobs per position) of a choice's ``logprobs`` (None: not asked)."""
    if not lp:
        return None, None
    if chat:
        content = lp.get("content") or []
        chosen = tuple(float(e["logprob"]) for e in content)
        tops = tuple(
            tuple(sorted((t["token"], float(t["logprob"])) for t in e.get("top_logprobs") or ()))
            for e in content
        )
        return chosen, tops
    chosen = tuple(float(x) for x in lp.get("token_logprobs") or ())
    tops = tuple(
        tuple(sorted((k, float(v)) for k, v in (pos or {}).items())) for pos in lp.get("top_logprobs") or ()
    )
    return chosen, tops


def _join(index: int, parts: Sequence[Choice]) -> Choice:
    """One streamed choice from its chunks, in order."""
    ids = [i for p in parts for i in (p.token_ids or ())]
    has_ids = any(p.token_ids is not None for p in parts)
    lps = [x for p in parts for x in (p.logprobs or ())]
    tops = [t for p in parts for t in (p.top_logprobs or ())]
    finish = next((p.finish_reason for p in reversed(parts) if p.finish_reason), None)
    return Choice(
        index=index,
        text="".join(p.text for p in parts),
        token_ids=tuple(ids) if has_ids else None,
        finish_reason=finish,
        logprobs=tuple(lps) if any(p.logprobs is not None for p in parts) else None,
        top_logprobs=tuple(tops) if any(p.top_logprobs is not None for p in parts) else None,
    )
