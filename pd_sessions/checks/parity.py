"""Greedy parity of P/D output against a reference instance, aware of numeric layouts.

The reference is prefill-0 served directly (no disaggregation). Two modes:

- exact: the P/D completion must equal the reference's own greedy completion token for
  token. Right when prefill and decode compute with the same numeric layout (same TP, no
  DP/EP difference, same dtype): then any difference is a bug.
- margin: the P/D tokens are teacher-forced through the reference (one request whose
  prompt is the prompt's token ids followed by the P/D token ids, with vLLM's
  ``prompt_logprobs``), and every P/D token must be the reference's top-1 at its position
  or within ``margin`` nats of it. Right when the layouts differ: on an H200, bf16 prefill
  TP2 + decode DP2/EP produced what a TP1 instance produces, and the TP2 reference
  differed from it at near-tied tokens, repeatably, with nothing broken. A token the
  reference ranks clearly below its top-1 (lost or corrupted KV, other weights) still fails.

Pure parts: :func:`choose_mode`, :func:`forced_tokens`, :func:`evaluate_exact`,
:func:`evaluate_margin`, :func:`judge`. :func:`teacher_force` and :func:`reference` are the
requests; :func:`run` is the check's gatherer. Other checks that compare P/D outputs with a
direct instance (cache_paths, burst) use :class:`Judge`, :func:`reference` and :func:`judge`,
so they follow the same mode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pd_sessions.checks import instances
from pd_sessions.checks.completions import MAX_TOKENS, Completion
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting
from pd_sessions.runtime import http

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

# Default margin in nats (logprob of the reference's top-1 minus that of the P/D token).
# Results record the margin, this evidence and the largest gap each run saw.
DEFAULT_MARGIN = 1.0
DEFAULT_MARGIN_EVIDENCE = (
    "measured 2026-11-29 with HF transformers on CPU, bf16, the 4 parity prompts and 16 greedy tokens "
    "each, teacher-forced: a TP2-style layout (every row-parallel matmul split in two summed halves) "
    "moved the logprob of the chosen or top-1 token by up to 0.33 nats on the tiny Mixtral (median "
    "0.015; MoE routing flips) and 0.017 on the tiny Llama; a flipped token's gap is at most the sum "
    "of two such moves (0.65), and the one flip seen was 0.016. 1.0 nat covers that with room; tokens "
    "a model does not choose sit nats below its top-1: a CPU-lane decode with other weights (vLLM 0.32, "
    "tiny Llama) diverged at position 0 of every prompt by 2.5 to 4.1 nats. Tighten when GPU runs' "
    "recorded max_gap allow"
)


@dataclass(frozen=True)
class Layout:
    """What decides the numbers an instance computes."""

    tp: int
    dp: int
    ep: bool
    dtype: str

    def __str__(self) -> str:
        return (
            f"TP{self.tp}"
            + (f" DP{self.dp}" if self.dp > 1 else "")
            + (" EP" if self.ep else "")
            + f" {self.dtype}"
        )


def layouts(config: Any) -> tuple[Layout, Layout]:
    """(reference = prefill-0's layout, decode's layout) of a ClusterConfig."""
    dtype = config.dtype or "auto"
    return (
        Layout(config.prefill_tp, 1, False, dtype),
        Layout(config.decode_tp, config.decode_dp, bool(config.expert_parallel), dtype),
    )


def choose_mode(config: Any) -> tuple[str, str]:
    """(mode, why) for a ClusterConfig.

    parity_mode = "exact"      -> exact  (forced by the config)
    parity_mode = "margin"     -> margin (forced by the config)
    auto, same layout          -> exact  (same TP, DP, EP and dtype on both sides)
    auto, layouts differ       -> margin (rounding of another layout may flip near-ties)
    """
    mode = getattr(config, "parity_mode", "auto")
    ref, dec = layouts(config)
    if mode in ("exact", "margin"):
        return mode, f"parity_mode = {mode!r} in the config (reference {ref}, decode {dec})"
    if ref == dec:
        return "exact", f"reference (prefill-0) and decode share one numeric layout ({ref})"
    return "margin", (
        f"numeric layouts differ: reference (prefill-0) {ref} vs decode {dec}; rounding "
        "may flip near-tied tokens without anything being broken"
    )


# ---------------------------------------------------------------- exact


def _first_diff(a: Sequence[Any], b: Sequence[Any]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # lengths may differ
        if x != y:
            return i
    return min(len(a), len(b))


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the mode, the prompts compared and, in margin mode, the tokens,
    near-ties and the largest gap against the margin; a row per prompt."""
    prompts = details.get("prompts") or []
    out: list[Figure | Table] = [
        *pick(details, ("mode", "")),
        Figure("prompts", len(prompts)),
        Figure("prompts_same", sum(1 for p in prompts if p.get("same"))),
        *pick(details, ("tokens", "tokens"), ("near_ties", ""), ("max_gap", "nats"), ("margin", "nats")),
    ]
    if prompts:
        margin = details.get("mode") == "margin"
        out.append(
            Table(
                "prompts",
                ("prompt", "same", *(("tokens", "max gap (nats)") if margin else ())),
                tuple(
                    (p.get("prompt"), p.get("same"), *((p.get("tokens"), p.get("max_gap")) if margin else ()))
                    for p in prompts
                ),
            )
        )
    return out


