"""request_features: the request paths users send, through the router, each compared with the
same request sent straight to prefill-0 (no disaggregation), in one check so that the cost stays
small. The anchors' request shapes that break P/D (SGLang's first-token finish and logprob
lengths, upstream vLLM's block-boundary prompts with exact metric identities):

- first-token finish: ``max_tokens=1``; a stop string hit at the first token; a stop token id
  as the first token: exactly one completion token, the finish reason prefill-direct gives;
- ``n=2``: at temperature 0 (vLLM refuses it: the router must pass the 400 on), greedy (top_k=1)
  and seeded (temperature 1 with ``seed``);
- seeded sampling (one choice);
- ``logprobs``: the same number per choice, equal within :data:`LOGPROB_TOL` (exact mode);
- streaming with ``stream_options.include_usage``: the joined text, and the usage in exactly one
  chunk, equal to prefill-direct's;
- ``echo``: the prompt, then the completion (asked without ``return_token_ids``, with which vLLM
  leaves the prompt out of the text; in margin mode its text is not scored, only the echo and
  the usage: the other greedy cases score the tokens);
- chat completions (the generated tiny models carry a chat template);
- prompts of exactly B-1, B, B+1, 2B and 4B+2 tokens (B: the decode's block size), then the 4B+2
  one again, each with the KV accounting per request: the decode's prompt tokens by source
  around it must equal what the connector's code implies (core/kv_identity.py), exactly: a fresh
  prompt arrives whole by transfer; the repeat finds 4B tokens in the decode's own cache.

How answers are compared follows parity's mode (checks/parity.py): in exact mode (one numeric
layout) token for token, finish reasons, usage and logprobs within :data:`LOGPROB_TOL`; in margin
mode every P/D choice is teacher-forced through prefill-0: a greedy token must be its top-1 or
within the margin, a sampled token's (and any reported) logprob within the margin of the forced
one.

A feature the P/D path cannot serve must be refused clearly (HTTP 4xx with a message): that is
recorded as refused, not failed. A different answer with 200 (prefill-direct refusing what the
router answers, or answering otherwise) fails; so does a 5xx.

How it is sent, so that the cost stays small: first one request with ``logprobs`` straight to
every instance at once (vLLM compiles a sampler helper on an engine's first such request: seconds
on the CPU lane, paid by whichever request came first; :meth:`Asker.warm_up`), then every feature's
P/D and prefill-direct sides at once (a small thread pool; no KV counter is read around them),
then the block-boundary prompts one at a time through the router, nothing else in flight through
the decodes, each prefill-direct side sent while the next P/D request runs.

Pure: :func:`compare` (one case), :func:`evaluate` (the verdict). :func:`run` is the gatherer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from pd_sessions.checks import instances, parity
from pd_sessions.checks.answers import Answer
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import connector_support, kv_identity
from pd_sessions.core.kv_identity import Counts
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, reporting
from pd_sessions.runtime import http

# Exact mode: P/D logprobs must equal prefill-direct's within this (the bound; float32 CPU
# runs agree to ~1e-6).
LOGPROB_TOL = 1e-3
MAX_TOKENS = 8  # per feature request (the block-boundary requests: BLOCK_MAX_TOKENS)
BLOCK_MAX_TOKENS = 4
SEED = 1234
# A request shape the connector is known not to serve (n > 1 over Mooncake: the decode's second
# child waits for KV it never gets) is still sent, last, with this deadline, so that a fix shows
# (configs/known_issues.toml judges its failure: XFAIL, or XPASS once it passes); then the check
# waits up to LIMIT_DRAIN_S for the decodes to hold no request again, so that the checks after it
# see an idle cluster (a stuck pull lasts VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s).
LIMIT_DEADLINE_S = 20.0
LIMIT_DRAIN_S = 120.0
LIMIT_ATTEMPTS = 64  # each with a new prompt, until one is not answered (see tried()): a hang seen
# in about 1 of 8 seeded requests (2026-12-05) goes unseen in 32 tries 1.4 % of the time, a false XPASS
# How long a per-request KV scrape may wait for the counters to show the request (they are
# recorded with the request's first token, before its answer; this only covers a late flush).
KV_SETTLE_S = 2.0
KV_POLL_S = 0.1


@dataclass(frozen=True)
class KvRow:
    """One block-boundary request's KV accounting on the decodes."""

    prompt_tokens: int
    cached: int  # tokens the decode held in its prefix cache before it
    seen: Counts  # the decodes' prompt tokens by source around it
    want: Counts  # what the connector's identity says (core/kv_identity.py)


@dataclass(frozen=True)
class Case:
    """One feature: its P/D answer, prefill-direct's, and what the comparison needs."""

    name: str
    pd: Answer
    direct: Answer
    sampled: bool = False  # temperature > 0 with a seed
    one_token: str | None = None  # first-token finish: the finish reason of its one token
    streamed: bool = False
    echo_prompt: str | None = None  # echo: the text must start with this
    # margin mode: each P/D choice's tokens as prefill-0 scores them, teacher-forced
    forced: tuple[tuple[parity.ForcedToken, ...], ...] | None = None
    kv: KvRow | None = None
    seconds: Mapping[str, float] | None = None  # the P/D request's, prefill-0's side's
    shape: str = ""  # the request shape a connector may not serve (Feature.shape)
    # a known limit of the connector (its spec's limits.unserved_requests): the case was sent last,
    # with a short deadline (LIMIT_DEADLINE_S), its failure judged by the known-issues registry
    limit: str | None = None
    tries: tuple[float, ...] = ()  # a known limit's attempts, their seconds (see tried())
    # a known limit's other attempts answered with 200, each with its own prefill-direct
    # reference: every one is compared, so a wrong 200 before the hang is a failure, not the limit
    earlier: tuple[Case, ...] = ()


