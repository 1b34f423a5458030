"""The fault-injecting KV connector: the configured connector, subclassed, with faults on demand.

vLLM's ``KVConnectorFactory`` imports this module when a kv-transfer-config names it as
``kv_connector_module_path`` (the planner does so when a fault scenario is selected; see
``pd_sessions/core/faults.py`` for the modes and the control file). The connector keeps its own
name (``"kv_connector": "NixlConnector"``): the factory then asks this module for that name, and
:func:`__getattr__` answers with a subclass of the class vLLM registered under it. So every
method, class method, stat and Prometheus metric is the wrapped connector's own (the KV proof
keeps working), and vLLM's checks of the connector's name (``has_connector("NixlConnector")``)
still hold. With the mode ``off`` the subclass changes nothing.

It overrides only these, and acts only when the control file asks (the rest is inherited):

- ``get_num_new_matched_tokens`` (prefill scheduler): stall on the prefill answers "not yet"
  (None) until the stall ends, so the request waits there, unscheduled; (decode scheduler):
  truncate lowers a selected request's ``max_tokens`` (vLLM's scheduler then ends it early, the
  client gets HTTP 200 with a short answer), recompute answers fewer tokens than the wrapped
  connector would load (the decode computes the rest itself: vLLM counts them as local_compute);
- ``bind_connector_metadata`` (decode worker): stall on the decode holds a selected load back
  and hands it to the connector ``stall_s`` later; every load's blocks are recorded;
- ``get_transfer_results`` (decode worker): drop reports a finished load as failed; zero, swap and
  mixup overwrite its blocks before the scheduler learns it finished;
- ``get_transfer_results`` (prefill worker): strand keeps a finished send from the scheduler, so
  the request's blocks stay in use, and hands it back on the first call after the mode goes off;
- ``register_kv_caches`` (worker): keeps the KV cache tensors that zero and swap write into;
- ``request_finished`` / ``request_finished_all_groups`` and ``build_connector_meta`` (prefill
  scheduler), only with the KV digest on: note the blocks held for a send and hand them to the
  workers (kv_observer.py, whose settings the planner adds when ``kv_digest`` is selected: the
  connector is then wrapped even with no fault scenario, the control file "" and faults off).

Each fault applied is one line in the instance log (``pd_sessions fault: {...}``, see
:func:`pd_sessions.core.faults.event_line`), so a scenario proves it happened.

Where the connectors differ, each connector's spec says what is known (``recv_layout``,
gathered in :data:`RECV_LAYOUT`): how its worker metadata lists the loads to start
(``reqs_to_recv``). A connector whose spec does not say gets drop (generic: vLLM's
``failed_recving``) and the prefill stall; zero, swap and the decode stall are then logged as
skipped, with the reason.

Imports only the core (a lint contract): vLLM and torch are imported where they are needed.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pd_sessions.core import connectors, digest_records, faults
from pd_sessions.core.faults import Control
from pd_sessions.vllm_side.kv_observer import SENDS_ATTR, Observer

# vLLM connector class -> how its worker metadata lists loads (each connector's spec says:
# ConnectorSpec.recv_layout); each load's meta has local_block_ids (one list per KV cache group).
RECV_LAYOUT: dict[str, str] = {s.vllm_class: s.recv_layout for s in connectors.ALL if s.recv_layout}
# vLLM connector class -> how the KV digest pairs a send with a load (ConnectorSpec.send_layout)
SEND_LAYOUT = {s.vllm_class: s.send_layout for s in connectors.ALL if s.send_layout}
_MAX_TRACKED = 4096  # request ids remembered per side (a long-running server must not grow)
ERROR_CALLS = 8  # how many worker steps a connector's load-error blocks are remembered

_classes: dict[str, type] = {}


def __getattr__(name: str) -> type:
    """``<name>``: the connector vLLM registered under ``name``, with faults (built once)."""
    if name.startswith("_") or not name[:1].isupper():
        raise AttributeError(name)
    if name not in _classes:
        try:
            base = _registered(name)
        except (ImportError, ValueError) as e:
            raise AttributeError(f"{__name__}: no KV connector {name!r} to wrap ({e})") from None
        # a vLLM whose connectors have no get_transfer_results (0.26) gets the hooks it calls instead
        hooks = (
            (FaultInjecting,)
            if hasattr(base, "get_transfer_results")
            else (BeforeTransferResults, FaultInjecting)
        )
        _classes[name] = type(
            name, (*hooks, base), {"__module__": __name__, "__qualname__": name, "_pd_wraps": name}
        )
    return _classes[name]


def _registered(name: str) -> type:
    """The class vLLM's KVConnectorFactory has under ``name`` (ValueError when none)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class_by_name(name)