@reporting(numbers)
def evaluate_exact(
    pairs: Sequence[tuple[str, Completion, Completion]], *, baseline: str, why: str = ""
) -> CheckResult:
    """Token-for-token equality of (prompt, P/D completion, baseline completion) pairs.

    Compares token ids when both sides have them, else text; and the finish_reason (where the
    reference gives one): an answer with the reference's tokens that ended otherwise ("error",
    none) is not the same answer.
    A truncated answer (fewer tokens) differs at the token where it ends; an empty one at 0.
    """
    if not pairs:
        return CheckResult("parity", FAIL, "no prompts were compared", {"mode": "exact", "mode_reason": why})
    mismatches = []
    rows = []
    for prompt, pd, base in pairs:
        use_ids = pd.token_ids is not None and base.token_ids is not None
        a = pd.token_ids if use_ids else pd.text
        b = base.token_ids if use_ids else base.text
        # a reference that says no finish_reason (a server without it) is not compared on it
        same_finish = base.finish_reason is None or pd.finish_reason == base.finish_reason
        same = a == b and len(a or ()) > 0 and same_finish
        rows.append(
            {
                "prompt": prompt[:60],
                "same": same,
                "pd_text": pd.text,
                "baseline_text": base.text,
                "pd_token_ids": list(pd.token_ids or ()),
                "baseline_token_ids": list(base.token_ids or ()),
                "finish_reason": pd.finish_reason,
                "baseline_finish_reason": base.finish_reason,
            }
        )
        if not same:
            at = _first_diff(a or (), b or ())
            ended = (
                ""
                if same_finish
                else f"; finish_reason {pd.finish_reason!r} vs {baseline} {base.finish_reason!r}"
            )
            unit = "token" if use_ids else "char"
            mismatches.append(
                f"prompt {prompt[:40]!r}: differ at {unit} {at} ({len(a or ())} vs {len(b or ())} "
                f"{unit}s; P/D {pd.text!r} vs {baseline} {base.text!r}{ended})"
            )
    details = {"mode": "exact", "mode_reason": why, "baseline": baseline, "prompts": rows}
    if mismatches:
        return CheckResult(
            "parity",
            FAIL,
            f"{len(mismatches)}/{len(pairs)} prompts differ: " + "; ".join(mismatches),
            details,
        )
    return CheckResult(
        "parity",
        PASS,
        f"{len(pairs)}/{len(pairs)} prompts identical token for token "
        f"(P/D via router vs {baseline}; exact mode: {why})",
        details,
    )


# ---------------------------------------------------------------- margin


@dataclass(frozen=True)
class ForcedToken:
    """One P/D token as the reference scored it when teacher-forced."""

    position: int  # index in the P/D completion
    token: int
    logprob: float
    rank: int
    text: str
    top_token: int
    top_logprob: float
    top_text: str

    @property
    def gap(self) -> float:
        return self.top_logprob - self.logprob


