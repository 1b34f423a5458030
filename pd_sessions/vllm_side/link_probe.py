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
  gives the instances); the peer registers its buffer and sends its metadata; this process moves
  the bytes in ``--descriptors`` equal pieces with ``--op``: READ (the peer's buffer into its own:
  the decode pulls, as NixlConnector does; the default) or WRITE (its own buffer into the peer's:
  the prefill pushes, as NixlPushConnector does), each transfer timed from ``transfer()`` to DONE
  (vLLM's nixl_xfer_time measures the same span).
- ``mooncake``: both initialize a transfer engine as vLLM's MooncakeConnector does
  (``P2PHANDSHAKE``, ``--protocol``, ``--device-name``); the peer registers its buffer and reports
  its RPC port; this process writes the pieces with ``batch_transfer_sync_write`` (the prefill
  pushes, as in vLLM; ``--op`` WRITE, its default, is the only one), timed around the call as vLLM
  times its sends.

Two warm-up transfers (connection set-up), then ``--repeats`` timed ones. Then what was used and
what the hardware allows (see :func:`transports_used`, :func:`copy_limit`, :func:`nic`):

- ``transports``: the lanes the transport chose, and ``transports_source``, where that was read.
  NIXL: UCX's own report, its ``UCX_PROTO_INFO=y`` tables (pd_sessions.core.ucx) of the READ into
  (WRITE from) this device's memory, which the probe has UCX write to ``<out>.ucx.<pid>.log`` (unless
  ``UCX_PROTO_INFO`` or ``UCX_LOG_FILE`` is set already: then "unknown", saying why). Mooncake:
  the protocol its transfer engine was initialized with (and accepted); the engine reports
  nothing finer. ``advice``: when those lanes cannot reach the device's copy bandwidth, the
  setting to try (None otherwise).
- ``limit``: the physical limit of the same bytes on the same devices, timed as the transfers
  (warm-ups, ``--repeats``): ``cpu``: a copy out of a shared-memory segment that another process
  wrote (multiprocessing.shared_memory, ctypes.memmove); ``cuda``: a device-to-device copy on
  ``--gpu`` (a peer copy when ``--peer-gpu`` differs: from it for READ, to it for WRITE), timed
  with CUDA events.
- ``nic``: the interface ``--host`` is on and its line rate from ``/sys/class/net/<if>/speed``;
  loopback: no NIC; a rate the interface does not report (a veth): "unknown".

Writes ``--out``: ``{"transport", "op", "bytes", "descriptors", "seconds": [...], "transports",
"transports_source", "advice", "limit": {"name", "seconds"}, "nic"}``; exits 1 with the reason
on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ipaddress
import json
import mmap
import multiprocessing
import os
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pd_sessions.core import ucx
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
    op: str = "READ"  # READ: this process reads the peer's buffer; WRITE: it writes into the peer's


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
    conn.recv()  # "done": the buffer must live until the transfers are over


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
        handle = agent.initialize_xfer(args.op, local, remote_descs, remote, b"pd-probe")
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        took = time.perf_counter() - t0
        agent.release_xfer_handle(handle)
        if state == "ERR":
            raise RuntimeError(f"NIXL {args.op} ended in state ERR")
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
    if args.op != "WRITE":
        raise RuntimeError(f"the Mooncake probe only writes (batch_transfer_sync_write), not {args.op}")
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
    """What moved the bytes, between which memories, by which operation (for people)."""
    if args.connector == "nixl":
        return f"NIXL agents (UCX), {_nixl_mem(args.device)} to {_nixl_mem(args.device)}, {args.op}"
    return f"Mooncake transfer engine ({args.protocol}), {args.device} to {args.device}, {args.op}"


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


def probe(args: Args, out: Path | None = None) -> dict[str, Any]:
    """Run the peer and the timed transfers, then the limit; the result document. ``out``: where
    the document goes (UCX's log files go beside it)."""
    report = _report_setup(args, out)
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
    used, source, advice = transports_used(args, report)
    name, limit = copy_limit(args)
    return {
        "transport": transport_name(args),
        "op": args.op,
        "bytes": args.bytes,
        "descriptors": args.descriptors,
        "seconds": seconds,
        "transports": list(used),
        "transports_source": source,
        "advice": advice,
        "limit": {"name": name, "seconds": limit},
        "nic": nic(args.host),
    }


