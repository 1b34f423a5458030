"""kv_digest: every KV block a decode loaded equals, byte for byte, the block the prefill sent.

The vLLM-side observer (pd_sessions/vllm_side/kv_observer.py) writes, per instance, a checksum per
layer of each block a prefill held for a send and each block a decode loaded (after any injected
fault: what the decode computes on); core/digest_records.py says the records. This check runs last,
reads every instance's side file and compares them for every request the cluster served in P/D,
whichever check sent it. A zeroed or swapped block then fails here even where the output text
stays within parity's margin.

Which blocks are compared, per request and per layer: every prompt block the decode loaded,
the partial last one included. The prefill digests every block it holds for the send (its first
``num_tokens // block_size`` are full); the decode digests the blocks its load filled, before it
computes anything into them: where its load meta lists blocks it hit in its own prefix cache
("all"), those after them (``first``); where it lists only the loaded ones ("tail"), all. The
loaded blocks are the end of the prefill's list, as vLLM pairs them. A position both sides cover
is compared. The connectors move
whole blocks, so a partial block's tail (stale bytes of an earlier request on the prefill) arrives
as it was; comparing it matters: on the CPU lane (block size 128) most prompts fill no block, and
a check of full blocks only would compare nothing there. ``partial_compared`` counts them.

Verdicts:

- FAIL: a block differs (naming the request, the layer and the block) in a load the fault
  injector did not corrupt; a load it corrupted (zero, swap: its log lines name them) whose
  blocks all equal the prefill's (the digest missed it); a load with no send digest on any
  prefill (the prefill's observer saw nothing); no load digest at all on the decodes while
  requests went through the router (the decode's observer saw nothing); a side file that the
  observer should have written and did not.
- NOT RUN, inapplicable (results.inapplicable: the config is outside what the digest compares,
  so it fails no config, even where the check is required; only --strict fails it): the two
  sides' layouts differ (TP sizes, block shapes, dtypes or the checksum method): the digest does
  not re-lay blocks out; the observer said the layout is not one it covers (a hybrid model: KV
  cache groups); known before launch (core/digest_records.py ``not_covered``: the instances then
  run no observer): a connector whose sends cannot be paired with loads (no ``send_layout``:
  NIXL push), a decode that loads no KV (``decode_kv_transfer = false``).
- NOT RUN that fails a config requiring the check (the default: kv_digest is a default check on
  the CPU lane, core/check_registry.py): the digest should have looked and could not: an
  instance runs no observer (its connector unwrapped), the observer could not digest for another
  reason (no KV tensors, no block dimension found), the side files are on other hosts.
- PASS: every load paired with its send, and its blocks equal exactly where no fault was
  injected: with fault_zero or fault_swap in the same config, the corrupted loads are the ones
  that differ (``detection`` says how many per fault: the digest's detection rate).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import digest_records, faults
from pd_sessions.core.results import (
    FAIL,
    PASS,
    CheckResult,
    Figure,
    Table,
    inapplicable,
    pick,
    reporting,
    unrun,
)

NAME = "kv_digest"
SHOWN = 3  # mismatches named in the message


@dataclass
class Pairing:
    """What comparing every load with its send found."""

    loads: int = 0
    paired: int = 0
    blocks: int = 0  # (request, block) positions compared, each over every layer
    partial: int = 0  # of them, partial last blocks (beyond the send's ``full``)
    nothing_to_compare: int = 0  # paired loads with no block both sides cover
    mismatches: list[dict[str, Any]] = field(default_factory=list)  # one per request: its first
    unpaired: list[dict[str, Any]] = field(default_factory=list)  # loads with no send
    differ: list[str] = field(default_factory=list)  # layouts that differ (see evaluate)
    # of them, a layer set that differs (never a config-wide layout: a connector's inconsistency)
    layers_differ: int = 0


def _positions(send: Mapping[str, Any], load: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(index in the load's sums, index in the send's sums) of each block both cover: the blocks a
    decode loaded are the END of the prefill's list (vLLM trims the prefill's blocks from the front
    to the count of the decode's uncomputed ones: nixl/base_worker.py ``_apply_prefix_caching``,
    Mooncake's send of its ``unhashed_block_ids``)."""
    n = len(load.get("blocks") or ())
    offset = int(send.get("listed", 0)) - n
    listed = min((len(v) for v in (send.get("sums") or {}).values()), default=0)
    return [(i, offset + i) for i in range(n) if 0 <= offset + i < listed]


