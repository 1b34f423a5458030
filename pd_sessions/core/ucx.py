"""What UCX itself says it chose, read from its log (pure: the link probe hands in the text).

With ``UCX_PROTO_INFO=y`` (UCX 1.14 and later; 1.23.0 in nixl-cu12/cu13 1.5.1) every UCP worker
prints, for each endpoint configuration, one table per operation and memory type: a title row
naming the operation ("remote memory read by ucp_get*(multi) into host memory from host") and rows
of ``| Range | Description | Config |``, whose Config column names the transport lanes as
``<transport>/<device>`` (``cma/memory``, ``tcp/lo``, ``cuda_ipc/cuda``, ``rc_mlx5/mlx5_0:1``;
several lanes as "50% on a/x and 50% on b/y"). Recorded on the CPU lane (2026-12-05):

    [1796470853.562976] [vm:32056:0]   | pd-probe-e90566ce intra-node cfg#1                               |
    [1796470853.562976] [vm:32056:0]   | remote memory read by ucp_get*(multi) into host memory from host |
    ...
    [1796470853.562976] [vm:32056:0]   | 0..inf | zero-copy   | cma/memory                                |

A WRITE's table is titled the other way round, "remote memory write by ucp_put*(multi) from host
memory to host" (UCX's proto_debug.c: "into ... from" for fetching operations, "from ... to" for
the others). :func:`lanes` returns the lanes of the tables of one operation between one memory
type (the link probe's READ or WRITE of DRAM or VRAM); :func:`advice` says, for a device, whether
those lanes are the ones that can reach the device's copy bandwidth, and which setting to try when
they are not.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# the table rows UCX prints, after its "[time] [host:pid:thread]" prefix
_ROW = re.compile(r"^\[[^]]*\]\s*\[[^]]*\]\s*\|(.*)\|\s*$")
_BORDER = re.compile(r"^\[[^]]*\]\s*\[[^]]*\]\s*\+[-+]*\+\s*$")
_LANE = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_.:\-]+)")
# operation -> (its title's start, its title's memory phrase, a regex with {m} for the memory type:
# "{m} memory" on the CPU lane, "{m}/<device>" on a GPU, e.g. "into cuda/GPU0 from cuda/dev[1]",
# as UCX 1.23 printed it on an H200, 2026-12-05)
_MEM = r"{m}(?: memory|/\S+)"
OPERATIONS = {
    "read": ("remote memory read", rf"into {_MEM} from {{m}}\b"),
    "write": ("remote memory write", rf"from {_MEM} to {{m}}\b"),
}
MEMORY = {"cpu": "host", "cuda": "cuda"}  # the probe's --device -> UCX's memory type name

# Transports that move the bytes without the network stack, per device (UCX's names):
# shared memory / cross-memory attach between processes of one host, CUDA IPC between GPUs' memory.
FAST = {"cpu": ("cma", "posix", "sysv", "xpmem", "knem"), "cuda": ("cuda_ipc",)}


def _tables(text: str) -> list[list[list[str]]]:
    """Each table of the log: its rows, each a list of cell texts (the title rows have one cell;
    a title row after a row of several cells begins the next table; border rows are skipped)."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if m is None:
            if _BORDER.match(line.strip()) is None and current:
                tables.append(current)
                current = []
            continue
        cells = [c.strip() for c in m.group(1).split("|")]
        if len(cells) == 1 and current and len(current[-1]) > 1:
            tables.append(current)
            current = []
        current.append(cells)
    if current:
        tables.append(current)
    return tables


def lanes(text: str, operation: str = "read", device: str = "cpu") -> tuple[str, ...]:
    """The ``transport/device`` lanes of the UCX_PROTO_INFO tables of ``operation`` ("read" or
    "write") into and from ``device``'s memory ("cpu": host, "cuda"), self endpoints left out;
    in order of first appearance; () when the log has none (UCX_PROTO_INFO unset, or no such
    transfer)."""
    what, phrase = OPERATIONS[operation]
    memory = re.compile(phrase.format(m=MEMORY[device]))
    found: dict[str, None] = {}
    for table in _tables(text):
        titles = [row[0] for row in table if len(row) == 1]
        if any(" self cfg#" in t for t in titles):
            continue
        if not any(t.startswith(what) and memory.search(t) for t in titles):
            continue
        for row in table:
            if len(row) >= 3 and row[0] != "Range":
                for tl, dev in _LANE.findall(row[-1]):
                    found.setdefault(f"{tl}/{dev}", None)
    return tuple(found)


def transports(lane_names: Sequence[str]) -> tuple[str, ...]:
    """The transport part of each lane (``cma/memory`` -> ``cma``), without repeats."""
    return tuple(dict.fromkeys(lane.split("/", 1)[0] for lane in lane_names))


def advice(
    lane_names: Sequence[str], device: str, tls: str | None = None, operation: str = "read"
) -> str | None:
    """None when a lane is one of ``device``'s fast transports (FAST); else what it used, what it
    did not, and the setting to try for ``operation`` ("read" or "write"). ``tls``: UCX_TLS as the
    probe ran with it (None: unset), named when it is what left the fast transports out."""
    used = transports(lane_names)
    fast = FAST[device]
    if any(t in fast for t in used):
        return None
    seen = ", ".join(used) if used else "no lane UCX reported"
    if device == "cuda":
        chosen = f" (UCX_TLS={tls} here)" if tls else ""
        if operation == "write":  # cuda_ipc's put zcopy has no enable switch (only ENABLE_GET_ZCOPY)
            return (
                f"it used {seen}, not cuda_ipc{chosen}; UCX 1.23 offers CUDA IPC writes (put) without a "
                "setting, so UCX_TLS or the host left it out: set UCX_TLS=cuda_ipc,cuda_copy,tcp (or leave "
                "it unset); UCX_CUDA_IPC_ENABLE_GET_ZCOPY is for reads only"
            )
        return (
            f"it used {seen}, not cuda_ipc{chosen}; UCX 1.23 offers CUDA IPC reads (get) by default only "
            "over NVLink: set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, then UCX_TLS=cuda_ipc,cuda_copy,tcp "
            "(docs/notes/gpu-verification.md, 2026-12-05)"
        )
    shm = ", ".join(fast[:2])
    if tls:
        return (
            f"it used {seen}, not shared memory ({shm}): UCX_TLS={tls} leaves it out (the planner sets "
            "tcp across hosts, where shared memory would not cross the link)"
        )
    return f"it used {seen}, not shared memory ({shm}); set UCX_TLS=sm,tcp or see docs/cpu-lane.md"
