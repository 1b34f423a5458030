"""The ports of one plan: taken from a PortSource, each recorded under a label, none twice."""

from __future__ import annotations

from pd_sessions.core.errors import PlanError
from pd_sessions.core.port_source import PortSource


class PortLedger:
    """Wraps a PortSource and enforces uniqueness within one plan.

    ``taken`` lists (label, port) in the order taken; a block of N records ``label``,
    ``label+1`` ... ``label+N-1``. A port seen twice is a PlanError naming both labels.
    """

    def __init__(self, source: PortSource):
        self.source = source
        self.taken: list[tuple[str, int]] = []

    def _record(self, label: str, port: int) -> int:
        for other, p in self.taken:
            if p == port:
                raise PlanError(label, f"port {port} is already used by {other} in this plan")
        self.taken.append((label, port))
        return port

    def get(self, label: str, explicit: int | None = None) -> int:
        """One port: ``explicit`` (a config's own) claimed, or a free one taken."""
        if explicit is not None:
            return self._record(label, self.source.claim(label, explicit))
        return self._record(label, self.source.take(label))

    def block(self, label: str, size: int) -> int:
        """The first of ``size`` consecutive ports, each recorded."""
        base = self.source.take_block(label, size)
        for i in range(size):
            self._record(f"{label}+{i}" if i else label, base + i)
        return base