def teacher_force_payload(model: str, prompt_ids: Sequence[int], pd_ids: Sequence[int]) -> dict[str, Any]:
    """The /v1/completions request that scores ``pd_ids`` after ``prompt_ids`` on the reference
    (vLLM's ``prompt_logprobs`` extension: the forced token and the top-1 at every position)."""
    return {
        "model": model,
        "prompt": [*prompt_ids, *pd_ids],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 1,
    }


def forced_tokens(resp: Mapping[str, Any], n_prompt: int, pd_ids: Sequence[int]) -> list[ForcedToken]:
    """Read the reference's scores of ``pd_ids`` (which follow ``n_prompt`` prompt tokens) from a
    response to :func:`teacher_force_payload`. Raises ValueError when the response lacks them."""
    choice = (resp.get("choices") or [{}])[0]
    plp = choice.get("prompt_logprobs")
    if not isinstance(plp, list) or len(plp) < n_prompt + len(pd_ids):
        raise ValueError(
            f"reference returned no prompt_logprobs for {n_prompt + len(pd_ids)} tokens "
            f"(got {type(plp).__name__} of {len(plp) if isinstance(plp, list) else 0})"
        )
    out = []
    for j, tok in enumerate(pd_ids):
        entry = plp[n_prompt + j] or {}
        scored = {int(k): v for k, v in entry.items()}
        if tok not in scored:
            raise ValueError(f"prompt_logprobs at position {n_prompt + j} lack the forced token {tok}")
        top_id, top = min(scored.items(), key=lambda kv: (kv[1].get("rank") or 10**9, -kv[1]["logprob"]))
        own = scored[tok]
        out.append(
            ForcedToken(
                position=j,
                token=tok,
                logprob=float(own["logprob"]),
                rank=int(own.get("rank") or 0),
                text=str(own.get("decoded_token", "")),
                top_token=top_id,
                top_logprob=float(top["logprob"]),
                top_text=str(top.get("decoded_token", "")),
            )
        )
    return out


@reporting(numbers)
def evaluate_margin(
    rows: Sequence[tuple[str, Sequence[ForcedToken]]],
    *,
    margin: float,
    baseline: str,
    why: str = "",
    margin_evidence: str = "",
    want_tokens: int | None = None,
    finish_reasons: Sequence[str | None] = (),
) -> CheckResult:
    """Every P/D token must be the reference's top-1 or within ``margin`` nats of it, and each
    answer as long as exact mode's reference would be: every request here asks ``want_tokens``
    with ``ignore_eos``, so that reference has ``want_tokens`` tokens and finish_reason "length"
    (a truncated answer whose few tokens are top-1 is not the same answer).

    no prompts, or a prompt with no P/D tokens  -> fail
    a prompt with another token count than ``want_tokens``, or (``finish_reasons`` given) another
    finish_reason than "length"                 -> fail, naming both
    any token with gap > margin                 -> fail, naming prompt, position, both
                                                   tokens and their logprobs (first per prompt)
    otherwise                                   -> pass; near-ties (0 < gap <= margin) counted
    """
    details: dict[str, Any] = {
        "mode": "margin",
        "mode_reason": why,
        "margin": margin,
        "margin_evidence": margin_evidence,
        "baseline": baseline,
        "prompts": [],
    }
    if not rows:
        return CheckResult("parity", FAIL, "no prompts were compared", details)
    failures, near, total, max_gap = [], 0, 0, 0.0
    for i, (prompt, toks) in enumerate(rows):
        near += sum(1 for t in toks if t.token != t.top_token and t.gap <= margin)
        total += len(toks)
        max_gap = max([max_gap, *(max(t.gap, 0.0) for t in toks)])
        row, failure = margin_row(prompt, toks, margin)
        finish = finish_reasons[i] if i < len(finish_reasons) else None
        short = length_problem(len(toks), finish, want_tokens, checked_finish=i < len(finish_reasons))
        if short and toks:
            row["same"], failure = (
                False,
                f"prompt {prompt[:40]!r}: {short}" + (f"; {failure}" if failure else ""),
            )
        details["prompts"].append({**row, "finish_reason": finish})
        if failure:
            failures.append(failure)
    details.update(tokens=total, near_ties=near, max_gap=max_gap)
    if failures:
        return CheckResult(
            "parity",
            FAIL,
            f"{len(failures)}/{len(rows)} prompts diverge from {baseline} beyond "
            f"the margin: " + "; ".join(failures),
            details,
        )
    return CheckResult(
        "parity",
        PASS,
        f"{len(rows)}/{len(rows)} prompts: all {total} P/D tokens are {baseline}'s "
        f"top-1 or within {margin:g} nats of it ({near} near-ties, largest gap {max_gap:.4f}; "
        f"margin mode: {why})",
        details,
    )


