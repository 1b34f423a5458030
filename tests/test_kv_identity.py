"""core.kv_identity: the KV accounting each connector's code implies, row by row, and the vLLM
code it cites (read from the installed vLLM where there is one)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers.needs import needs

from pd_sessions.core import connectors
from pd_sessions.core import kv_identity as kvi
from pd_sessions.core.errors import ConfigError
from pd_sessions.core.kv_identity import Counts

B = 128


@pytest.mark.parametrize("connector", ["mooncake", "nixl", "nixl_push"])
@pytest.mark.parametrize(
    "ssm,prompt,cached,want",
    [
        # attention-only: the decode loads the whole prompt beyond its own cache hit
        (False, B - 1, 0, Counts(B - 1, 0, 0)),
        (False, B, 0, Counts(B, 0, 0)),
        (False, B + 1, 0, Counts(B + 1, 0, 0)),
        (False, 4 * B + 2, 0, Counts(4 * B + 2, 0, 0)),
        (False, 4 * B + 2, 4 * B, Counts(2, 4 * B, 0)),  # the prompt again: 4 blocks cached
        (False, 1, 0, Counts(1, 0, 0)),
        # SSM layers: the decode recomputes the last token
        (True, B, 0, Counts(B - 1, 0, 1)),
        (True, 2 * B + 1, 2 * B, Counts(0, 2 * B, 1)),
        (
            True,
            1,
            0,
            Counts(1, 0, 0),
        ),  # no longer than the backoff: loaded whole (num_prompt_tokens > backoff)
    ],
)
def test_expected_per_request(connector, ssm, prompt, cached, want):
    got = kvi.expected(connector, ssm=ssm, prompt_tokens=prompt, cached=cached)
    assert got == want and got.total == prompt


def test_cached_after_the_whole_prompt_is_whole_blocks_below_the_last_token():
    assert [kvi.cached_after_full_prompt(n, B) for n in (1, B - 1, B, B + 1, 2 * B, 4 * B + 2)] == [
        0,
        0,
        0,
        B,
        B,
        4 * B,
    ]


def test_sums_take_the_measured_cache_hits_and_the_backoff_per_request():
    want = kvi.expected_sum("nixl", ssm=True, prompt_tokens=356, requests=5, local_cache_hit=0)
    assert want == Counts(351, 0, 5)  # the tiny Kimi-Linear on the H200s
    assert kvi.expected_sum(
        "mooncake", ssm=False, prompt_tokens=600, requests=2, local_cache_hit=256
    ) == Counts(344, 256, 0)
    assert kvi.mismatches(Counts(343, 256, 1), Counts(344, 256, 0)) == [
        "external_kv_transfer 343, expected 344",
        "local_compute 1, expected 0",
    ]
    assert kvi.mismatches(Counts(1, 2, 3), Counts(1, 2, 3)) == []


def test_an_unknown_connector_is_named():
    with pytest.raises(ConfigError, match="allowed: mooncake, nixl, nixl_push"):
        kvi.backoff("lmcache", ssm=False)


def test_every_connector_spec_states_its_numbers_and_cites_vllm():
    for spec in connectors.ALL:
        row = spec.kv_accounting
        assert row.code.startswith("vllm/distributed/kv_transfer/") and ": " in row.code, spec.name
        assert (row.backoff_plain, row.backoff_ssm) == (0, 1), spec.name  # vLLM 0.32's three
    assert "push_scheduler.py" in kvi.describe("nixl_push", ssm=False)


def test_the_description_names_the_cited_code():
    assert "MooncakeConnectorScheduler._get_remote_prefill_token_count" in kvi.describe("mooncake", ssm=True)
    assert "local_compute = 0 per request" in kvi.describe("nixl", ssm=False)


@pytest.mark.procs
@pytest.mark.parametrize(
    "path,function,needles",
    [
        (
            "distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py",
            "def _get_remote_prefill_token_count(",
            ["self._has_mamba", "return num_prompt_tokens - 1", "return num_prompt_tokens"],
        ),
        (
            "distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py",
            "def _prefill_backoff(",
            ["1 if self._has_mamba", "num_prefill_lookahead_tokens - 1"],
        ),
        (
            "distributed/kv_transfer/kv_connector/v1/nixl/push_scheduler.py",
            "def get_num_new_matched_tokens(",
            ["self._get_remote_prefill_token_count("],
        ),
        (
            "v1/core/kv_cache_manager.py",
            "def get_computed_blocks(",
            ["max_cache_hit_length = request.num_tokens - 1"],
        ),
    ],
)
def test_the_cited_vllm_code_still_says_so(path, function, needles):
    """The identities are read from the installed vLLM's code: if it changes, this fails and names
    it (read as text, without importing vLLM)."""
    spec = importlib.util.find_spec("vllm")  # located, not imported (an import takes seconds)
    if spec is None:
        needs("vllm")  # the full environment fails here, `nox -s unit` skips with the reason
    text = (Path(spec.origin).parent / path).read_text()
    start = text.index(function)
    nxt = text.find("\n    def ", start + 1)
    body = text[start : nxt if nxt > 0 else None]
    assert all(n in body for n in needles), f"vllm/{path} {function} changed:\n{body}"
    assert function[4:-1] in kvi.__doc__


def test_prefix_caching_is_on_unless_the_last_flag_turns_it_off():
    assert kvi.prefix_caching([]) and kvi.prefix_caching(["--enforce-eager"])
    assert not kvi.prefix_caching(["--enforce-eager", "--no-enable-prefix-caching"])
    assert kvi.prefix_caching(["--no-enable-prefix-caching", "--enable-prefix-caching"])
    assert not kvi.prefix_caching(["--enable-prefix-caching", "--no-enable-prefix-caching"])


def test_with_prefix_caching_off_the_repeated_prompt_expects_no_decode_cache_hit():
    """The H200 run with --no-enable-prefix-caching (vLLM 0.26.0, nixl_push, 2026-12-05) saw
    66/0/0 for the repeated 66-token prompt; the check expected 2/64/0 (a decode cache hit) and
    failed. Off, nothing is cached: the expectation is what was seen."""
    args = ["--enforce-eager", "--no-enable-prefix-caching"]
    cached = kvi.cached_after_full_prompt(66, 16) if kvi.prefix_caching(args) else 0
    assert kvi.expected("nixl_push", ssm=False, prompt_tokens=66, cached=cached) == Counts(66, 0, 0)
    on = kvi.cached_after_full_prompt(66, 16) if kvi.prefix_caching(["--enforce-eager"]) else 0
    assert kvi.expected("nixl_push", ssm=False, prompt_tokens=66, cached=on) == Counts(2, 64, 0)
