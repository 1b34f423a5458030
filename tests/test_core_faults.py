"""The fault injector's control file and event lines (pd_sessions/core/faults.py), pure."""

from __future__ import annotations

import json

import pytest

from pd_sessions.core import faults
from pd_sessions.core.faults import Control, chosen_blocks, count_events, event_line, parse_events, selected


@pytest.mark.parametrize(
    ("fraction", "picked"),
    [(1.0, list(range(8))), (0.5, [1, 3, 5, 7]), (0.25, [3, 7]), (0.0, []), (0.75, [1, 2, 3, 5, 6, 7])],
)
def test_exactly_the_fraction_is_selected_spread_evenly(fraction, picked):
    assert [n for n in range(8) if selected(n, fraction)] == picked


def test_chosen_blocks_take_the_first_fraction_and_at_least_one():
    assert chosen_blocks([7, 8, 9, 10], 1.0) == [7, 8, 9, 10]
    assert chosen_blocks([7, 8, 9, 10], 0.5) == [7, 8]
    assert chosen_blocks([7, 8, 9, 10], 0.01) == [7]
    assert chosen_blocks([], 1.0) == []


def test_the_control_file_round_trips_and_empty_is_off():
    c = Control(epoch="e1", mode="stall", stall_s=5, where="prefill")
    assert Control.parse(c.to_json()) == c
    assert Control.parse("") == faults.OFF and Control.parse("  \n") == faults.OFF


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"mode": "explode"}', "mode: got 'explode'; allowed: off, drop, stall, zero, swap"),
        ('{"mode": "drop", "fraction": 1.5}', "fraction: got 1.5; allowed: a number from 0 to 1"),
        ('{"mode": "stall", "where": "router"}', "where: got 'router'; allowed: decode, prefill"),
        ('{"mode": "drop", "fractoin": 1}', "unknown field(s) ['fractoin']"),
        ("[1, 2]", "expected a JSON object"),
        ("{mode: drop}", "not JSON"),
        ('{"stall_s": true}', "stall_s: got True"),
    ],
)
def test_a_bad_control_file_names_the_field_and_what_is_allowed(text, says):
    with pytest.raises(ValueError, match=None) as e:
        Control.parse(text)
    assert says in str(e.value)


@pytest.mark.parametrize(
    ("mode", "where", "decode", "prefill"),
    [
        ("off", "decode", False, False),
        ("drop", "decode", True, False),
        ("zero", "decode", True, False),
        ("swap", "prefill", True, False),  # where matters for stall only
        ("stall", "decode", True, False),
        ("stall", "prefill", False, True),
    ],
)
def test_each_mode_applies_to_its_side(mode, where, decode, prefill):
    c = Control(mode=mode, where=where)
    assert (c.applies_to("decode"), c.applies_to("prefill")) == (decode, prefill)


def test_events_are_read_back_per_epoch_and_counted_per_mode():
    log = "\n".join(
        [
            "INFO some vLLM line",
            event_line(epoch="a", mode="zero", req="r1", applied=True),
            "(EngineCore pid=7) " + event_line(epoch="a", mode="zero", req="r2", applied=True),
            event_line(epoch="a", mode="swap", req="r3", applied=False, reason="no donor"),
            event_line(epoch="b", mode="drop", req="r4", applied=True),
            faults.EVENT_PREFIX + "{cut short",
        ]
    )
    assert count_events(parse_events(log, "a")) == {"zero": 2, "swap_skipped": 1}
    assert count_events(parse_events(log)) == {"zero": 2, "swap_skipped": 1, "drop": 1}
    assert parse_events(log, "zzz") == []
    assert json.loads(event_line(b=1, a=2)[len(faults.EVENT_PREFIX) :]) == {"a": 2, "b": 1}


def test_settings_are_read_from_the_extra_config_only_when_present():
    assert faults.settings({"mooncake_protocol": "tcp"}) is None
    assert faults.settings({faults.EXTRA_CONFIG_KEY: {"control": "/x"}}) == {"control": "/x"}


@pytest.mark.parametrize(
    ("external", "prompt", "block", "tokens", "back"),
    [
        (40, 40, 16, 5, 5),  # the last block holds 8 tokens: 5 of them
        (40, 40, 16, 99, 7),  # at most the last block's but one: the load keeps its 3 blocks
        (33, 33, 16, 3, 0),  # the last block holds 1 token: nothing to take
        (20, 20, 128, 8, 8),  # the CPU lane: one block
        (0, 20, 128, 8, 0),  # nothing to load
        (3, 20, 128, 8, 3),  # never more than is loaded
        (20, 20, 0, 8, 0),  # no block size known
    ],
)
def test_recomputed_takes_back_only_tokens_of_the_last_block(external, prompt, block, tokens, back):
    assert faults.recomputed(external, prompt, block, tokens) == back


def test_the_new_modes_and_their_tokens_are_checked():
    assert faults.Control(mode="truncate", tokens=2).applies_to("decode")
    assert not faults.Control(mode="recompute").applies_to("prefill")
    assert faults.Control.parse('{"mode": "mixup"}').tokens == 1
    with pytest.raises(ValueError, match="tokens: got 0"):
        faults.Control(mode="truncate", tokens=0)
    with pytest.raises(ValueError, match=r"tokens: got 1\.5"):
        faults.Control(mode="truncate", tokens=1.5)
    assert set(faults.CORRUPTING) <= set(faults.AFTER_LOAD) and "mixup" in faults.CORRUPTING