# ---------------------------------------------------------------- what was used


def _report_setup(args: Args, out: Path | None) -> Path | None:
    """NIXL: have UCX print its protocol tables to files beside ``out`` (inherited by the peer);
    the folder and file-name prefix they go to, or None when the environment set either already."""
    if args.connector != "nixl" or out is None:
        return None
    if "UCX_PROTO_INFO" in os.environ or "UCX_LOG_FILE" in os.environ:
        return None
    prefix = out.with_name(f"{out.name}.ucx")
    for old in prefix.parent.glob(f"{prefix.name}.*.log"):
        old.unlink(missing_ok=True)
    os.environ["UCX_PROTO_INFO"] = "y"
    os.environ["UCX_LOG_FILE"] = f"{prefix}.%p.log"
    return prefix


def transports_used(args: Args, report: Path | None) -> tuple[tuple[str, ...], str, str | None]:
    """(lanes, where they were read, advice) for the transfers just timed."""
    if args.connector == "mooncake":
        source = "the protocol Mooncake's TransferEngine.initialize accepted (it reports no finer path)"
        advice = None
        if args.device == "cuda" and args.protocol == "tcp":
            advice = "it used tcp, which stages GPU memory through sockets; mooncake_protocol selects another"
        return (args.protocol,), source, advice
    if report is None:
        return (), "unknown: UCX_PROTO_INFO or UCX_LOG_FILE was set by the environment", None
    ctypes.CDLL(None).fflush(None)  # UCX writes its log through stdio, flushed at exit otherwise
    logs = sorted(report.parent.glob(f"{report.name}.{os.getpid()}.log"))  # this process starts them
    text = "".join(p.read_text(errors="replace") for p in logs)
    operation = args.op.lower()
    used = ucx.lanes(text, operation, args.device)
    title = ucx.OPERATIONS[operation][0]
    source = f"UCX_PROTO_INFO=y: the '{title}' tables of {', '.join(p.name for p in logs)}"
    if not used:
        return (), f"unknown: no '{title}' table in UCX's log ({source})", None
    return used, source, ucx.advice(used, args.device, os.environ.get("UCX_TLS"), operation)


# ---------------------------------------------------------------- what the hardware allows


def _address(buf: Any) -> int:
    """The address of a writable buffer's first byte (no export outlives the call: it can close)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _shm_writer(name: str, size: int, conn: Connection) -> None:
    """The other process of the CPU limit: fills the segment, then waits until it is read."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=name)
    try:
        ctypes.memset(_address(shm.buf), 7, size)
        conn.send("ready")
        conn.recv()
    finally:
        shm.close()


