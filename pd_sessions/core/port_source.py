"""What the planner asks for ports: the :class:`PortSource` protocol (``runtime.ports`` has the real one)."""

from __future__ import annotations

from typing import Protocol

# Every allocated port, single or block (a range a process scans upward from, e.g.
# VLLM_PORT), comes from below Linux's default ephemeral range (32768-60999), so kernel-chosen
# ports for outgoing connections and port-0 binds do not land on it between its release at the
# spawn and the server's bind, and above the ranges connector libraries pick their own ports
# from (Mooncake: 12001, 15000+).
BLOCK_RANGE = (20000, 32000)


class PortSource(Protocol):
    def take(self, label: str) -> int:
        """A free port."""

    def take_block(self, label: str, size: int) -> int:
        """The first of ``size`` consecutive free ports."""

    def claim(self, label: str, port: int) -> int:
        """An explicit port from a config: check it is free and hold it."""