def _layout_differs(send: Mapping[str, Any], load: Mapping[str, Any]) -> str | None:
    for key in ("world", "method", "layout", "block_size"):
        if send.get(key) != load.get(key):
            return f"{key}: prefill {send.get(key)!r}, decode {load.get(key)!r}"
    if set(send.get("sums") or {}) != set(load.get("sums") or {}):
        return "layers: the prefill's and the decode's layer names differ"
    return None


def compare_one(send: Mapping[str, Any], load: Mapping[str, Any], where: str, out: Pairing) -> None:
    """Compare one load with its send, adding what was found to ``out``."""
    why = _layout_differs(send, load)
    if why:
        out.differ.append(f"{where} request {load.get('req')}: {why}")
        out.layers_differ += why.startswith("layers:")
        return
    out.paired += 1
    pos = _positions(send, load)
    if not pos:
        out.nothing_to_compare += 1
    out.blocks += len(pos)
    out.partial += len([p for _, p in pos if p >= int(send.get("full", 0))])
    bad = []
    for layer in sorted(load.get("sums") or {}):
        got, want = load["sums"][layer], send["sums"][layer]
        bad += [(layer, i, p) for i, p in pos if got[i] != want[p]]
    if bad:
        layer, i, p = bad[0]
        out.mismatches.append(
            {
                "instance": where,
                "req": load.get("req"),
                "key": load.get("key"),
                "layer": layer,
                "block": p,
                "block_id": load["blocks"][i],
                "rank": load.get("rank"),
                "blocks_differ": len({b[2] for b in bad}),
                "layers_differ": len({b[0] for b in bad}),
            }
        )


def pair(records: Mapping[str, Sequence[Mapping[str, Any]]]) -> Pairing:
    """Every load record of ``records`` (instance -> its side file's records) compared with the
    send record of the same key and rank (the last one, wherever it is)."""
    sends: dict[tuple[Any, Any], Mapping[str, Any]] = {}
    for recs in records.values():
        for r in recs:
            if r.get("kind") == "send" and r.get("key") is not None:
                sends[(r["key"], r.get("rank"))] = r
    out = Pairing()
    for inst, recs in records.items():
        for load in (r for r in recs if r.get("kind") == "load"):
            out.loads += 1
            send = sends.get((load.get("key"), load.get("rank")))
            if send is None:
                out.unpaired.append({"instance": inst, "req": load.get("req"), "key": load.get("key")})
                continue
            compare_one(send, load, inst, out)
    return out


def _numbers(d: Mapping[str, Any]) -> list[Figure | Table]:
    out: list[Figure | Table] = list(
        pick(
            d,
            ("loads", ""),
            ("paired", ""),
            ("blocks_compared", ""),
            ("requests_differ", ""),
            ("injected", ""),
            ("injected_caught", ""),
            ("observer_s", "s"),
        )
    )
    rows = tuple(
        (m["instance"], m["req"], m["layer"], m["block"], m["blocks_differ"])
        for m in d.get("mismatches") or ()
    )
    if rows:
        out.append(
            Table("KV blocks that differ", ("instance", "request", "first layer", "block", "blocks"), rows)
        )
    return out