def length_problem(got: int, finish: str | None, want: int | None, *, checked_finish: bool) -> str | None:
    """Why a margin-mode answer is not as long as exact mode's reference would be (None: it is):
    ``want`` tokens (None: not checked) and, when ``checked_finish``, finish_reason "length"."""
    if want is not None and got != want:
        return (
            f"the P/D answer has {got} of the {want} tokens asked with ignore_eos (finish_reason "
            f"{finish!r}); exact mode's reference would have {want}, finish 'length'"
        )
    if checked_finish and finish != "length":
        return f"the P/D answer ended with finish_reason {finish!r}, not 'length' as the reference would"
    return None


def margin_row(prompt: str, toks: Sequence[ForcedToken], margin: float) -> tuple[dict[str, Any], str | None]:
    """One prompt in margin mode: its details (every token that is not the reference's top-1) and
    why it fails (no P/D tokens, or the first token beyond ``margin``; None when it passes)."""
    beyond = [t for t in toks if t.gap > margin]
    row = {
        "prompt": prompt[:60],
        "tokens": len(toks),
        "max_gap": max((max(t.gap, 0.0) for t in toks), default=None),
        "not_top1": [
            {
                "position": t.position,
                "pd_token": t.token,
                "pd_text": t.text,
                "pd_logprob": t.logprob,
                "pd_rank": t.rank,
                "ref_token": t.top_token,
                "ref_text": t.top_text,
                "ref_logprob": t.top_logprob,
                "gap": t.gap,
            }
            for t in toks
            if t.token != t.top_token
        ],
        "same": not beyond and bool(toks),
    }
    if not toks:
        return row, f"prompt {prompt[:40]!r}: the P/D completion had no tokens"
    if beyond:
        t = beyond[0]
        return row, (
            f"prompt {prompt[:40]!r} position {t.position}: P/D token {t.token} {t.text!r} "
            f"(logprob {t.logprob:.4f}, rank {t.rank}) vs reference top-1 {t.top_token} "
            f"{t.top_text!r} (logprob {t.top_logprob:.4f}): gap {t.gap:.4f} > margin {margin:g}"
            + (f" (+{len(beyond) - 1} more beyond the margin)" if len(beyond) > 1 else "")
        )
    return row, None


# ---------------------------------------------------------------- shared by other checks


@dataclass(frozen=True)
class Judge:
    """How P/D outputs are compared with a direct instance in one config (see choose_mode)."""

    mode: str  # exact | margin
    why: str
    margin: float

    @classmethod
    def for_config(cls, config: Any) -> Judge:
        mode, why = choose_mode(config)
        return cls(mode, why, float(getattr(config, "parity_margin", DEFAULT_MARGIN)))


# What a direct instance said about one prompt: its own greedy completion (exact mode) or its
# scores of the P/D tokens, teacher-forced (margin mode).
Reference = Completion | tuple[ForcedToken, ...]