# ---------------------------------------------------------------- pure


def refusal(case: Case) -> tuple[str | None, str | None]:
    """(problem, note) about the HTTP statuses of ``case``.

    P/D 200, direct 200             -> (None, None): compare the answers
    P/D 4xx with a message          -> (None, "refused ..."): recorded, not failed
    P/D 4xx without a message       -> problem: not a clear refusal
    P/D 5xx (or other non-200)      -> problem: the P/D path failed
    P/D 200, direct not 200         -> problem: a 200 where prefill-direct refuses
    """
    pd, direct = case.pd, case.direct
    if pd.ok and direct.ok:
        return None, None
    if pd.ok:
        return (
            f"the router answered 200 where prefill-direct answered HTTP {direct.status} "
            f"({direct.error[:120]!r}): a different answer with 200",
            None,
        )
    if 400 <= pd.status < 500:
        if not pd.error:
            return f"the router answered HTTP {pd.status} with no message: not a clear refusal", None
        by = "as prefill-direct did" if not direct.ok else "while prefill-direct served it"
        return None, f"refused by the P/D path with HTTP {pd.status} {by}: {pd.error[:160]!r}"
    return f"the router answered HTTP {pd.status}: {pd.error[:200]!r}", None


def _close(a: Sequence[float], b: Sequence[float], tol: float) -> int | None:
    """The first position where ``a`` and ``b`` differ by more than ``tol`` (or the shorter length
    when the lengths differ), None when they agree."""
    if len(a) != len(b):
        return min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if abs(x - y) > tol), None)


def _exact(case: Case) -> list[str]:
    """Token for token against prefill-direct: choices, ids (else text), finish reasons, usage,
    logprobs within LOGPROB_TOL (same length), top logprobs (same tokens, within LOGPROB_TOL)."""
    pd, direct = case.pd, case.direct
    out = []
    if len(pd.choices) != len(direct.choices):
        return [f"{len(pd.choices)} choices, prefill-direct {len(direct.choices)}"]
    for a, b in zip(pd.choices, direct.choices, strict=True):
        at = f"choice {a.index}: " if len(pd.choices) > 1 else ""
        if a.token_ids is not None and b.token_ids is not None and a.token_ids != b.token_ids:
            out.append(f"{at}tokens {list(a.token_ids)} vs prefill-direct {list(b.token_ids)}")
        if a.text != b.text:
            out.append(f"{at}text {a.text!r} vs prefill-direct {b.text!r}")
        if a.finish_reason != b.finish_reason:
            out.append(f"{at}finish_reason {a.finish_reason!r} vs prefill-direct {b.finish_reason!r}")
        if (a.logprobs is None) != (b.logprobs is None):
            out.append(f"{at}logprobs {'missing' if a.logprobs is None else 'given'} on the P/D side only")
        elif a.logprobs is not None and b.logprobs is not None:
            i = _close(a.logprobs, b.logprobs, LOGPROB_TOL)
            if i is not None:
                out.append(
                    f"{at}logprobs differ at position {i} (P/D {list(a.logprobs)[i : i + 1]} vs "
                    f"prefill-direct {list(b.logprobs)[i : i + 1]}, {len(a.logprobs)} vs "
                    f"{len(b.logprobs)} entries; tolerance {LOGPROB_TOL:g})"
                )
        out += _top_differ(at, a.top_logprobs, b.top_logprobs)
    if (pd.prompt_tokens, pd.completion_tokens) != (direct.prompt_tokens, direct.completion_tokens):
        out.append(
            f"usage prompt/completion tokens {pd.prompt_tokens}/{pd.completion_tokens} vs "
            f"prefill-direct {direct.prompt_tokens}/{direct.completion_tokens}"
        )
    return out


def _top_differ(at: str, a: Sequence[Any] | None, b: Sequence[Any] | None) -> list[str]:
    if a is None or b is None:
        return [] if a is b else [f"{at}top logprobs on one side only"]
    if len(a) != len(b):
        return [f"{at}top logprobs for {len(a)} positions vs prefill-direct {len(b)}"]
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if [t for t, _ in x] != [t for t, _ in y] or _close(
            [v for _, v in x], [v for _, v in y], LOGPROB_TOL
        ) is not None:
            return [f"{at}top logprobs differ at position {i}: P/D {list(x)} vs prefill-direct {list(y)}"]
    return []