def say(text: str) -> None:
    """One line to the instance log (stderr: vLLM's own logging may be configured away)."""
    print(text, file=sys.stderr, flush=True)


@dataclass
class Load:
    """One load of a decode worker's metadata: where it sits and its blocks per group."""

    engine: Any  # the "by_engine" key, None for "flat"
    req: str
    meta: Any
    until: float = 0.0  # held back (stall) until this time.monotonic()

    @property
    def groups(self) -> list[list[int]]:
        return [list(g) for g in getattr(self.meta, "local_block_ids", ()) or ()]

    @property
    def awaited(self) -> bool:
        """A real load (blocks to fill); empty ones only tell the prefill to free its blocks."""
        return any(self.groups)


def loads(metadata: Any, layout: str) -> list[Load]:
    recv = getattr(metadata, "reqs_to_recv", None) or {}
    if layout == "by_engine":
        return [Load(eng, rid, m) for eng, reqs in recv.items() for rid, m in reqs.items()]
    return [Load(None, rid, m) for rid, m in recv.items()]


def with_loads(metadata: Any, layout: str, kept: Iterable[Load]) -> Any:
    """A shallow copy of ``metadata`` whose reqs_to_recv holds ``kept`` (the original is not
    changed: in one process the scheduler and the worker may share it)."""
    out = copy.copy(metadata)
    if layout == "by_engine":
        nested: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        for ld in kept:
            nested[ld.engine][ld.req] = ld.meta
        out.reqs_to_recv = nested
    else:
        out.reqs_to_recv = {ld.req: ld.meta for ld in kept}
    return out


@dataclass
class Injector:
    """The state of one connector object (one per vLLM scheduler or worker process)."""

    control_path: str
    side: str  # "prefill" (kv_producer) or "decode" (kv_consumer)
    role: str  # "scheduler" | "worker"
    layout: str | None  # RECV_LAYOUT entry, None when unknown
    wraps: str
    control: Control = faults.OFF
    n: int = 0  # candidates seen in this epoch
    stamp: tuple[int, int, int] | None = None  # the file's inode, mtime (ns) and size
    problem: str | None = None  # why the control file could not be read (said once)
    held: dict[str, float] = field(default_factory=dict)  # prefill stall: req -> until
    lowered: dict[str, int] = field(default_factory=dict)  # recompute: req -> tokens taken back
    seen: dict[str, str] = field(default_factory=dict)  # req -> epoch it was a candidate in
    parked: list[Load] = field(default_factory=list)  # decode stall
    blocks: dict[str, list[list[int]]] = field(default_factory=dict)  # req -> its load's blocks
    kv_caches: dict[str, Any] = field(default_factory=dict)
    block_dims: dict[str, int] = field(default_factory=dict)  # layer -> its block dimension
    donor: tuple[str, dict[str, Any]] | None = None  # swap: (req, layer -> saved blocks)
    stranded: dict[str, str] = field(default_factory=dict)  # strand: req -> the epoch that held it
    # the wrapped connector's load errors (block ids), taken before vLLM asks for them and told
    # to it unchanged when it does (load_errors); each remembered ERROR_CALLS calls (error_seen:
    # block -> the call it came in), since a connector may report a failed load's blocks a step
    # before the load itself
    load_errors: set[int] = field(default_factory=set)
    error_seen: dict[int, int] = field(default_factory=dict)
    calls: int = 0

    def now_control(self) -> Control:
        """The control file's content, read again when it changed. Looked at (one stat) on every
        call: a cache by time let a request that came right after the harness switched modes see
        the old mode (fault_stall_abort's stall not applied once in CI, 2026-12-02)."""
        try:
            st = os.stat(self.control_path)
        except FileNotFoundError:
            self._set(faults.OFF)
            return self.control
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # the harness replaces the file whole
        if stamp == self.stamp:
            return self.control
        self.stamp = stamp
        try:
            with open(self.control_path) as f:
                c = Control.parse(f.read())
        except (OSError, ValueError) as e:
            if self.problem != str(e):
                say(f"pd_sessions: fault control {self.control_path} not applied: {e}; faults off")
            self.problem = str(e)
            c = faults.OFF
        self._set(c)
        return self.control

    def _set(self, c: Control) -> None:
        if c.epoch != self.control.epoch:
            self.n = 0
        self.control = c

    def candidate(self, req: str) -> bool:
        """Count ``req`` as the next candidate of this epoch (once) and say if it is selected."""
        epoch = self.control.epoch
        if self.seen.get(req) == epoch:
            return False
        if len(self.seen) >= _MAX_TRACKED:
            self.seen.pop(next(iter(self.seen)))
        self.seen[req] = epoch
        n, self.n = self.n, self.n + 1
        return faults.selected(n, self.control.fraction)

    def event(
        self, mode: str, req: str, *, applied: bool = True, epoch: str | None = None, **more: Any
    ) -> None:
        say(
            faults.event_line(
                epoch=self.control.epoch if epoch is None else epoch,
                mode=mode,
                req=req,
                side=self.side,
                applied=applied,
                pid=os.getpid(),
                connector=self.wraps,
                **more,
            )
        )


