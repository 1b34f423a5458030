"""Injected KV-transfer faults: the control file both sides read, and what the injector says.

Pure (standard library only). Two processes share it:

- the **harness** (the fault scenarios, ``pd_sessions/checks/faults/``) writes a :class:`Control`
  to the cluster's control file to switch the mode at run time: one cluster serves every mode;
- the **injector** (``pd_sessions/vllm_side/fault_connector.py``, a subclass of the configured KV connector
  that vLLM creates in its scheduler and worker processes) reads the file, applies the mode to a
  chosen fraction of the requests, and says each thing it did as one log line
  (:func:`event_line`); the harness counts them (:func:`count_events`) to prove the fault
  happened.

Modes (``Control.mode``):

| mode  | side    | what the injector does |
| ----- | ------- | ---------------------- |
| off   |         | nothing: every call goes to the wrapped connector unchanged |
| drop  | decode  | a finished load reported failed (``failed_recving``); vLLM recomputes |
|       |         | or fails the request, per ``kv_load_failure_policy`` |
| stall | decode  | a selected load starts ``stall_s`` late (the decode holds the request |
|       |         | waiting for remote KV meanwhile) |
| stall | prefill | a selected request waits ``stall_s`` on the prefill, unscheduled |
|       |         | (``where = "prefill"``) |
| zero  | decode  | after the load, the first ``blocks`` fraction of the request's KV |
|       |         | blocks is overwritten with zeros |
| swap  | decode  | after the load, those blocks are overwritten with another request's |
|       |         | received blocks |
| mixup | decode  | after the load, every block of the request is overwritten with another |
|       |         | concurrent request's (loads finishing together trade their KV crosswise): |
|       |         | its whole answer is computed from another prompt's KV |
| truncate | decode | the decode's scheduler ends the request after ``tokens`` generated |
|       |         | tokens (its ``max_tokens`` lowered when it is first scheduled): HTTP 200 |
|       |         | with a short answer |
| recompute | decode | the decode's scheduler takes ``tokens`` of the tokens the connector |
|       |         | would load back (at most the last block's but one, so the load's blocks |
|       |         | are the same): the decode loads part of the KV and computes the rest |
| strand | prefill | a finished send of a selected request is not reported to the scheduler |
|       |         | (``finished_sending``), so its blocks stay in use; they are handed back |
|       |         | on the first step after the mode goes off |
|       | decode  | with ``stall_s`` > 0, each load starts ``stall_s`` late (as stall), so the |
|       |         | client can leave and the decode abort first |

Which requests: the n-th candidate of an epoch (counted from 0 on each side) is selected when
``floor((n + 1) * fraction) > floor(n * fraction)``: exactly ``fraction`` of them, spread evenly
(1.0 = every one, 0.5 = every second, 0 = none). Candidates are, on the decode, the loads that
start (stall) or finish (drop, zero, swap, mixup), the requests its scheduler first schedules
(truncate, recompute); on the prefill, the requests it schedules (stall) or whose sends finish
(strand).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MODES = ("off", "drop", "stall", "zero", "swap", "mixup", "truncate", "recompute", "strand")
# The modes that overwrite a load's KV blocks after it finished (the KV digest must see them).
CORRUPTING = ("zero", "swap", "mixup")
# The modes applied after a load finished (get_transfer_results), and those applied by the
# decode's scheduler when it first schedules a request (get_num_new_matched_tokens).
AFTER_LOAD = ("drop", *CORRUPTING)
AT_SCHEDULE = ("truncate", "recompute")
SIDES = ("decode", "prefill")
# The kv_connector_extra_config key the planner puts the injector's settings under.
EXTRA_CONFIG_KEY = "pd_sessions_faults"
# The module vLLM's KVConnectorFactory imports the wrapper from (kv_connector_module_path).
CONNECTOR_MODULE = "pd_sessions.vllm_side.fault_connector"
# Every line the injector writes starts with this, then one JSON object.
EVENT_PREFIX = "pd_sessions fault: "


@dataclass(frozen=True)
class Control:
    """What the injector does now. ``epoch`` names one scenario: counters restart with it."""

    epoch: str = ""
    mode: str = "off"
    fraction: float = 1.0  # of the candidate requests, selected evenly (see the module doc)
    blocks: float = 1.0  # zero / swap: this fraction of a request's KV blocks (at least one)
    stall_s: float = 0.0  # stall: seconds
    where: str = "decode"  # stall: "decode" (the load) or "prefill" (before it computes)
    tokens: int = 1  # truncate: tokens the answer is cut to; recompute: tokens taken back

    def __post_init__(self) -> None:
        """ValueError naming the field and what is allowed."""
        if self.mode not in MODES:
            raise ValueError(f"mode: got {self.mode!r}; allowed: {', '.join(MODES)}")
        if self.where not in SIDES:
            raise ValueError(f"where: got {self.where!r}; allowed: {', '.join(SIDES)}")
        for name, lo, hi in (("fraction", 0.0, 1.0), ("blocks", 0.0, 1.0), ("stall_s", 0.0, 3600.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ValueError(f"{name}: got {v!r}; allowed: a number from {lo:g} to {hi:g}")
        if (
            isinstance(self.tokens, bool)
            or not isinstance(self.tokens, int)
            or not 1 <= self.tokens <= 1 << 20
        ):
            raise ValueError(f"tokens: got {self.tokens!r}; allowed: a whole number from 1 to {1 << 20}")
        if not isinstance(self.epoch, str):
            raise ValueError(f"epoch: got {self.epoch!r}; allowed: a string")

    def applies_to(self, side: str) -> bool:
        """Whether this mode does anything on ``side`` ("decode" or "prefill")."""
        if self.mode == "off":
            return False
        if self.mode == "stall":
            return self.where == side
        if self.mode == "strand":
            return side == "prefill" or self.stall_s > 0
        return side == "decode"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def parse(cls, text: str) -> Control:
        """The control file's content; "" is off. ValueError naming what is wrong."""
        if not text.strip():
            return cls()
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"got {type(raw).__name__}; expected a JSON object")
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; allowed: {', '.join(cls.__dataclass_fields__)}")
        return cls(**raw)


