"""The last lines of a log file (standard library only).

Shared by the edge that runs processes (process.Running.log_tail) and the pure report (a failed
config's log tails), so that neither has to import the other.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of ``path`` (read from its last 64 KiB), or a note saying why
    it could not be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        return f"(log unreadable: {e})"
    return "\n".join(deque(data.splitlines(), maxlen=lines))