def _margin(case: Case, margin: float) -> list[str]:
    """Within the margin of prefill-0's forced scores: a greedy token's gap to the top-1, a sampled
    (or reported) logprob's distance to the forced one; the same number of choices and prompt
    tokens as prefill-direct."""
    pd, direct = case.pd, case.direct
    out = []
    if len(pd.choices) != len(direct.choices):
        out.append(f"{len(pd.choices)} choices, prefill-direct {len(direct.choices)}")
    if pd.prompt_tokens != direct.prompt_tokens:
        out.append(f"{pd.prompt_tokens} prompt tokens, prefill-direct {direct.prompt_tokens}")
    if case.echo_prompt is not None:  # no token ids to score: the echo itself and the usage
        if pd.completion_tokens != direct.completion_tokens:
            out.append(f"{pd.completion_tokens} completion tokens, prefill-direct {direct.completion_tokens}")
        return out
    forced = case.forced or ()
    if len(forced) != len(pd.choices):
        return [*out, f"{len(forced)} forced scores for {len(pd.choices)} P/D choices"]
    for c, toks in zip(pd.choices, forced, strict=True):
        at = f"choice {c.index}: " if len(pd.choices) > 1 else ""
        if c.token_ids is not None and len(toks) != len(c.token_ids):
            out.append(f"{at}{len(toks)} forced scores for {len(c.token_ids)} tokens")
        if not case.sampled:
            beyond = [t for t in toks if t.gap > margin]
            if beyond:
                t = beyond[0]
                out.append(
                    f"{at}position {t.position}: token {t.token} {t.text!r} is {t.gap:.4f} nats below "
                    f"prefill-0's top-1 {t.top_token} {t.top_text!r} (margin {margin:g})"
                )
        if c.logprobs is not None:
            if len(c.logprobs) != len(toks):
                out.append(f"{at}{len(c.logprobs)} logprobs for {len(toks)} tokens")
            far = [(t, lp) for t, lp in zip(toks, c.logprobs, strict=False) if abs(t.logprob - lp) > margin]
            if far:
                t, lp = far[0]
                out.append(
                    f"{at}position {t.position}: P/D logprob {lp:.4f} of token {t.token} vs "
                    f"prefill-0's {t.logprob:.4f} (margin {margin:g})"
                )
        elif case.sampled:
            out.append(f"{at}a sampled choice without logprobs cannot be judged in margin mode")
    return out


def earlier_wrong(case: Case, judge: parity.Judge) -> list[str]:
    """The problems of a known limit's attempts answered with 200 before its last (each against
    its own prefill-direct answer), each named by its attempt: a wrong answer, then a hang, is a
    wrong answer."""
    out = []
    for i, e in enumerate(case.earlier, 1):
        problems, _ = compare(e, judge)
        out += [f"{e.name} answered 200 but wrong (earlier attempt {i}): {p}" for p in problems[:2]]
    return out


def failed_shape(case: Case, problems: Sequence[str]) -> str:
    """The request shape a failing case reports (``failed_shapes``, what the known-issues registry
    matches): a known limit's shape only when its failure is the limit itself (its request
    unanswered in the deadline, every earlier answer right); a known limit's request answered
    wrong is ``"<shape> answered wrong"``, which no known issue covers."""
    shape = case.shape or "other"
    if case.limit is None:
        return shape
    if case.pd.status == 0 and not any("answered 200 but wrong" in p for p in problems):
        return shape
    return f"{shape} answered wrong"


