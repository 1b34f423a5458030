"""The KV digest's observer: checksums of the KV blocks a prefill sent and a decode loaded.

It lives inside the fault-injecting connector (fault_connector.py), which the planner loads
whenever a config's checks include ``kv_digest``; its settings then carry the instance's side
file (``pd_sessions/core/digest_records.py`` says what is written). Without that setting nothing here
is created and the connector pays nothing.

- Prefill: ``request_finished`` (scheduler) is where vLLM hands a connector a finished request's
  blocks; those the connector holds for a send are noted there and travel to the workers on the
  next connector metadata (an attribute of it, :data:`SENDS_ATTR`). A worker digests them when it
  binds that metadata: the prefill has computed them and keeps them unchanged until the decode
  has taken them (a pull connector frees them only once the read is reported done; a push
  connector sends from them).
- Decode: the loads' blocks come from the worker metadata (the connector's ``recv_layout``); a
  load that ``get_transfer_results`` reports finished is digested there, after any injected
  fault: what the scheduler will compute on.

Per layer, one checksum per block: on the CPU ``zlib.crc32`` of the block's bytes; elsewhere a
torch reduction on the device (the block's 32-bit words, weighted by position, summed in 64-bit
integers: exact, so both sides get the same number for the same bytes).

Imports only the core (a lint contract); torch where it is needed.
"""

from __future__ import annotations

import os
import time
import zlib
from typing import Any

from pd_sessions.core import digest_records
from pd_sessions.core.connectors.base import SendLayout

SENDS_ATTR = "_pd_digest_sends"  # on the prefill's connector metadata: req -> Send
_MAX_PENDING = 4096


def method_for(device_type: str) -> str:
    return "crc32" if device_type == "cpu" else "wsum64"


def block_sums(t: Any, dim: int, ids: list[int]) -> list[int]:
    """One checksum per block ``ids`` of the KV tensor ``t`` (blocks along ``dim``)."""
    import torch

    if not ids:
        return []
    idx = torch.tensor(ids, dtype=torch.long, device=t.device)
    sel = t.index_select(dim, idx).movedim(dim, 0).contiguous()
    raw = sel.view(torch.uint8).reshape(len(ids), -1)
    if t.device.type == "cpu":
        return [zlib.crc32(row) for row in raw.numpy()]
    words = raw.view(torch.int32) if raw.shape[1] % 4 == 0 else raw
    weight = torch.arange(words.shape[1], device=t.device, dtype=torch.int64) % 65521 + 1
    return [int(v) for v in (words.to(torch.int64) * weight).sum(dim=1).tolist()]


class Observer:
    """One connector object's digest (scheduler or worker; prefill or decode)."""

    def __init__(self, path: str, *, side: str, layout: SendLayout | None, block_size: int, world: int):
        self.path = path
        self.side = side
        self.layout = layout
        self.block_size = block_size
        self.world = world
        self.pending: dict[str, dict[str, Any]] = {}  # prefill scheduler: sends not yet handed over
        self.loads: dict[str, dict[str, Any]] = {}  # decode worker: req -> its load's key and skip
        self.said: set[str] = set()
        self._fd: int | None = None

    # ------------------------------------------------------------ writing

    def write(self, kind: str, **fields: Any) -> None:
        if self._fd is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # one write per record, O_APPEND: the instance's ranks append whole lines
        os.write(self._fd, digest_records.line(kind=kind, side=self.side, pid=os.getpid(), **fields).encode())

    def unavailable(self, reason: str, rank: int, *, inapplicable: bool = False) -> None:
        """Say once why this process cannot digest; ``inapplicable``: the digest does not cover
        this layout (a hybrid model, a connector whose sends it cannot pair), rather than failing
        where it should work."""
        if reason not in self.said:
            self.said.add(reason)
            self.write("unavailable", reason=reason, rank=rank, world=self.world, inapplicable=inapplicable)

    # ------------------------------------------------------------ prefill scheduler

    def note_send(self, request: Any, block_ids: Any, delay_free: bool) -> None:
        """``request_finished``'s request and blocks: kept for the workers when the connector holds
        them for a send (``delay_free``)."""
        if not delay_free or self.layout is None:
            return
        groups = [list(g) for g in block_ids] if block_ids and isinstance(block_ids[0], (list, tuple)) else []
        if not groups:
            groups = [list(block_ids or ())]
        if self.layout.key == "request_id":
            key = request.request_id
        else:
            key = (getattr(request, "kv_transfer_params", None) or {}).get(self.layout.key)
        if len(self.pending) >= _MAX_PENDING:
            self.pending.pop(next(iter(self.pending)))
        self.pending[request.request_id] = {
            "key": None if key is None else str(key),
            "groups": len([g for g in groups if g]),
            "blocks": groups[0],
            "num_tokens": int(getattr(request, "num_computed_tokens", 0) or 0),
        }

    def hand_over(self, metadata: Any) -> Any:
        """Put the sends noted since the last metadata on ``metadata`` (for the workers)."""
        if self.pending and metadata is not None:
            setattr(metadata, SENDS_ATTR, dict(self.pending))
            self.pending.clear()
        return metadata

    # ------------------------------------------------------------ workers

    def record(
        self,
        kind: str,
        req: str,
        info: dict[str, Any],
        kv: tuple[dict[str, Any], dict[str, int]],
        ids: list[int],
        **more: Any,
    ) -> None:
        """Digest blocks ``ids`` of every layer of ``kv`` (its tensors and their block dimensions)
        and write them as one ``kind`` record of request ``req``."""
        t0 = time.perf_counter()
        caches, dims = kv
        sums = {layer: block_sums(t, dims[layer], ids) for layer, t in caches.items()}
        device = next(iter(caches.values())).device.type
        more["digest_s"] = round(time.perf_counter() - t0, 6)  # its own cost, said with it
        self.write(kind, req=req, key=info.get("key"), block_size=self.block_size, world=self.world,
                   method=method_for(device), layout=layout_of(caches, dims), blocks=ids, sums=sums,
                   **more)  # fmt: skip


def layout_of(kv_caches: dict[str, Any], dims: dict[str, int]) -> list[str]:
    """Each distinct dtype and block shape of the layers ("torch.bfloat16 (2, 16, 4, 32)")."""
    out = set()
    for layer, t in kv_caches.items():
        shape = tuple(s for i, s in enumerate(t.shape) if i != dims[layer])
        out.add(f"{t.dtype} {shape}")
    return sorted(out)