def cpu_copy_limit(size: int, repeats: int) -> list[float]:
    """Seconds per copy of ``size`` bytes out of a shared-memory segment another process wrote,
    into this process's memory (one memmove, as cma's single copy)."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=size)
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    writer = ctx.Process(target=_shm_writer, args=(shm.name, size, theirs), daemon=True)
    writer.start()
    dst = mmap.mmap(-1, size)
    try:
        if not mine.poll(PEER_TIMEOUT_S):
            raise RuntimeError(f"the shared-memory writer sent nothing within {PEER_TIMEOUT_S:g} s")
        mine.recv()
        src, target = _address(shm.buf), _address(dst)  # valid while both stay mapped (until closed)

        def once() -> float:
            t0 = time.perf_counter()
            ctypes.memmove(target, src, size)
            return time.perf_counter() - t0

        return _timed(once, repeats)
    finally:
        with contextlib.suppress(OSError):
            mine.send("done")
        writer.join(timeout=30)
        if writer.is_alive():
            writer.terminate()
            writer.join(timeout=10)
        with contextlib.suppress(BufferError):
            dst.close()
            shm.close()
        shm.unlink()


def cuda_copy_limit(size: int, src_gpu: int, dst_gpu: int, repeats: int) -> list[float]:
    """Seconds per copy of ``size`` bytes from ``src_gpu`` to ``dst_gpu`` (the same GPU: a
    device-to-device copy), timed with CUDA events on ``dst_gpu``."""
    import torch

    torch.cuda.set_device(dst_gpu)
    src = torch.full((size,), 7, dtype=torch.uint8, device=f"cuda:{src_gpu}")
    dst = torch.empty(size, dtype=torch.uint8, device=f"cuda:{dst_gpu}")

    def once() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    return _timed(once, repeats)


def copy_limit(args: Args) -> tuple[str, list[float]]:
    """(what was copied, seconds per copy): the physical limit of ``args.bytes`` on the probe's
    devices, in the direction the transfers moved them (READ: from the peer's GPU; WRITE: to it)."""
    if args.device == "cuda":
        src, dst = (args.gpu, args.peer_gpu) if args.op == "WRITE" else (args.peer_gpu, args.gpu)
        name = f"GPU {src} to GPU {dst} peer copy" if src != dst else f"device-to-device copy on GPU {src}"
        return name, cuda_copy_limit(args.bytes, src, dst, args.repeats)
    name = "shared-memory copy between two processes"
    return name, cpu_copy_limit(args.bytes, args.repeats)


SYSFS_NET = Path("/sys/class/net")


def _interface_of(address: str) -> str | None:
    """The interface of this host that has the IPv4 ``address`` (SIOCGIFADDR), or None."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                if socket.inet_ntoa(raw[20:24]) == address:
                    return name
    return None


def nic(host: str, sysfs: Path = SYSFS_NET) -> dict[str, Any]:
    """The interface ``host`` is on and its line rate (GB/s) from sysfs, or why there is none."""
    try:
        address = str(ipaddress.ip_address(socket.gethostbyname(host)))
    except (OSError, ValueError):
        return {"interface": None, "gb_s": None, "note": f"unknown: {host!r} does not resolve to IPv4"}
    if ipaddress.ip_address(address).is_loopback:
        return {"interface": "lo", "gb_s": None, "note": "loopback: the probe's path crosses no NIC"}
    name = _interface_of(address)
    if name is None:
        return {"interface": None, "gb_s": None, "note": f"unknown: no interface here has {address}"}
    return line_rate(name, sysfs)


def line_rate(name: str, sysfs: Path = SYSFS_NET) -> dict[str, Any]:
    """Interface ``name``'s line rate from ``<sysfs>/<name>/speed`` (Mb/s), in GB/s; "unknown"
    when it reports none (a veth: -1 or EINVAL; a link that is down)."""
    path = sysfs / name / "speed"
    try:
        mbit = int(path.read_text().strip())
    except (OSError, ValueError):
        mbit = -1
    if mbit <= 0:
        return {"interface": name, "gb_s": None, "note": f"unknown: {name} reports no line rate ({path})"}
    return {"interface": name, "gb_s": mbit / 8000, "note": f"{mbit} Mb/s from {path}"}


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
    p.add_argument(
        "--op",
        choices=["READ", "WRITE"],
        default=None,
        help="nixl: READ (this process reads the peer's buffer, as the decode pulls; the default) or "
        "WRITE (it writes into the peer's, as the prefill pushes); mooncake: WRITE only (the default)",
    )
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
    if ns.transport == "mooncake" and ns.op == "READ":
        p.error("--op READ: the Mooncake probe only writes (batch_transfer_sync_write); give --op WRITE")
    op = ns.op or ("WRITE" if ns.transport == "mooncake" else "READ")
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
        op,
    )
    return args, ns.out


def main(argv: Sequence[str] | None = None) -> int:
    args, out = parse(argv)
    try:
        doc = probe(args, out)
    except Exception as e:  # the check reads the reason from the output file
        doc = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        out.write_text(json.dumps(doc))
        print(f"pd_sessions.vllm_side.link_probe: {doc['error']}", file=sys.stderr, flush=True)
        return 1
    out.write_text(json.dumps(doc))
    median = sorted(doc["seconds"])[len(doc["seconds"]) // 2]
    limit = sorted(doc["limit"]["seconds"])[len(doc["limit"]["seconds"]) // 2]
    print(
        f"pd_sessions.vllm_side.link_probe: {doc['transport']}: {args.bytes} bytes "
        f"in {args.descriptors} pieces, "
        f"median {median * 1e3:.3f} ms ({args.bytes / median / 1e9:.3f} GB/s) over "
        f"{', '.join(doc['transports']) or 'unknown lanes'} ({doc['transports_source']}); "
        f"{doc['limit']['name']}: {args.bytes / limit / 1e9:.3f} GB/s; NIC: {doc['nic']['note']}"
        + (f"; {doc['advice']}" if doc["advice"] else ""),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