def compare(case: Case, judge: parity.Judge) -> tuple[list[str], str | None]:
    """(problems, note) of one case: a known limit's request unanswered in its deadline, its
    refusal, then its answers in ``judge``'s mode, then what the feature itself promises (one
    token, usage once, the echoed prompt) and its KV row."""
    wrong = earlier_wrong(case, judge)
    if wrong:
        return wrong, None
    if case.limit is not None and case.pd.status == 0:
        n = f"attempt {len(case.tries)} " if case.tries else ""
        return [f"{n}{case.pd.error} (a known limit of the connector: {case.limit})"], None
    problem, note = refusal(case)
    if problem or note:
        return ([problem] if problem else []), note
    out = _exact(case) if judge.mode == "exact" else _margin(case, judge.margin)
    pd = case.pd
    if case.one_token is not None:
        c = pd.choices[0] if pd.choices else None
        if pd.completion_tokens != 1 or c is None or c.finish_reason != case.one_token:
            out.append(
                f"expected exactly one token finishing with {case.one_token!r}, got "
                f"{pd.completion_tokens} token(s), finish_reason {c.finish_reason if c else None!r}"
            )
    if case.streamed and (pd.usage_chunks != 1 or case.direct.usage_chunks != 1):
        out.append(
            f"include_usage: the usage came in {pd.usage_chunks} chunk(s) through the router, "
            f"{case.direct.usage_chunks} from prefill-direct (expected exactly 1)"
        )
    if case.echo_prompt is not None and not all(c.text.startswith(case.echo_prompt) for c in pd.choices):
        out.append("echo: the P/D text does not start with the prompt")
    if case.kv is not None:
        wrong = kv_identity.mismatches(case.kv.seen, case.kv.want)
        if wrong:
            out.append(
                f"KV accounting of this {case.kv.prompt_tokens}-token request ({case.kv.cached} "
                f"cached on the decode): {'; '.join(wrong)}"
            )
    return out, None


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: cases, refused and not sent; a row per case (same as
    prefill-direct, P/D seconds, the KV seen and expected for the block-boundary prompts)."""
    rows = details.get("cases") or []
    out: list[Figure | Table] = [
        Figure("cases", len(rows)),
        Figure("differ", sum(1 for r in rows if not r.get("same"))),
        Figure("refused", len(details.get("refused") or [])),
        Figure("known_limit", len(details.get("known_limit") or [])),
    ]
    warm = details.get("warm_up_s") or {}
    if warm:
        out.append(Figure("warm_up", max(warm.values()), "s"))
    seen = (details.get("kv_sum") or {}).get("seen") or {}
    if kv_identity.EXTERNAL in seen:
        out.append(Figure("kv_external", seen[kv_identity.EXTERNAL], "tokens"))
    if rows:

        def kv(r: Mapping[str, Any], which: str) -> str:
            k = r.get("kv")
            if not k:
                return ""
            c = k[which]
            return "/".join(
                f"{c[s]:g}"
                for s in (kv_identity.EXTERNAL, kv_identity.LOCAL_CACHE_HIT, kv_identity.LOCAL_COMPUTE)
            )

        out.append(
            Table(
                "request features (KV: external/cache hit/compute)",
                ("case", "same", "outcome", "P/D s", "KV seen", "KV expected"),
                tuple(
                    (
                        r["name"],
                        r.get("same"),
                        "refused" if r.get("refused") else "answered",
                        (r.get("seconds") or {}).get("pd"),
                        kv(r, "seen"),
                        kv(r, "expected"),
                    )
                    for r in rows
                ),
            )
        )
    return out


@reporting(numbers)
def evaluate(
    cases: Sequence[Case],
    *,
    judge: parity.Judge,
    identity: str,
    expected_cases: Sequence[str] = (),
    warm_up_s: Mapping[str, float] | None = None,
) -> CheckResult:
    """Every case compared (:func:`compare`); the block-boundary rows summed against the identity.
    ``warm_up_s``: each instance's seconds for its warm-up request (:meth:`Asker.warm_up`),
    recorded and named in the verdict, never judged.

    no cases, or an expected case missing   -> fail
    any case with a problem                 -> fail, naming each case and its first problems
    refusals (clear 4xx)                    -> recorded in the message and details, not failed
    otherwise                               -> pass

    ``failed_shapes`` (details): the request shapes of the failing cases ("" none: "other"; "kv
    sum" for the summed accounting), what the known-issues registry reads (e.g. only "n>1").
    """
    rows = []
    bad: list[str] = []
    refused: list[str] = []
    shapes: set[str] = set()
    for c in cases:
        problems, note = compare(c, judge)
        rows.append(_row(c, problems, note))
        if problems:
            shapes.add(failed_shape(c, problems))
            bad.append(
                f"{c.name}: {'; '.join(problems[:2])}"
                + (f" (+{len(problems) - 2})" if len(problems) > 2 else "")
            )
        if note:
            refused.append(f"{c.name}: {note}")
    kv_rows = [c.kv for c in cases if c.kv is not None]
    seen = sum((r.seen for r in kv_rows), Counts())
    want = sum((r.want for r in kv_rows), Counts())
    details: dict[str, Any] = {
        "mode": judge.mode,
        "mode_reason": judge.why,
        "logprob_tolerance": LOGPROB_TOL if judge.mode == "exact" else judge.margin,
        "identity": identity,
        "cases": rows,
        "refused": refused,
        "known_limit": [c.name for c in cases if c.limit is not None],
        "failed_shapes": sorted(shapes),
        "kv_sum": {"seen": seen.as_dict(), "expected": want.as_dict()},
        "warm_up_s": dict(warm_up_s or {}),
    }
    missing = [n for n in expected_cases if n not in {c.name for c in cases}]
    if not cases or missing:
        return CheckResult("request_features", FAIL, f"cases not run: {', '.join(missing) or 'all'}", details)
    summed = kv_identity.mismatches(seen, want)
    if kv_rows and summed:
        bad.append(f"KV accounting summed over {len(kv_rows)} requests: {'; '.join(summed)}")
        details["failed_shapes"] = sorted({*shapes, "kv sum"})
    if bad:
        return CheckResult(
            "request_features",
            FAIL,
            f"{len(bad)} of {len(cases)} request features differ: " + " | ".join(bad),
            details,
        )
    how = f"within {judge.margin:g} nats (margin mode: {judge.why})"
    how = "token for token" if judge.mode == "exact" else how
    msg = (
        f"{len(cases) - len(refused)}/{len(cases)} request features through the router equal "
        f"prefill-direct {how}; KV per request exact ({seen} over {len(kv_rows)} block-boundary "
        f"requests; {identity})"
    )
    if refused:
        msg += f"; refused clearly: {'; '.join(refused)}"
    if warm_up_s:
        msg += (
            f"; warmed first with one logprobs request per instance at once (vLLM compiles "
            f"batched_count_greater_than on an engine's first: {_seconds(warm_up_s)})"
        )
    return CheckResult("request_features", PASS, msg, details)


def _seconds(by_name: Mapping[str, float]) -> str:
    return ", ".join(f"{n} {s:.1f} s" for n, s in by_name.items())


def _row(c: Case, problems: Sequence[str], note: str | None) -> dict[str, Any]:
    def side(a: Answer) -> dict[str, Any]:
        return {
            "status": a.status,
            "error": a.error,
            "texts": [ch.text for ch in a.choices],
            "token_ids": [list(ch.token_ids or ()) for ch in a.choices],
            "finish_reasons": [ch.finish_reason for ch in a.choices],
            "usage": [a.prompt_tokens, a.completion_tokens],
        }

    row: dict[str, Any] = {
        "name": c.name,
        "same": not problems,
        "problems": list(problems),
        "refused": note,
        "known_limit": c.limit,
        "tries": list(c.tries),
        "earlier_answers_compared": len(c.earlier),
        "pd": side(c.pd),
        "direct": side(c.direct),
        "seconds": {k: round(v, 3) for k, v in (c.seconds or {}).items()},
    }
    if c.kv is not None:
        row["kv"] = {
            "prompt_tokens": c.kv.prompt_tokens,
            "cached": c.kv.cached,
            "seen": c.kv.seen.as_dict(),
            "expected": c.kv.want.as_dict(),
        }
    return row


# ---------------------------------------------------------------- the requests


PROMPT = "Seven plus five equals twelve, and the quick brown fox jumps over"
# The first-token cases need a first token whose text is not empty (a stop string cannot be
# empty, and a token that is only part of a character decodes to ""): the first of these whose
# greedy first token has text is the features' prompt.
PROMPTS = (
    PROMPT,
    "Question: how many apples are left if each of the ten birds takes one? Answer:",
    "The red stone sits under the old tree near the river, and",
    "One two three four five six seven eight nine",
)
CHAT = ({"role": "user", "content": "How many apples are left if each of the ten birds takes one?"},)
COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"
# Leads of the block-boundary prompts: each its own first block, so no prompt finds another's
# blocks in the decode's prefix cache (only the repeat does, by design).
BLOCK_LEADS = ("Alpha stones:", "Beta rivers:", "Gamma clouds:", "Delta tables:", "Epsilon horses:")
BLOCK_WORDS = " apple river stone cloud green table seven north light paper horse water"


@dataclass(frozen=True)
class Feature:
    """One request shape: its endpoint, its fields (model added), and how it is judged."""

    name: str
    payload: dict[str, Any]
    path: str = COMPLETIONS
    sampled: bool = False
    one_token: str | None = None
    echo: bool = False
    shape: str = ""  # what a connector may not serve (the connector spec's limits.unserved_requests)

    @property
    def streamed(self) -> bool:
        return bool(self.payload.get("stream"))


def features(prompt: str, first_text: str, first_id: int) -> list[Feature]:
    """The feature requests after ``max_tokens=1`` of ``prompt`` (whose token,
    ``first_text``/``first_id``, the stop cases stop at)."""
    greedy = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    seeded = {**greedy, "temperature": 1.0, "seed": SEED, "logprobs": 1}
    return [
        Feature("stop string at the first token", {**greedy, "stop": [first_text]}, one_token="stop"),
        Feature("stop token at the first token", {**greedy, "stop_token_ids": [first_id]}, one_token="stop"),
        # vLLM 0.32 refuses n > 1 at temperature 0 ("n must be 1 when using greedy sampling"):
        # the router must pass that refusal on; greedy with n = 2 is top_k = 1
        Feature("n=2 at temperature 0", {**greedy, "n": 2}),
        Feature("n=2 greedy (top_k=1)", {**greedy, "n": 2, "temperature": 1.0, "top_k": 1}, shape="n>1"),
        Feature("n=2 seeded", {**seeded, "n": 2}, sampled=True, shape="n>1"),
        Feature("seeded sampling", {**seeded, "top_p": 0.9}, sampled=True),
        Feature("logprobs", {**greedy, "logprobs": 2}),
        Feature(
            "streaming with include_usage",
            {**greedy, "stream": True, "stream_options": {"include_usage": True}},
        ),
        # with return_token_ids vLLM leaves the prompt out of an echo's text (serving.py): ask
        # without them, as a user does
        Feature("echo", {**greedy, "echo": True, "return_token_ids": False}, echo=True),
        Feature(
            "chat",
            {"messages": list(CHAT), "max_tokens": MAX_TOKENS, "temperature": 0.0},
            path=CHAT_COMPLETIONS,
        ),
    ]


def first(prompt: str) -> Feature:
    return Feature(
        "max_tokens=1", {"prompt": prompt, "max_tokens": 1, "temperature": 0.0}, one_token="length"
    )


def block_lengths(block: int) -> list[tuple[str, int]]:
    """(name, prompt tokens) of the block-boundary prompts: B-1, B, B+1, 2B, 4B+2."""
    return [
        (f"prompt of B-1 = {block - 1} tokens", block - 1),
        (f"prompt of B = {block} tokens", block),
        (f"prompt of B+1 = {block + 1} tokens", block + 1),
        (f"prompt of 2B = {2 * block} tokens", 2 * block),
        (f"prompt of 4B+2 = {4 * block + 2} tokens", 4 * block + 2),
    ]


def expected_cases(block: int) -> list[str]:
    names = [first(PROMPT).name, *(f.name for f in features(PROMPT, "x", 0))]
    names += [n for n, _ in block_lengths(block)]
    return [*names, f"the {4 * block + 2}-token prompt again (decode cache hit)"]


@dataclass(frozen=True)
class Timed:
    """An answer and the seconds it took."""

    answer: Answer
    seconds: float


WARM_PROMPT = "Warm up:"
# Requests in flight at once in the features stage (P/D and prefill-direct sides together): the
# burst check sends 32 through the router; this stays well under it.
WORKERS = 8


class Asker:
    """Sends the check's requests: through the router, straight to prefill-0, and (margin mode)
    prefill-0's scores of the P/D tokens. An HTTP error status is an answer (a refusal), not an
    exception; a timeout or a refused connection is raised (http.HttpError). Thread-safe: every
    call stands alone (the check sends independent requests at once)."""

    def __init__(self, window: CheckWindow, judge: parity.Judge):
        self.plan = window.plan
        self.model = window.plan.served_model_name
        self.timeout = window.timeout_s
        self.judge = judge
        self.p0 = window.plan.prefill[0]
        self.connector, self.ssm = window.plan.config.connector, window.plan.config.hybrid

    def ask(self, url: str, f: Feature, timeout: float | None = None) -> Answer:
        payload = {"model": self.model, "return_token_ids": True, **f.payload}
        chat = f.path == CHAT_COMPLETIONS
        try:
            _, body = http.request(f"{url}{f.path}", payload=payload, timeout=timeout or self.timeout)
        except http.HttpError as e:
            if e.status is None:
                raise
            return Answer.refused(e.status, e.reason.split(": ", 1)[-1])
        text = body.decode("utf-8", errors="replace")
        if f.streamed:
            return Answer.from_stream(text, chat=chat)
        return Answer.from_response(json.loads(text), chat=chat)

    def timed(self, url: str, f: Feature) -> Timed:
        t0 = time.monotonic()
        a = self.ask(url, f)
        return Timed(a, time.monotonic() - t0)

    def routed(self, f: Feature) -> Timed:
        """``f`` through the router, timed."""
        return self.timed(self.plan.router.url, f)

    def routed_within(self, f: Feature, deadline_s: float) -> Timed:
        """``f`` through the router with a short client deadline (a known limit's request): no
        answer in time is an answer of status 0 saying so, not an exception (the path is not
        stuck for the checks after it: the request ends when the client leaves)."""
        t0 = time.monotonic()
        try:
            a = self.ask(self.plan.router.url, f, timeout=deadline_s)
        except http.HttpError as e:
            seconds = time.monotonic() - t0
            why = "timed out" if seconds >= deadline_s * 0.9 else e.reason
            return Timed(
                Answer(status=0, error=f"unanswered in its {deadline_s:g} s deadline ({why})"), seconds
            )
        return Timed(a, time.monotonic() - t0)

    def direct(self, f: Feature) -> Timed:
        """``f`` straight to prefill-0, timed."""
        return self.timed(self.p0.url, f)

    def forced(self, pd: Answer, f: Feature) -> tuple[tuple[parity.ForcedToken, ...], ...] | None:
        """Margin mode: each P/D choice's tokens scored by prefill-0 (None in exact mode or when
        the P/D side did not answer)."""
        if self.judge.mode != "margin" or not pd.ok or f.echo:
            return None
        out = []
        for c in pd.choices:
            ids = list(c.token_ids or ())
            prompt_ids = list(pd.prompt_token_ids or ())
            if not prompt_ids or not ids:
                raise ValueError(f"{f.name}: the P/D answer carries no prompt_token_ids/token_ids to score")
            resp = http.post_json(
                f"{self.p0.url}{COMPLETIONS}",
                parity.teacher_force_payload(self.model, prompt_ids, ids),
                timeout=self.timeout,
            )
            out.append(tuple(parity.forced_tokens(resp, len(prompt_ids), ids)))
        return tuple(out)

    def first_token_prompt(self) -> tuple[str, Timed]:
        """The first of PROMPTS whose greedy first token (prefill-0 direct) has text, with that
        answer (the direct side of its ``max_tokens=1`` case)."""
        for p in PROMPTS:
            a = self.direct(first(p))
            if a.answer.ok and a.answer.choices and a.answer.choices[0].text.strip():
                return p, a
        return PROMPT, self.direct(first(PROMPT))

    def warm_up(self) -> dict[str, float]:
        """One greedy request with ``logprobs`` straight to every prefill and decode instance at
        once; instance name -> its seconds.

        Why: vLLM compiles ``batched_count_greater_than`` (``vllm/v1/sample/ops/logprobs.py``,
        ``@torch.compile`` with the platform's inductor backend; ``Sampler.gather_logprobs``
        calls it) on an engine's first request that asks for logprobs, whatever
        ``--enforce-eager`` says, the engine answering nothing meanwhile. On the CPU lane, before
        its instances ran with ``TORCHDYNAMO_DISABLE=1`` (core/plan/instance.py), that took 3.1 s
        on prefill-0 and 3.5 s on decode-0 (vLLM 0.32.0, 2026-12-02), and the first P/D request
        with logprobs paid both, one after the other (a 2-choice seeded request took 6.3 s, then
        0.2 s once warm). Sent at once, the compiles overlap where the engines have cores of
        their own; the time is recorded in the details and named in the verdict. The prompt is
        shorter than a block, so no prefix cache keeps any of it."""
        f = Feature("warm-up", {"prompt": WARM_PROMPT, "max_tokens": 1, "temperature": 0.0, "logprobs": 1})
        specs = (*self.plan.prefill, *self.plan.decode)
        with ThreadPoolExecutor(max_workers=len(specs)) as pool:
            sent = [(s.name, pool.submit(self.timed, s.url, f)) for s in specs]
            return {name: round(fut.result().seconds, 3) for name, fut in sent}


@contextmanager
def requests_pool() -> Iterator[ThreadPoolExecutor]:
    """The pool the check's requests share. When one fails (a timeout: a stuck path), the requests
    not yet started are dropped, so the failure comes after about one request timeout, as when
    they went one at a time; those in flight end with their own timeouts."""
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        try:
            yield pool
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def case_of(
    asker: Asker, f: Feature, pd: Timed, direct: Timed, kv: KvRow | None = None, limit: str | None = None
) -> Case:
    """The case of ``f`` from its two sides (scored by prefill-0 in margin mode)."""
    return Case(
        f.name,
        pd.answer,
        direct.answer,
        shape=f.shape,
        limit=limit,
        sampled=f.sampled,
        one_token=f.one_token,
        streamed=f.streamed,
        echo_prompt=f.payload.get("prompt") if f.echo else None,
        forced=asker.forced(pd.answer, f),
        kv=kv,
        seconds={"pd": pd.seconds, "direct": direct.seconds},
    )


def limited(asker: Asker, feats: Sequence[Feature]) -> list[Feature]:
    """The features the connector is known not to serve (its spec's limits.unserved_requests)."""
    return [f for f in feats if connector_support.unserved_request(asker.connector, f.shape) is not None]


def feature_cases(
    asker: Asker, pool: ThreadPoolExecutor, feats: Sequence[Feature], known: Mapping[str, Timed]
) -> list[Case]:
    """Every feature's P/D and prefill-direct sides sent at once (``known``: direct sides already
    answered), except those the connector is known not to serve (:func:`limit_cases` sends them
    last). They are independent: no KV counter is read around them."""
    sent: dict[str, tuple[Future[Timed], Future[Timed] | Timed]] = {}
    skip = limited(asker, feats)
    for f in feats:
        if f not in skip:
            direct = known.get(f.name) or pool.submit(asker.direct, f)
            sent[f.name] = (pool.submit(asker.routed, f), direct)
    cases = []
    for f in feats:
        if f.name in sent:
            pd, direct = sent[f.name]
            cases.append(
                case_of(asker, f, pd.result(), direct if isinstance(direct, Timed) else direct.result())
            )
    return cases


def limit_cases(
    asker: Asker,
    pool: ThreadPoolExecutor,
    feats: Sequence[Feature],
    *,
    deadline_s: float,
    drain_s: float,
    attempts: int = 1,
) -> tuple[list[Case], float | None]:
    """The features the connector is known not to serve, sent last, at once, each through the router
    with ``deadline_s``, up to ``attempts`` times (:func:`tried`); then up to ``drain_s`` for the
    decodes to hold no request again. (cases, seconds until drained: None when nothing was sent
    or they still held one)."""
    todo = limited(asker, feats)
    if not todo:
        return [], None
    sent = [
        (f, pool.submit(tried, asker, f, deadline_s, attempts), pool.submit(asker.direct, f)) for f in todo
    ]
    cases = []
    for f, pd, direct in sent:
        limit = connector_support.unserved_request(asker.connector, f.shape)
        (g, last), tries, answered = pd.result()
        first = direct.result()
        earlier = tuple(
            case_of(asker, h, t, first if h is f else asker.direct(h)) for h, t in answered if t is not last
        )
        ref = first if g is f or last.answer.status == 0 else asker.direct(g)
        cases.append(replace(case_of(asker, g, last, ref, limit=limit), tries=tries, earlier=earlier))
    return cases, drained(asker.plan, drain_s)


def tried(
    asker: Asker, f: Feature, deadline_s: float, attempts: int
) -> tuple[tuple[Feature, Timed], tuple[float, ...], list[tuple[Feature, Timed]]]:
    """A known limit's request through the router, then again with a new prompt each time (its
    number appended) until one is not answered with 200 or ``attempts`` were: (the one that was
    not 200, else the first, with its feature; every attempt's seconds; the attempts answered
    with 200, each with its feature). The limit seen over Mooncake is intermittent (1 of 8 seeded n=2 requests
    waited past 20 s on 2026-12-05), so one request alone would often pass and read as fixed;
    every answered attempt is compared with prefill-direct (:func:`limit_cases`), so a wrong
    200 before the hang fails."""
    g, t = f, asker.routed_within(f, deadline_s)
    answered: list[tuple[Feature, Timed]] = []
    tries = [t.seconds]
    while t.answer.ok:
        answered.append((g, t))
        if len(tries) >= attempts:
            return answered[0], tuple(round(s, 3) for s in tries), answered
        g = replace(f, payload={**f.payload, "prompt": f"{f.payload['prompt']} ({len(tries)})"})
        t = asker.routed_within(g, deadline_s)
        tries.append(t.seconds)
    return (g, t), tuple(round(s, 3) for s in tries), answered


def drained(plan: Any, bound_s: float) -> float | None:
    """Seconds until every decode reports no running or waiting request, or None after ``bound_s``."""
    t0 = time.monotonic()
    while True:
        held = 0.0
        for d in plan.decode:
            g = instances.gauges(http.get_text(f"{d.url}/metrics"), (instances.RUNNING, instances.WAITING))
            held += sum(g.values())
        if held == 0:
            return round(time.monotonic() - t0, 3)
        if time.monotonic() - t0 >= bound_s:
            return None
        time.sleep(0.5)


def block_prompts(asker: Asker, block: int) -> list[tuple[str, list[int]]]:
    """Token-id prompts of exactly the block-boundary lengths, each from its own lead text (so
    the lengths do not depend on how a tokenizer merges words)."""
    out = []
    for (name, n), lead in zip(block_lengths(block), BLOCK_LEADS, strict=True):
        text = lead
        ids: tuple[int, ...] = ()
        while len(ids) < n:
            text += BLOCK_WORDS * max(1, (n - len(ids)) // 8)
            ids = instances.tokenize(asker.p0.url, asker.model, text).tokens
        out.append((name, list(ids[:n])))
    return out


def settle(plan: Any, before: Mapping[str, Counts], prompt_tokens: int) -> dict[str, Counts]:
    """Each decode's prompt tokens by source since ``before``, waited for until they count the
    request (at most KV_SETTLE_S: vLLM records them with its first token, before the answer)."""
    end = time.monotonic() + KV_SETTLE_S
    while True:
        after = instances.scrape_decode_counts(plan)
        deltas = {n: after[n] - b for n, b in before.items()}
        if sum(d.total for d in deltas.values()) >= prompt_tokens or time.monotonic() >= end:
            return deltas
        time.sleep(KV_POLL_S)


def block_cases(
    asker: Asker, pool: ThreadPoolExecutor, block: int, prompts: Sequence[tuple[str, list[int]]]
) -> list[Case]:
    """The block-boundary prompts through the router one at a time, nothing else in flight
    through the decodes, each with the decodes' counters around it, then the 4B+2 one again:
    the decode that served it holds 4B of its tokens (another decode, in a 1PnD config, holds
    none). Each prefill-direct side is sent once its P/D side has answered (it reaches prefill-0
    only, so no decode counter sees it), while the next P/D request runs."""
    plan = asker.plan
    prompts = [*prompts, (f"the {4 * block + 2}-token prompt again (decode cache hit)", prompts[-1][1])]
    holder = None  # the decode that served the first 4B+2 prompt
    # with --no-enable-prefix-caching on the decodes the repeat is no cache hit: 0 cached expected
    decode_caches = kv_identity.prefix_caching([*plan.config.extra_args, *plan.config.decode_extra_args])
    sent: list[tuple[Feature, Timed, Future[Timed], KvRow | None]] = []
    for i, (name, ids) in enumerate(prompts):
        f = Feature(name, {"prompt": ids, "max_tokens": BLOCK_MAX_TOKENS, "temperature": 0.0})
        before = instances.scrape_decode_counts(plan)
        pd = asker.routed(f)
        row = None
        if pd.answer.ok:
            deltas = settle(plan, before, len(ids))
            who = max(deltas, key=lambda n: deltas[n].total)
            repeat = i == len(prompts) - 1
            caches = repeat and who == holder and decode_caches
            cached = kv_identity.cached_after_full_prompt(len(ids), block) if caches else 0
            holder = who if i == len(prompts) - 2 else holder
            want = kv_identity.expected(asker.connector, ssm=asker.ssm, prompt_tokens=len(ids), cached=cached)
            row = KvRow(len(ids), cached, sum(deltas.values(), Counts()), want)
        sent.append((f, pd, pool.submit(asker.direct, f), row))
    return [case_of(asker, f, pd, direct.result(), row) for f, pd, direct, row in sent]


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    """Every engine warmed for logprobs at once (:meth:`Asker.warm_up`, the block prompts
    tokenized meanwhile); the features' P/D and prefill-direct sides all at once (scored by
    prefill-0 in margin mode); then the block-boundary prompts one at a time with the decodes'
    counters around each."""
    plan = window.plan
    judge = parity.Judge.for_config(plan.config)
    asker = Asker(window, judge)
    block = instances.block_size(plan)
    connector, ssm = plan.config.connector, plan.config.hybrid
    try:
        with requests_pool() as pool:
            warming = pool.submit(asker.warm_up)
            prompts = block_prompts(asker, block)  # /tokenize: the API servers only, not the engines
            warm = warming.result()
            prompt, one_direct = asker.first_token_prompt()
            c0 = one_direct.answer.choices[0] if one_direct.answer.ok and one_direct.answer.choices else None
            if c0 is None:
                raise ValueError(f"max_tokens=1 was not answered by prefill-0: {one_direct.answer.error!r}")
            feats = [first(prompt), *features(prompt, c0.text, (c0.token_ids or (0,))[0])]
            cases = feature_cases(asker, pool, feats, {feats[0].name: one_direct})
            cases += block_cases(asker, pool, block, prompts)
            more, drain_s = limit_cases(
                asker,
                pool,
                feats,
                deadline_s=float(options.get("limit_deadline_s", LIMIT_DEADLINE_S)),
                drain_s=float(options.get("limit_drain_s", LIMIT_DRAIN_S)),
                attempts=int(options.get("limit_attempts", LIMIT_ATTEMPTS)),
            )
    except ValueError as e:  # an answer that is not what its endpoint promises (not JSON, no ids)
        return CheckResult("request_features", FAIL, f"could not run: {e}")
    r = evaluate(
        [*cases, *more],
        judge=judge,
        identity=kv_identity.describe(connector, ssm=ssm),
        expected_cases=expected_cases(block),
        warm_up_s=warm,
    )
    if more:
        r.details["known_limit_drained_s"] = drain_s  # None: a decode still held a request
    return r
