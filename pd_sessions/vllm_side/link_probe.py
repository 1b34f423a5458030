"""``python -m pd_sessions.vllm_side.link_probe``: what the KV transport alone moves between two processes
on this host, for the perf check's "x GB/s = y % of what the transport itself moves here".

Why ``python -m``: the transport's native libraries (NIXL, Mooncake's transfer engine) load in
processes of their own, with the instances' interpreter and environment (their GPUs, UCX
settings, the CPU lane's NIXL progress delay), never in the harness; a native crash ends the
probe alone.

Two processes, as vLLM's prefill and decode are: this one and a peer it starts (multiprocessing,
spawn), each with a buffer of ``--bytes`` on its device (``--device cpu``: an anonymous mapping;
``cuda``: a torch tensor on ``--gpu`` / ``--peer-gpu``, indices into CUDA_VISIBLE_DEVICES).

- ``nixl``: both create an agent as vLLM's NixlConnector does (``nixl._api``, UCX, 4 threads;
  with ``PD_SESSIONS_NIXL_PROGRESS_DELAY_US`` set, the same progress-thread delay the vLLM plugin
  gives the instances); the peer registers its buffer and sends its metadata; this process READs
  the bytes in ``--descriptors`` equal pieces (the decode pulls, as in vLLM), each transfer timed
  from ``transfer()`` to DONE (vLLM's nixl_xfer_time measures the same span).
- ``mooncake``: both initialize a transfer engine as vLLM's MooncakeConnector does
  (``P2PHANDSHAKE``, ``--protocol``, ``--device-name``); the peer registers its buffer and reports
  its RPC port; this process writes the pieces with ``batch_transfer_sync_write`` (the prefill
  pushes, as in vLLM), timed around the call as vLLM times its sends.

One warm-up transfer (connection set-up), then ``--repeats`` timed ones. Writes ``--out``:
``{"transport", "bytes", "descriptors", "seconds": [...]}``; exits 1 with the reason on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import multiprocessing
import os
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pd_sessions.vllm_side.vllm_plugin import apply_nixl_progress_delay

PEER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Args:
    connector: str  # the transport: its package's name (nixl | mooncake)
    device: str  # cpu | cuda
    bytes: int
    descriptors: int
    repeats: int
    host: str = "127.0.0.1"
    gpu: int = 0
    peer_gpu: int = 0
    protocol: str = "tcp"  # mooncake
    device_name: str = ""  # mooncake


class Buffer:
    """``size`` bytes on the device, and their address (kept alive with the object)."""

    def __init__(self, size: int, device: str, gpu: int):
        self.size = size
        self.device_id = gpu if device == "cuda" else 0
        if device == "cuda":
            import torch

            torch.cuda.set_device(gpu)
            self._keep: Any = torch.empty(size, dtype=torch.uint8, device=f"cuda:{gpu}")
            self._keep.fill_(7)
            torch.cuda.synchronize()
            self.addr = int(self._keep.data_ptr())
        else:
            self._keep = mmap.mmap(-1, size)
            self._keep.write(b"\x07" * min(size, 1 << 20))
            self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._keep))

    def pieces(self, n: int) -> list[tuple[int, int]]:
        """(address, length) of ``n`` equal pieces (the last takes the remainder)."""
        step = self.size // n
        return [(self.addr + i * step, step if i < n - 1 else self.size - step * (n - 1)) for i in range(n)]


# ---------------------------------------------------------------- NIXL


def _nixl_agent(name: str) -> Any:
    apply_nixl_progress_delay(os.environ)  # as the vLLM plugin does in every instance
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(num_threads=4))


def _nixl_mem(device: str) -> str:
    return "VRAM" if device == "cuda" else "DRAM"


def nixl_peer(args: Args, conn: Connection) -> None:
    agent = _nixl_agent(f"pd-probe-peer-{uuid.uuid4().hex[:8]}")
    buf = Buffer(args.bytes, args.device, args.peer_gpu)
    agent.register_memory([(buf.addr, buf.size, buf.device_id, "")], _nixl_mem(args.device))
    conn.send({"meta": agent.get_agent_metadata(), "addr": buf.addr, "dev": buf.device_id})
    conn.recv()  # "done": the buffer must live until the reads are over


def nixl_initiator(args: Args, conn: Connection) -> list[float]:
    agent = _nixl_agent(f"pd-probe-{uuid.uuid4().hex[:8]}")  # while the peer starts too
    buf = Buffer(args.bytes, args.device, args.gpu)
    mem = _nixl_mem(args.device)
    agent.register_memory([(buf.addr, buf.size, buf.device_id, "")], mem)
    peer = _recv(conn)
    remote = agent.add_remote_agent(peer["meta"])
    step = buf.size // args.descriptors
    local = agent.get_xfer_descs([(a, n, buf.device_id) for a, n in buf.pieces(args.descriptors)], mem)
    far = [(peer["addr"] + i * step, n, peer["dev"]) for i, (_, n) in enumerate(buf.pieces(args.descriptors))]
    remote_descs = agent.get_xfer_descs(far, mem)

    def once() -> float:
        handle = agent.initialize_xfer("READ", local, remote_descs, remote, b"pd-probe")
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        took = time.perf_counter() - t0
        agent.release_xfer_handle(handle)
        if state == "ERR":
            raise RuntimeError("NIXL READ ended in state ERR")
        return took

    return _timed(once, args.repeats)


# ---------------------------------------------------------------- Mooncake


def _mooncake_engine(args: Args) -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(args.host, "P2PHANDSHAKE", args.protocol, args.device_name)
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize returned {rc}")
    return engine


def mooncake_peer(args: Args, conn: Connection) -> None:
    engine = _mooncake_engine(args)
    buf = Buffer(args.bytes, args.device, args.peer_gpu)
    rc = engine.register_memory(buf.addr, buf.size)
    if rc != 0:
        raise RuntimeError(f"Mooncake register_memory returned {rc}")
    conn.send({"session": f"{args.host}:{engine.get_rpc_port()}", "addr": buf.addr})
    conn.recv()


def mooncake_initiator(args: Args, conn: Connection) -> list[float]:
    engine = _mooncake_engine(args)  # while the peer starts too
    buf = Buffer(args.bytes, args.device, args.gpu)
    rc = engine.register_memory(buf.addr, buf.size)
    if rc != 0:
        raise RuntimeError(f"Mooncake register_memory returned {rc}")
    peer = _recv(conn)
    pieces = buf.pieces(args.descriptors)
    src = [a for a, _ in pieces]
    dst = [peer["addr"] + (a - buf.addr) for a, _ in pieces]
    lengths = [n for _, n in pieces]

    def once() -> float:
        t0 = time.perf_counter()
        rc = engine.batch_transfer_sync_write(peer["session"], src, dst, lengths)
        took = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"Mooncake batch_transfer_sync_write returned {rc}")
        return took

    return _timed(once, args.repeats)


# ---------------------------------------------------------------- both


Side = Callable[[Args, Connection], Any]
TRANSPORTS: dict[str, tuple[Side, Side]] = {  # connector -> (peer, initiator)
    "nixl": (nixl_peer, nixl_initiator),
    "mooncake": (mooncake_peer, mooncake_initiator),
}


def transport_name(args: Args) -> str:
    if args.connector == "nixl":
        return f"NIXL agents (UCX), {_nixl_mem(args.device)} to {_nixl_mem(args.device)}"
    return f"Mooncake transfer engine ({args.protocol}), {args.device} to {args.device}"


WARMUPS = 2


def _timed(once: Callable[[], float], repeats: int) -> list[float]:
    for _ in range(WARMUPS):  # connection set-up, first registration lookups
        once()
    return [once() for _ in range(repeats)]


def _recv(conn: Connection) -> dict[str, Any]:
    if not conn.poll(PEER_TIMEOUT_S):
        raise RuntimeError(f"the peer process sent nothing within {PEER_TIMEOUT_S:g} s")
    msg = conn.recv()
    if "error" in msg:
        raise RuntimeError(f"the peer process failed: {msg['error']}")
    return dict(msg)


def _peer_main(args: Args, conn: Connection) -> None:
    """The peer process: its side of the transport, an error sent back instead of raised."""
    try:
        TRANSPORTS[args.connector][0](args, conn)
    except Exception as e:  # reported to the initiator, which fails with it
        conn.send({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})


def probe(args: Args) -> dict[str, Any]:
    """Run the peer and the timed transfers; the result document."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    peer = ctx.Process(target=_peer_main, args=(args, theirs), daemon=True)
    peer.start()
    try:
        seconds = TRANSPORTS[args.connector][1](args, mine)
    finally:
        with contextlib.suppress(OSError):  # the peer waits for this before it lets go of its buffer
            mine.send("done")
        peer.join(timeout=30)
        if peer.is_alive():
            peer.terminate()
            peer.join(timeout=10)
    return {
        "transport": transport_name(args),
        "bytes": args.bytes,
        "descriptors": args.descriptors,
        "seconds": seconds,
    }