OFF = Control()


def selected(n: int, fraction: float) -> bool:
    """Whether the ``n``-th candidate (from 0) is selected: exactly ``fraction`` of them, evenly.

    fraction 1.0 -> every one; 0.5 -> n = 1, 3, 5...; 0.25 -> n = 3, 7...; 0 -> none
    """
    return math.floor((n + 1) * fraction + 1e-9) > math.floor(n * fraction + 1e-9)


def chosen_blocks(block_ids: Sequence[int], fraction: float) -> list[int]:
    """The first ``fraction`` of a request's blocks, at least one (none when it has none)."""
    if not block_ids:
        return []
    k = max(1, math.ceil(len(block_ids) * fraction - 1e-9))
    return list(block_ids[:k])


def recomputed(external: int, prompt: int, block_size: int, tokens: int) -> int:
    """How many of the ``external`` tokens a decode would load (of a ``prompt``-token prompt) the
    recompute mode takes back: ``tokens``, at most those of the prompt's last block but one, so
    the load still covers the same blocks (a connector pairs its local blocks with the remote
    ones by count). 0 when there is nothing to take (nothing loaded, or the prompt's last block
    holds one token).

    external 40, prompt 40, block 16, tokens 5   -> 5   (the last block holds 8: 5 <= 7)
    external 40, prompt 40, block 16, tokens 99  -> 7
    external 33, prompt 33, block 16, tokens 3   -> 0   (the last block holds 1 token)
    external 0 (nothing to load)                 -> 0
    """
    if external <= 0 or prompt <= 0 or block_size <= 0:
        return 0
    last = prompt - (prompt - 1) // block_size * block_size  # tokens in the last block: 1..block_size
    return max(0, min(tokens, last - 1, external))


def event_line(**fields: Any) -> str:
    """One line for the instance log: EVENT_PREFIX + JSON (keys sorted)."""
    return EVENT_PREFIX + json.dumps(fields, sort_keys=True)


def parse_events(log_text: str, epoch: str | None = None) -> list[dict[str, Any]]:
    """The injector's events in ``log_text`` (of ``epoch`` only, when given), in order.
    Lines that do not parse are left out (a line cut by a crash, another process's text)."""
    out = []
    for line in log_text.splitlines():
        at = line.find(EVENT_PREFIX)
        if at < 0:
            continue
        try:
            ev = json.loads(line[at + len(EVENT_PREFIX) :])
        except ValueError:
            continue
        if isinstance(ev, dict) and (epoch is None or ev.get("epoch") == epoch):
            out.append(ev)
    return out


def count_events(events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """mode -> how many times it was applied ("applied": true); skips as "<mode>_skipped"."""
    out: dict[str, int] = {}
    for ev in events:
        key = str(ev.get("mode")) + ("" if ev.get("applied", True) else "_skipped")
        out[key] = out.get(key, 0) + 1
    return out


def settings(extra_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The injector's settings from a kv_connector_extra_config, or None when it is not wrapped."""
    got = extra_config.get(EXTRA_CONFIG_KEY)
    return dict(got) if isinstance(got, Mapping) else None