def _details(
    p: Pairing, records: Mapping[str, Sequence[Mapping[str, Any]]], injected: Mapping[str, str] | None
) -> dict[str, Any]:
    """The check's record: what was compared, what differs, the observer's cost and (when faults
    were injected) how many of the corrupted loads differ, per fault."""
    cost = sum(float(r.get("digest_s") or 0.0) for rs in records.values() for r in rs)
    d: dict[str, Any] = {
        "loads": p.loads,
        "paired": p.paired,
        "blocks_compared": p.blocks,
        "partial_compared": p.partial,
        "observer_s": round(cost, 6),
        "nothing_to_compare": p.nothing_to_compare,
        "requests_differ": len(p.mismatches),
        "mismatches": p.mismatches,
        "unpaired": p.unpaired,
    }
    if injected is not None:
        caught = {m["req"] for m in p.mismatches}
        d["injected"], d["injected_caught"] = len(injected), len([r for r in injected if r in caught])
        d["detection"] = {
            mode: f"{len([r for r, m in injected.items() if m == mode and r in caught])}/"
            f"{len([m for m in injected.values() if m == mode])}"
            for mode in sorted(set(injected.values()))
        }
    return d


def _differ(p: Pairing, d: dict[str, Any], unexpected: list[dict[str, Any]]) -> CheckResult:
    """FAIL naming the first requests whose blocks differ (no fault injected) or whose load has no send."""
    said = [
        f"{m['req']} layer {m['layer']} block {m['block']} (decode block {m['block_id']}, "
        f"{m['blocks_differ']} block(s) differ) on {m['instance']}"
        for m in unexpected[:SHOWN]
    ]
    said += [
        f"{u['req']} on {u['instance']}: no send digest (the prefill's observer saw nothing)"
        for u in p.unpaired[: max(0, SHOWN - len(said))]
    ]
    return CheckResult(
        NAME,
        FAIL,
        f"{len(unexpected)} of {p.paired} loads differ from what the prefill sent with no fault "
        f"injected, {len(p.unpaired)} unpaired: " + "; ".join(said),
        d,
    )


def _layouts(p: Pairing, d: dict[str, Any]) -> CheckResult:
    """Loads laid out unlike their sends. Not applicable only when the layouts differ config-wide:
    every load, in a config-wide key (TP world, method, layout, block size), and no compared load
    differs in its bytes. Some loads only, or a layer set that differs, is a connector that is not
    consistent with itself: FAIL, so that one odd load cannot hide a corrupted one."""
    whole = len(p.differ) == p.loads and not p.layers_differ and not p.mismatches
    if whole:
        return inapplicable(
            NAME,
            f"prefill and decode lay their KV out differently ({p.differ[0]}); the digest "
            "compares blocks of one layout (no re-layout)",
            d,
        )
    also = f"; {len(p.mismatches)} compared load(s) differ in their bytes" if p.mismatches else ""
    return CheckResult(
        NAME,
        FAIL,
        f"{len(p.differ)} of {p.loads} loads are laid out unlike their sends, e.g. {p.differ[0]} "
        f"(not the whole config's layout: the connector is not consistent with itself){also}",
        d,
    )


