"""Port allocation on the bind address (edge).

The planner asks a :class:`PortSource` for ports; this module's
:class:`PortAllocator` is the real one. It keeps every port it hands out bound
(not listening) until :meth:`PortAllocator.release` is called right before the
processes start, so no two ports of one plan collide and nobody else can take
them in the meantime.
"""

from __future__ import annotations

import errno
import random
import socket
import threading

from pd_sessions.core.errors import PlanError
from pd_sessions.core.port_source import BLOCK_RANGE


def _bind(host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


def port_owner(port: int) -> str:
    """'pid 1234 (python3)' for the process listening on ``port``, if visible."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                if conn.pid:
                    try:
                        return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
                    except psutil.Error:
                        return f"pid {conn.pid}"
                return "a process this user cannot see"
    except (ImportError, OSError, PermissionError):
        pass
    return "owner not visible"


# Every port an allocator of this process handed out and then released (right before its
# process spawns, which binds it only once it is up, seconds later): never handed out again by
# this process, so configs planned side by side (run/packed.py) cannot take each other's ports
# in that window.
_given: set[int] = set()
_given_lock = threading.Lock()


def _taken_before(port: int) -> bool:
    with _given_lock:
        return port in _given


class PortAllocator:
    """Real PortSource. Use as a context manager, or call release()."""

    def __init__(self, host: str = "127.0.0.1", *, rng: random.Random | None = None):
        self.host = host
        self._held: list[socket.socket] = []
        self._ports: set[int] = set()
        self._rng = rng or random.Random()

    def take(self, label: str) -> int:
        """A free port in BLOCK_RANGE, below the kernel's ephemeral range: a port the kernel
        chose (a bind to port 0) lies in that range, where, once released at the spawn, any
        process's outgoing connection or port-0 bind could take it before the server binds it,
        seconds later (seen: a Mooncake prefill's bootstrap port taken so on a simulated host
        where another cluster was starting, "Address already in use" 30 s after the spawn)."""
        lo, hi = BLOCK_RANGE
        for _ in range(400):
            port = self._rng.randrange(lo, hi)
            if port in self._ports or _taken_before(port):
                continue
            try:
                s = _bind(self.host, port)
            except OSError:
                continue
            self._held.append(s)
            self._ports.add(port)
            return port
        raise PlanError(
            label, f"found no free port in {lo}-{hi} on {self.host} that this process did not hand out before"
        )

    def take_block(self, label: str, size: int) -> int:
        lo, hi = BLOCK_RANGE
        for _ in range(200):
            base = self._rng.randrange(lo, hi - size)
            if any(p in self._ports or _taken_before(p) for p in range(base, base + size)):
                continue
            got: list[socket.socket] = []
            try:
                for p in range(base, base + size):
                    got.append(_bind(self.host, p))
            except OSError:
                for s in got:
                    s.close()
                continue
            self._held.extend(got)
            self._ports.update(range(base, base + size))
            return base
        raise PlanError(label, f"found no {size} consecutive free ports in {lo}-{hi} on {self.host}")

    def claim(self, label: str, port: int) -> int:
        if port in self._ports:
            raise PlanError(label, f"port {port} is already used by this plan")
        try:
            s = _bind(self.host, port)
        except OSError as e:
            why = "already in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise PlanError(
                label,
                f"port {port} on {self.host} is {why} "
                f"(by {port_owner(port)}); pick another port or leave it unset "
                "to have one allocated",
            ) from None
        self._held.append(s)
        self._ports.add(port)
        return port

    def release(self) -> None:
        with _given_lock:
            _given.update(self._ports)
        for s in self._held:
            s.close()
        self._held.clear()

    def __enter__(self) -> PortAllocator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
