"""KV accounting without blanket slack: what a decode's prompt-token counters must show for P/D
requests, per connector, as each connector's code implies it (vLLM 0.32).

vLLM counts every prompt token a decode schedules by source, once per request at its first
scheduling (``vllm:prompt_tokens_by_source_total``; vllm/v1/metrics/stats.py PromptTokenStats,
set in vllm/v1/core/sched/scheduler.py ``Scheduler.schedule`` through ``PrefillStats.set``):

    local_compute + local_cache_hit + external_kv_transfer = prompt tokens

- ``local_cache_hit``: the decode's own prefix-cache hit, whole blocks and at most prompt - 1
  tokens (vllm/v1/core/kv_cache_manager.py ``KVCacheManager.get_computed_blocks``:
  ``max_cache_hit_length = request.num_tokens - 1``); the connector is asked for the rest.
- ``external_kv_transfer``: what the connector's ``get_num_new_matched_tokens`` returns for that
  rest: its remote prefill token count minus the local hit, never below 0.
- ``local_compute``: what is left, the tokens the decode recomputes itself.

The connectors' remote prefill token count (the one place they differ) is the prompt minus a
*backoff* of trailing tokens the decode recomputes:

- Mooncake: vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py,
  ``MooncakeConnectorScheduler._get_remote_prefill_token_count``: N - 1 when the model has Mamba
  (SSM) layers (``kv_cache_config.has_mamba_layers``) or DSV4.1's bounded sliding-window replay,
  else N;
- NIXL (pull and push): vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py,
  ``NixlBaseConnectorScheduler._prefill_backoff``: max(1 if Mamba layers or bounded replay,
  ``num_prefill_lookahead_tokens`` - 1), and ``_get_remote_prefill_token_count`` = N - backoff.
  ``num_prefill_lookahead_tokens`` is 0 without a multi-module MTP drafter (vllm/config/vllm.py),
  which no config of ours sets.

So per request, with ``cached`` the tokens the decode already holds in its prefix cache:

    external_kv_transfer = max(0, prompt - backoff - cached)
    local_cache_hit      = cached
    local_compute        = prompt - cached - external_kv_transfer   (= backoff when it fits)

checked exactly, per request and summed. Seen on the H200s (docs/notes/gpu-verification/, 2026-11-29):
the tiny Kimi-Linear (KDA layers are Mamba layers to vLLM) over NIXL received 351 of 356 prompt
tokens for 5 requests (backoff 1), every attention-only config exactly 356 of 356 (backoff 0).
No connector's code leaves room for slack, so there is none; a future one that needs it must
name its reason here and in the verdict.

The numbers per connector (backoff with and without SSM layers, and the code they come from) are
each connector's spec's ``kv_accounting`` (pd_sessions/core/connectors/<name>.py); this module
states the identity over them. A config marks SSM layers with ``hybrid = true`` (linear
attention / Mamba layers).

Pure; reads the connector specs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pd_sessions.core import connectors
from pd_sessions.core.connectors.base import KvAccounting

# vLLM's source labels of vllm:prompt_tokens_by_source_total (PromptTokenStats.ALL_SOURCES).
LOCAL_COMPUTE = "local_compute"
LOCAL_CACHE_HIT = "local_cache_hit"
EXTERNAL = "external_kv_transfer"


@dataclass(frozen=True)
class Counts:
    """Prompt tokens by source: one request's, or a sum (a counter's delta)."""

    external: float = 0.0
    local_cache_hit: float = 0.0
    local_compute: float = 0.0

    @property
    def total(self) -> float:
        return self.external + self.local_cache_hit + self.local_compute

    @classmethod
    def from_sources(cls, by_source: Mapping[str, float]) -> Counts:
        return cls(
            external=by_source.get(EXTERNAL, 0.0),
            local_cache_hit=by_source.get(LOCAL_CACHE_HIT, 0.0),
            local_compute=by_source.get(LOCAL_COMPUTE, 0.0),
        )

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.external + other.external,
            self.local_cache_hit + other.local_cache_hit,
            self.local_compute + other.local_compute,
        )

    def __sub__(self, other: Counts) -> Counts:
        return Counts(
            self.external - other.external,
            self.local_cache_hit - other.local_cache_hit,
            self.local_compute - other.local_compute,
        )

    def as_dict(self) -> dict[str, float]:
        return {
            EXTERNAL: self.external,
            LOCAL_CACHE_HIT: self.local_cache_hit,
            LOCAL_COMPUTE: self.local_compute,
        }

    def __str__(self) -> str:
        return (
            f"external_kv_transfer {self.external:g}, local_cache_hit {self.local_cache_hit:g}, "
            f"local_compute {self.local_compute:g}"
        )


def identity(connector: str) -> KvAccounting:
    """The connector spec's KV accounting; ConfigError (from the registry) names the connectors
    it knows."""
    return connectors.get(connector).kv_accounting


def backoff(connector: str, *, ssm: bool) -> int:
    """Trailing prompt tokens a decode recomputes per P/D request (see the module docstring)."""
    row = identity(connector)
    return row.backoff_ssm if ssm else row.backoff_plain


def cached_after_full_prompt(prompt_tokens: int, block_size: int) -> int:
    """Tokens of a prompt the decode holds in its prefix cache once it has held the whole prompt:
    whole blocks, at most prompt - 1 (KVCacheManager.get_computed_blocks)."""
    return max(0, (prompt_tokens - 1) // block_size * block_size)


def prefix_caching(args: Sequence[str]) -> bool:
    """Whether an engine started with ``args`` caches prefixes: vLLM's default (on), unless the
    last of ``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` turns it off. Off, a
    repeated prompt is no decode cache hit (seen on an H200 with vLLM 0.26.0, 2026-12-05)."""
    last = None
    for a in args:
        if a in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
            last = a
    return last != "--no-enable-prefix-caching"


def expected(connector: str, *, ssm: bool, prompt_tokens: int, cached: int = 0) -> Counts:
    """One P/D request of ``prompt_tokens`` of which the decode already holds ``cached``.

    external      = max(0, prompt - backoff - cached)
    local_cache_hit = cached
    local_compute = prompt - cached - external

    A prompt no longer than the backoff is loaded whole (both connectors'
    ``_get_remote_prefill_token_count`` back off only when ``num_prompt_tokens > backoff``).
    """
    b = backoff(connector, ssm=ssm)
    if prompt_tokens <= b:
        b = 0
    external = max(0, prompt_tokens - b - cached)
    return Counts(float(external), float(cached), float(prompt_tokens - cached - external))


def expected_sum(
    connector: str, *, ssm: bool, prompt_tokens: int, requests: int, local_cache_hit: float
) -> Counts:
    """Requests summed, their decode cache hits as measured (``local_cache_hit``): every
    request loads all but its backoff and its hit (every request longer than the backoff: the
    checks' prompts are; :func:`expected` covers the shorter ones per request), so

    external      = prompt - backoff * requests - local_cache_hit
    local_compute = backoff * requests
    """
    b = backoff(connector, ssm=ssm) * requests
    return Counts(float(prompt_tokens - b - local_cache_hit), float(local_cache_hit), float(b))


def mismatches(seen: Counts, want: Counts) -> list[str]:
    """One phrase per source where ``seen`` differs from ``want`` (empty: exact)."""
    out = []
    for source, s, w in (
        (EXTERNAL, seen.external, want.external),
        (LOCAL_CACHE_HIT, seen.local_cache_hit, want.local_cache_hit),
        (LOCAL_COMPUTE, seen.local_compute, want.local_compute),
    ):
        if s != w:
            out.append(f"{source} {s:g}, expected {w:g}")
    return out


def describe(connector: str, *, ssm: bool) -> str:
    """The identity in words, for verdicts and results."""
    b = backoff(connector, ssm=ssm)
    row = identity(connector)
    why = (
        f"the decode recomputes the last {b} prompt token(s) ({'SSM layers' if ssm else 'model'}, {row.code})"
        if b
        else f"the decode loads the whole prompt ({row.code})"
    )
    return (
        f"{connector}: external_kv_transfer = prompt - {b} - decode cache hit, local_compute = {b} "
        f"per request, exact: {why}"
    )