def teacher_force(url: str, model: str, pd: Completion, *, timeout: float) -> tuple[ForcedToken, ...]:
    """Score ``pd``'s tokens on the instance at ``url``. Raises ValueError when ``pd`` lacks the
    token ids this needs or the answer lacks prompt_logprobs; http.HttpError on HTTP failure."""
    if pd.prompt_token_ids is None or pd.token_ids is None:
        raise ValueError(
            "the P/D answer carries no prompt_token_ids/token_ids (return_token_ids unsupported?)"
        )
    resp = http.post_json(
        f"{url}/v1/completions",
        teacher_force_payload(model, pd.prompt_token_ids, pd.token_ids),
        timeout=timeout,
    )
    return tuple(forced_tokens(resp, len(pd.prompt_token_ids), pd.token_ids))


def reference(
    j: Judge, url: str, model: str, prompt: str, pd: Completion, *, max_tokens: int, timeout: float
) -> Reference:
    """The direct instance's side of one comparison, in ``j``'s mode."""
    if j.mode == "margin":
        return teacher_force(url, model, pd, timeout=timeout)
    return Completion.from_response(
        http.completion(url, model, prompt, max_tokens=max_tokens, timeout=timeout)
    )


def prompt_tokens_sent(pd: Completion, ref: Reference) -> int:
    """Prompt tokens the reference request put on the direct instance (for per-instance counts)."""
    if isinstance(ref, Completion):
        return ref.prompt_tokens
    return len(pd.prompt_token_ids or ()) + len(pd.token_ids or ())


def judge(
    j: Judge, rows: Sequence[tuple[str, Completion, Reference]], *, baseline: str, max_tokens: int
) -> CheckResult:
    """evaluate_exact or evaluate_margin of (label, P/D completion, reference) rows, by ``j.mode``;
    each request asked ``max_tokens`` with ignore_eos (runtime/http.completion).

    exact  : every reference must be a Completion (the direct instance's own greedy output)
    margin : every reference must be the P/D tokens' forced scores (from :func:`reference`); each
             P/D answer must also have ``max_tokens`` tokens and finish_reason "length", as the
             reference exact mode would compare with does
    A reference of the other kind is a programming error (TypeError), not a verdict.
    """
    if j.mode == "margin":
        scored = []
        for label, _pd, ref in rows:
            if isinstance(ref, Completion):
                raise TypeError(f"{label}: margin mode needs forced scores, got a Completion")
            scored.append((label, ref))
        return evaluate_margin(
            scored,
            margin=j.margin,
            baseline=baseline,
            why=j.why,
            margin_evidence=DEFAULT_MARGIN_EVIDENCE,
            want_tokens=max_tokens,
            finish_reasons=[pd.finish_reason for _label, pd, _ref in rows],
        )
    pairs = []
    for label, pd, ref in rows:
        if not isinstance(ref, Completion):
            raise TypeError(f"{label}: exact mode needs the reference's completion, got forced scores")
        pairs.append((label, pd, ref))
    return evaluate_exact(pairs, baseline=baseline, why=j.why)


# ---------------------------------------------------------------- gatherer (edge)


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    """Each prompt through the router (counted in the window's ledger), then prefill-0's side
    straight to it (:func:`reference`); every instance must have served some of these requests.
    The tokens sent straight to prefill-0 are the window's direct tokens (not the router's)."""
    plan, model = window.plan, window.plan.served_model_name
    window.served_start()  # the window's per-instance counts start here, after smoke's request
    before = instances.scrape_served(plan)
    baseline = plan.prefill[0]
    j = Judge.for_config(plan.config)
    rows: list[tuple[str, Completion, Reference]] = []
    sent = 0.0
    for p in PARITY_PROMPTS:
        pd = window.via_router(p)
        try:
            ref = reference(j, baseline.url, model, p, pd, max_tokens=MAX_TOKENS, timeout=window.timeout_s)
        except ValueError as e:
            return CheckResult("parity", FAIL, f"could not run: {e}")
        sent += prompt_tokens_sent(pd, ref)
        rows.append((p, pd, ref))
    r = judge(j, rows, baseline=f"{baseline.name} direct (no disaggregation)", max_tokens=MAX_TOKENS)
    window.sent_direct(baseline.name, sent)
    return window.count_served(
        r, before, instances.scrape_served(plan), requests=len(PARITY_PROMPTS), direct={baseline.name: sent}
    )