@reporting(_numbers)
def evaluate(
    records: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    decodes: Sequence[str],
    router_requests: int,
    injected: Mapping[str, str] | None = None,
) -> CheckResult:
    """The verdict from every instance's records (instance -> records; an instance whose side file
    is missing is absent), the decode instances' names, the requests sent through the router, and
    (when faults were injected) the decode requests whose KV the injector corrupted -> its mode."""
    said = [(i, r) for i, rs in records.items() for r in rs if r.get("kind") == "unavailable"]
    unavailable = sorted({f"{i}: {r.get('reason')}" for i, r in said})
    if unavailable:
        # inapplicable when every reason is a layout the digest does not cover (a hybrid model)
        why = unrun if any(not r.get("inapplicable") for _, r in said) else inapplicable
        said_why = "the observer could not digest: " + "; ".join(unavailable)
        return why(NAME, said_why, {"unavailable": unavailable})
    p = pair(records)
    d = _details(p, records, injected)
    if p.differ:
        d["layouts_differ"] = p.differ
        return _layouts(p, d)
    silent = [n for n in decodes if n not in records]
    if silent:
        return CheckResult(
            NAME,
            FAIL,
            f"no KV digest side file from {', '.join(silent)}: its observer "
            "wrote nothing (is its connector wrapped?)",
            d,
        )
    if p.loads == 0 and router_requests > 0:
        return CheckResult(
            NAME,
            FAIL,
            f"{router_requests} request(s) went through the router and the "
            "decodes' observer digested no load: it saw nothing",
            d,
        )
    injected = injected or {}
    missed = [r for r in injected if r not in {m["req"] for m in p.mismatches}]
    unexpected = [m for m in p.mismatches if m["req"] not in injected]
    if unexpected or p.unpaired:
        return _differ(p, d, unexpected)
    if missed:
        d["missed"] = missed
        return CheckResult(
            NAME,
            FAIL,
            f"the fault injector corrupted {len(injected)} load(s) and {len(missed)} of them equal what "
            f"the prefill sent, e.g. {missed[0]}: the digest missed them ({d['detection']})",
            d,
        )
    if injected:
        return CheckResult(
            NAME,
            PASS,
            f"every corrupted load caught ({d['detection']}) and none other differs: {p.paired} loads, "
            f"{p.blocks} blocks compared per layer ({p.partial} of them partial)",
            d,
        )
    return CheckResult(
        NAME,
        PASS,
        f"{p.paired} loads equal what the prefill sent: {p.blocks} blocks compared per layer "
        f"({p.partial} of them partial; {p.nothing_to_compare} loads with none to compare)",
        d,
    )


# ------------------------------------------------------------ gathering


def digest_settings(argv: Sequence[str]) -> str | None:
    """The side file an instance's kv-transfer-config names for the observer, or None."""
    argv = list(argv)
    if "--kv-transfer-config" not in argv:
        return None
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    if kv.get("kv_connector_module_path") != faults.CONNECTOR_MODULE:
        return None
    got = faults.settings(kv.get("kv_connector_extra_config") or {}) or {}
    path = got.get(digest_records.SETTING)
    return str(path) if path else None


def injected_requests(log_texts: Sequence[str]) -> dict[str, str]:
    """Decode request id -> "zero" | "swap" | "mixup" (faults.CORRUPTING) for every corruption
    the injector applied."""
    return {
        str(e.get("req")): str(e.get("mode"))
        for text in log_texts
        for e in faults.parse_events(text)
        if e.get("mode") in faults.CORRUPTING and e.get("applied", True)
    }


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    plan, run_dir = window.plan, window.cluster.run_dir
    config = plan.config
    why = digest_records.not_covered(config.connector, decode_kv_transfer=config.decode_kv_transfer)
    if why:
        return inapplicable(NAME, why)
    files = {s.name: digest_settings(s.argv) for s in plan.instances}
    unwrapped = [n for n, f in files.items() if f is None]
    if unwrapped:
        return unrun(
            NAME,
            f"{', '.join(unwrapped)} run(s) no KV digest observer (no wrapped KV connector "
            "in its kv-transfer-config: a decode without KV transfer, or a plan made without "
            "kv_digest among its checks)",
        )
    records: dict[str, list[dict[str, Any]]] = {}
    remote = []
    for s in plan.instances:
        path = Path(str(files[s.name]))
        if path.exists():
            records[s.name] = digest_records.parse(path.read_text(errors="replace"))
        elif s.node is not None and not path.parent.exists():
            remote.append(f"{s.name} on {s.node}")
    if remote:
        return unrun(NAME, f"the side files of {', '.join(remote)} are on other hosts, not read from here")
    logs = []
    for s in plan.decode:
        try:
            logs.append((run_dir / s.log_name).read_text(errors="replace"))
        except OSError:
            continue
    injected = injected_requests(logs)
    return evaluate(
        records,
        decodes=[s.name for s in plan.decode],
        router_requests=window.router_requests,
        injected=injected or None,
    )