class FaultInjecting:
    """Put before the wrapped connector class (see :func:`__getattr__`); vLLM calls it as that."""

    _pd_wraps = "?"

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *args: Any, **kw: Any):
        super().__init__(vllm_config, role, kv_cache_config, *args, **kw)  # type: ignore[call-arg]
        ktc = vllm_config.kv_transfer_config
        got = faults.settings(ktc.kv_connector_extra_config or {}) or {}
        self._pd = Injector(
            control_path=str(got.get("control", "")),
            side="prefill" if ktc.is_kv_producer and not ktc.is_kv_consumer else "decode",
            role=str(getattr(role, "name", role)).lower(),
            layout=RECV_LAYOUT.get(self._pd_wraps),
            wraps=self._pd_wraps,
        )
        self._pd_cache_config = kv_cache_config
        self._pd_block_size = int(getattr(getattr(vllm_config, "cache_config", None), "block_size", 0) or 0)
        digest = got.get(digest_records.SETTING)
        self._pd_digest = (
            Observer(
                str(digest),
                side=self._pd.side,
                layout=SEND_LAYOUT.get(self._pd_wraps),
                block_size=int(vllm_config.cache_config.block_size),
                world=int(vllm_config.parallel_config.tensor_parallel_size),
            )
            if digest
            else None
        )
        say(
            f"pd_sessions: fault-injecting {self._pd_wraps} ({self._pd.side} {self._pd.role}, "
            f"pid {os.getpid()}); control file {self._pd.control_path or '(none: faults off)'}"
            + (f"; KV digest to {digest}" if digest else "")
        )

    # ------------------------------------------------------------ scheduler side (prefill stall)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        pd = self._pd
        if pd.side == "prefill" and pd.control_path:
            c = pd.now_control()
            rid = request.request_id
            if c.mode == "stall" and c.applies_to("prefill") and pd.candidate(rid):
                if len(pd.held) >= _MAX_TRACKED:
                    pd.held.pop(next(iter(pd.held)))
                pd.held[rid] = time.monotonic() + c.stall_s
                pd.event("stall", rid, stall_s=c.stall_s, where="prefill")
            until = pd.held.get(rid)
            if until is not None:
                if time.monotonic() < until:
                    return None, False  # "not yet": vLLM asks again on a later step
                del pd.held[rid]
        got = super().get_num_new_matched_tokens(request, num_computed_tokens)  # type: ignore[misc]
        if pd.side == "decode" and pd.control_path:
            return self._pd_at_schedule(request, got)
        return got

    def _pd_at_schedule(self, request: Any, got: tuple[int | None, bool]) -> tuple[int | None, bool]:
        """truncate / recompute on the decode's scheduler, for a request it is about to schedule
        (``got``: what the wrapped connector answered)."""
        pd = self._pd
        c = pd.now_control()
        rid = request.request_id
        count, is_async = got
        if c.mode in faults.AT_SCHEDULE and count and pd.candidate(rid):
            if c.mode == "truncate":
                was = int(getattr(request, "max_tokens", 0) or 0)
                request.max_tokens = min(was, c.tokens) if was else c.tokens
                pd.event("truncate", rid, max_tokens=was, cut_to=request.max_tokens)
            else:
                prompt = int(getattr(request, "num_prompt_tokens", 0) or 0)
                back = faults.recomputed(count, prompt, self._pd_block_size, c.tokens)
                if back:
                    if len(pd.lowered) >= _MAX_TRACKED:
                        pd.lowered.pop(next(iter(pd.lowered)))
                    pd.lowered[rid] = back
                    pd.event("recompute", rid, external=count, recomputed=back, prompt=prompt)
                else:
                    why = (
                        f"prompt {prompt}, block size {self._pd_block_size}: "
                        "no token of its last block to take"
                    )
                    pd.event("recompute", rid, applied=False, reason=why)
        back = pd.lowered.get(rid, 0) if count else 0
        return (count - back, is_async) if count and back else got

    # ------------------------------------------------------------ scheduler side (KV digest)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)  # type: ignore[misc]
        if self._pd_digest is not None and self._pd.side == "prefill":
            self._pd_digest.note_send(request, block_ids, delay)
        return delay, params

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished_all_groups(request, block_ids)  # type: ignore[misc]
        if self._pd_digest is not None and self._pd.side == "prefill":
            self._pd_digest.note_send(request, block_ids, delay)
        return delay, params

    def build_connector_meta(self, *args: Any, **kw: Any) -> Any:
        meta = super().build_connector_meta(*args, **kw)  # type: ignore[misc]
        if self._pd_digest is not None:
            meta = self._pd_digest.hand_over(meta)
        return meta

    # ------------------------------------------------------------ worker side (decode)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._pd.kv_caches = dict(kv_caches)
        super().register_kv_caches(kv_caches)  # type: ignore[misc]

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        pd, digest = self._pd, self._pd_digest
        if digest is not None and pd.side == "prefill":
            self._pd_digest_sends(getattr(connector_metadata, SENDS_ATTR, None) or {})
        if pd.side == "decode" and (pd.control_path or digest is not None) and pd.layout:
            connector_metadata = self._pd_hold_back(connector_metadata, pd.layout)
        super().bind_connector_metadata(connector_metadata)  # type: ignore[misc]

    def _pd_hold_back(self, metadata: Any, layout: str) -> Any:
        """Record each load's blocks; under stall (decode), hold selected loads back."""
        pd = self._pd
        c = pd.now_control() if pd.control_path else faults.OFF
        now = time.monotonic()
        found = loads(metadata, layout)
        keep: list[Load] = []
        for ld in found:
            if ld.awaited:
                if len(pd.blocks) >= _MAX_TRACKED:
                    pd.blocks.pop(next(iter(pd.blocks)))
                pd.blocks[ld.req] = ld.groups
                if self._pd_digest is not None:
                    self._pd_note_load(ld)
                stalls = c.mode == "stall" or (c.mode == "strand" and c.stall_s > 0)
                if stalls and c.applies_to("decode") and pd.candidate(ld.req):
                    ld.until = now + c.stall_s
                    pd.parked.append(ld)
                    pd.event("stall", ld.req, stall_s=c.stall_s, where="decode")
                    continue
            keep.append(ld)
        due = [ld for ld in pd.parked if ld.until <= now]
        if len(keep) == len(found) and not due:
            return metadata
        pd.parked = [ld for ld in pd.parked if ld.until > now]
        return with_loads(metadata, layout, keep + due)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)  # type: ignore[misc]
        return self._pd_transfers(results, self._pd_broken(results.finished_recving))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The wrapped connector's load errors, those :meth:`_pd_broken` took early included, and
        the blocks of loads the injector dropped where vLLM learns a failed load by its blocks."""
        errors = self._pd_wrapped_errors() | self._pd.load_errors
        self._pd.load_errors = set()
        return errors

    def _pd_wrapped_errors(self) -> set[int]:
        """The wrapped connector's load errors (drained: vLLM's connectors forget them once told);
        none where it has no such method (vLLM's base class has one; a stand-in may not)."""
        ask = getattr(super(), "get_block_ids_with_load_errors", None)
        return set(ask() or ()) if ask is not None else set()

    def _pd_broken(self, recving: Iterable[str]) -> set[str]:
        """The finished loads whose blocks the wrapped connector reported failed (now, or in the
        last ERROR_CALLS calls): no fault applies to them and the digest does not compare them.
        vLLM 0.32's Mooncake and 0.26's NIXL tell a failed pull only by its blocks
        (``get_block_ids_with_load_errors``, which vLLM calls after this step's finished loads):
        they are taken here, and told to vLLM unchanged when it asks. On the decode's worker, and
        only where the injector acts (faults or the digest)."""
        pd = self._pd
        if pd.side != "decode" or pd.role != "worker" or not (pd.control_path or self._pd_digest is not None):
            return set()
        pd.calls += 1
        own = self._pd_wrapped_errors()
        pd.load_errors |= own
        pd.error_seen.update(dict.fromkeys(own, pd.calls))
        pd.error_seen = {b: n for b, n in pd.error_seen.items() if pd.calls - n < ERROR_CALLS}
        return {r for r in recving if any(b in pd.error_seen for g in pd.blocks.get(r, ()) for b in g)}

    def _pd_transfers(self, results: Any, broken: set[str] | frozenset[str] = frozenset()) -> Any:
        """The faults and the digest on one worker snapshot of finished transfers (``results``:
        finished_sending, finished_recving, failed_recving; changed in place and returned);
        ``broken``: finished loads that failed by their blocks (:meth:`_pd_broken`), left alone."""
        pd = self._pd
        if pd.side == "prefill" and pd.control_path:
            return self._pd_strand(results)
        if pd.side != "decode" or not (pd.control_path or self._pd_digest is not None):
            return results
        c = pd.now_control() if pd.control_path else faults.OFF
        if c.mode not in faults.AFTER_LOAD and self._pd_digest is None:
            return results
        done = [r for r in sorted(results.finished_recving) if r not in results.failed_recving | broken]
        chosen = [r for r in done if pd.candidate(r)] if c.mode in faults.AFTER_LOAD else []
        if c.mode == "drop":
            for r in chosen:
                results.failed_recving.add(r)
                pd.event("drop", r)
        elif chosen:
            self._pd_corrupt(c, chosen)
        if self._pd_digest is not None:  # after any fault: what the scheduler will compute on
            self._pd_digest_loads([r for r in done if r not in results.failed_recving])
        for r in results.finished_recving:
            pd.blocks.pop(r, None)
        return results

    def _pd_strand(self, results: Any) -> Any:
        """strand: keep the selected finished sends from the scheduler (their blocks stay in use);
        once the mode is another, hand every kept one back (logged "release", in its epoch)."""
        pd = self._pd
        c = pd.now_control()
        if c.mode == "strand":
            for r in sorted(results.finished_sending):
                if pd.candidate(r):
                    pd.stranded[r] = c.epoch
                    pd.event("strand", r)
            results.finished_sending = {r for r in results.finished_sending if r not in pd.stranded}
        elif pd.stranded:
            for r, epoch in pd.stranded.items():
                pd.event("release", r, epoch=epoch)
            results.finished_sending = set(results.finished_sending) | set(pd.stranded)
            pd.stranded.clear()
        return results

    # ------------------------------------------------------------ KV digest (workers)

    def _pd_note_load(self, ld: Load) -> None:
        """The digest's view of a decode load: the key both sides know it by, and how many of its
        leading blocks it did not load (its own prefix-cache hits, where the meta lists them)."""
        digest = self._pd_digest
        assert digest is not None
        lay = digest.layout
        if lay is None:
            return
        if lay.key == "request_id":
            key = getattr(getattr(ld.meta, "remote", None), "request_id", None)
        else:
            key = getattr(ld.meta, lay.key, None)
        skip = 0
        if lay.recv_blocks == "all":
            computed = tuple(getattr(ld.meta, "local_num_computed_blocks", ()) or ())
            skip = int(computed[0]) if computed else 0
        if len(digest.loads) >= _MAX_TRACKED:
            digest.loads.pop(next(iter(digest.loads)))
        digest.loads[ld.req] = {"key": None if key is None else str(key), "skip": skip}

    def _pd_digest_loads(self, done: list[str]) -> None:
        digest, pd = self._pd_digest, self._pd
        assert digest is not None
        if not any(r in digest.loads for r in done):
            return
        rank = _tp_rank()
        if self._pd_digest_unable(rank):
            return
        assert digest.layout is not None
        for r in done:
            info = digest.loads.pop(r, None)
            groups = pd.blocks.get(r) or [[]]
            if info is None:
                continue
            ids = groups[0][info["skip"] :]
            kv = (pd.kv_caches, pd.block_dims)
            more = {"align": digest.layout.recv_blocks, "first": info["skip"], "listed": len(groups[0])}
            digest.record("load", r, info, kv, ids, rank=rank, **more)

    def _pd_digest_sends(self, sends: dict[str, dict[str, Any]]) -> None:
        digest, pd = self._pd_digest, self._pd
        assert digest is not None
        if not sends:
            return
        rank = _tp_rank()
        if self._pd_digest_unable(rank):
            return
        for r, info in sends.items():
            if info.get("groups", 1) > 1:
                digest.unavailable(
                    "a hybrid model: its requests have blocks in several KV cache groups", rank,
                    inapplicable=True,
                )  # fmt: skip
                continue
            full = min(len(info["blocks"]), info["num_tokens"] // digest.block_size)
            digest.record("send", r, info, (pd.kv_caches, pd.block_dims), info["blocks"], rank=rank,
                          num_tokens=info["num_tokens"], listed=len(info["blocks"]), full=full)  # fmt: skip

    def _pd_digest_unable(self, rank: int) -> bool:
        """Whether this worker cannot digest, after saying why in the side file: inapplicable where
        the digest does not cover the layout (a connector whose sends it cannot pair, a hybrid
        model), plain where it should have and could not (no KV tensors, no block dimension)."""
        digest = self._pd_digest
        assert digest is not None
        groups = getattr(self._pd_cache_config, "kv_cache_groups", None) or ()
        why: str | None
        if digest.layout is None:
            why = f"{self._pd_wraps}: its sends cannot be paired with loads (no send_layout in its spec)"
            digest.unavailable(why, rank, inapplicable=True)
        elif len(groups) > 1:
            why = f"a hybrid model: {len(groups)} KV cache groups (the digest covers models of one group)"
            digest.unavailable(why, rank, inapplicable=True)
        elif (why := self._pd_block_dims()) is not None:
            digest.unavailable(why, rank)
        return why is not None

    # ------------------------------------------------------------ zero / swap

    def _pd_corrupt(self, c: Control, reqs: list[str]) -> None:
        """Overwrite the chosen blocks of ``reqs`` (first KV cache group) with zeros, or with
        another request's blocks (swap: the first ``blocks`` share; mixup: all of them; whose:
        :func:`donors`); the last one's own blocks are kept as the next donor."""
        pd = self._pd
        why = self._pd_cannot_corrupt()
        share = 1.0 if c.mode == "mixup" else c.blocks  # mixup: the whole prompt's KV
        chosen = {r: faults.chosen_blocks((pd.blocks.get(r) or [[]])[0], share) for r in reqs}
        for r in reqs:
            if why or not chosen[r]:
                pd.event(c.mode, r, applied=False, reason=why or "no blocks recorded for this load")
        todo = [r for r in reqs if not why and chosen[r]]
        if not todo:
            return
        import torch

        def index(ids: list[int], t: Any) -> Any:
            return torch.tensor(ids, dtype=torch.long, device=t.device)

        if c.mode == "zero":
            for r in todo:
                for layer, t in pd.kv_caches.items():
                    t.index_fill_(pd.block_dims[layer], index(chosen[r], t), 0)
                pd.event("zero", r, blocks=len(chosen[r]))
            return
        saved = {
            r: {
                layer: t.index_select(pd.block_dims[layer], index(chosen[r], t)).clone()
                for layer, t in pd.kv_caches.items()
            }
            for r in todo
        }
        for r, donor in zip(todo, donors(c.mode, todo, saved, pd.donor), strict=True):
            if donor[0] == r:
                pd.event(c.mode, r, applied=False, reason="no other request's blocks received yet")
                continue
            for layer, t in pd.kv_caches.items():
                src = donor[1][layer]
                take = [j % src.shape[pd.block_dims[layer]] for j in range(len(chosen[r]))]
                dim = pd.block_dims[layer]
                t.index_copy_(dim, index(chosen[r], t), src.index_select(dim, index(take, src)))
            pd.event(c.mode, r, blocks=len(chosen[r]), donor=donor[0])
        pd.donor = (todo[-1], saved[todo[-1]])

    def _pd_cannot_corrupt(self) -> str | None:
        """Why zero / swap cannot run here (None when they can); finds each layer's block dimension."""
        pd = self._pd
        if not pd.layout:
            return f"{pd.wraps}: its loads' blocks are not known (its ConnectorSpec has no recv_layout)"
        return self._pd_block_dims()

    def _pd_block_dims(self) -> str | None:
        """Finds each layer's block dimension (once); why it cannot (None when it could)."""
        pd = self._pd
        if not pd.kv_caches:
            return "no KV cache tensors registered with the connector"
        if pd.block_dims:
            return None
        num_blocks = getattr(self._pd_cache_config, "num_blocks", None)
        dims = {}
        for layer, t in pd.kv_caches.items():
            at = [i for i, size in enumerate(t.shape) if size == num_blocks]
            if not at:
                return f"layer {layer}: no dimension of {tuple(t.shape)} has num_blocks={num_blocks}"
            dims[layer] = at[0]
        pd.block_dims = dims
        said = sorted(set(dims.values()))
        say(f"pd_sessions: fault injector: KV blocks are dimension {said} (num_blocks={num_blocks})")
        return None


def donors(
    mode: str, todo: list[str], saved: dict[str, Any], earlier: tuple[str, Any] | None
) -> list[tuple[str, Any]]:
    """Whose blocks each of ``todo`` (the loads finished together) takes, in order.

    swap : the one before it; the first takes ``earlier`` (the last of an earlier batch), or,
           with none, this batch's last
    mixup: loads finished together trade crosswise (each takes the one before it, the first the
           last: two trade theirs); one alone takes ``earlier``
    A load given its own blocks (one alone, nothing earlier) is not corrupted (the caller says so).
    """
    own = [(r, saved[r]) for r in todo]
    if (mode == "mixup" and len(todo) > 1) or earlier is None:
        return [own[i - 1] for i in range(len(own))]
    if mode == "mixup":
        return [earlier]
    return [earlier, *own[:-1]]


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 where vLLM's groups are not set up)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError, RuntimeError):
        return 0


@dataclass
class Transfers:
    """One worker snapshot of finished transfers, as vLLM's ``KVConnectorTransferResults`` has it
    (for a vLLM that has none: :class:`BeforeTransferResults`)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class BeforeTransferResults:
    """The worker hooks of a vLLM whose connectors have no ``get_transfer_results`` (0.26; put
    before :class:`FaultInjecting`). There the worker calls ``get_finished``, which returns
    (sending, recving), and right after it, in the same step, ``get_block_ids_with_load_errors``:
    a load that failed is one whose blocks are in that set (the scheduler then fails the request
    or recomputes those blocks, per ``kv_load_failure_policy``). The faults and the digest are
    :meth:`FaultInjecting._pd_transfers`' own, the connector's own load errors
    :meth:`FaultInjecting._pd_broken`'s (on the H100, 2026-12-05, a load NIXL failed when its
    prefill was killed was first digested as loaded: a false mismatch); only the shapes differ,
    and a dropped load is told by its blocks."""

    _pd: Injector

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)  # type: ignore[misc]
        blocks = {r: {b for g in self._pd.blocks.get(r, ()) for b in g} for r in recving or ()}
        broken = self._pd_broken(set(recving or ()))  # type: ignore[attr-defined]
        got = self._pd_transfers(Transfers(set(sending or ()), set(recving or ())), broken)  # type: ignore[attr-defined]
        self._pd.load_errors |= {b for r in got.failed_recving for b in blocks.get(r, ())}  # drops
        return (
            got.finished_sending if got.finished_sending or sending is not None else None,
            got.finished_recving if got.finished_recving or recving is not None else None,
        )