def parse(argv: Sequence[str] | None = None) -> tuple[Args, Path]:
    p = argparse.ArgumentParser(prog="python -m pd_sessions.vllm_side.link_probe", description=__doc__)
    p.add_argument(
        "--transport",
        choices=sorted(TRANSPORTS),
        required=True,
        help="a connector package (its transport)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--bytes", type=int, required=True, help="bytes per transfer")
    p.add_argument("--descriptors", type=int, default=1, help="pieces per transfer")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--peer-gpu", type=int, default=0)
    p.add_argument("--protocol", default=None, help="Mooncake's protocol (tcp, rdma)")
    p.add_argument("--device-name", default=None, help="Mooncake's RDMA device allow-list")
    p.add_argument(
        "--kv-transfer-config",
        default="{}",
        help="the instances' --kv-transfer-config: Mooncake's protocol and device list unless given",
    )
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args(argv)
    if ns.bytes < 1 or not 1 <= ns.descriptors <= ns.bytes or ns.repeats < 1:
        p.error("need --bytes >= 1, 1 <= --descriptors <= --bytes and --repeats >= 1")
    try:
        kv = json.loads(ns.kv_transfer_config)
        extra = kv.get("kv_connector_extra_config") or {}
    except (ValueError, AttributeError):
        p.error(f"--kv-transfer-config: not a JSON object: {ns.kv_transfer_config!r}")
    # vLLM's Mooncake default is rdma; a probe without the instances' config: tcp
    protocol = ns.protocol or extra.get("mooncake_protocol") or ("rdma" if kv else "tcp")
    device_name = ns.device_name if ns.device_name is not None else extra.get("device_name", "")
    args = Args(
        ns.transport,
        ns.device,
        ns.bytes,
        ns.descriptors,
        ns.repeats,
        ns.host,
        ns.gpu,
        ns.peer_gpu,
        protocol,
        device_name,
    )
    return args, ns.out


def main(argv: Sequence[str] | None = None) -> int:
    args, out = parse(argv)
    try:
        doc = probe(args)
    except Exception as e:  # the check reads the reason from the output file
        doc = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        out.write_text(json.dumps(doc))
        print(f"pd_sessions.vllm_side.link_probe: {doc['error']}", file=sys.stderr, flush=True)
        return 1
    out.write_text(json.dumps(doc))
    median = sorted(doc["seconds"])[len(doc["seconds"]) // 2]
    print(
        f"pd_sessions.vllm_side.link_probe: {doc['transport']}: {args.bytes} bytes "
        f"in {args.descriptors} pieces, "
        f"median {median * 1e3:.3f} ms ({args.bytes / median / 1e9:.3f} GB/s)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
