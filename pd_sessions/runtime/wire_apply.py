"""Faults on the wire, applied on this host, in this process's network namespace (edge): nftables
rules through ``nft -f -``, qdiscs through ``tc``, their counters, and the KV ports an instance's
process tree listens on. What is applied is decided in core/wire_rules.py (its docstring has the rules).

Across hosts each call runs on the host concerned, in its node agent (runtime/raylaunch.py,
``NodeAgent.wire``): the agent lives in that host's network (a simulated host's namespace, or a
real host), so ``nft`` and ``tc`` act there. They need CAP_NET_ADMIN there and the ``nft``
command (Debian ``nftables``) and ``tc`` (``iproute2``); without them :func:`missing` says what
to install, before anything is applied.

Every operation is named in :data:`OPS`: the agent runs only those.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

import psutil

from pd_sessions.core import wire_rules
from pd_sessions.core.errors import HostSetupError

TIMEOUT_S = 20.0


def _run(
    argv: Sequence[str], *, stdin: str | None = None, step: str, check: bool = True
) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of ``argv``; HostSetupError naming ``step`` when it cannot
    start or, with ``check``, fails."""
    try:
        out = subprocess.run(
            list(argv), input=stdin, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostSetupError(f"wire faults: {step}: `{' '.join(argv)}`: {e}") from e
    if check and out.returncode != 0:
        raise HostSetupError(
            f"wire faults: {step}: `{' '.join(argv)}` failed: {out.stderr.strip() or out.returncode}"
        )
    return out.returncode, out.stdout, out.stderr


def missing() -> list[str]:
    """What this host lacks for the wire faults, each with how to get it; [] when nothing."""
    out = []
    if shutil.which("nft") is None:
        out.append("the `nft` command: apt-get install nftables")
    if shutil.which("tc") is None:
        out.append("the `tc` command: apt-get install iproute2")
    return out


def drop(path: dict[str, Any], percent: int) -> None:
    """Drop ``percent`` % of the KV packets of ``path`` (core.wire_rules.KvPath's fields)."""
    p = wire_rules.KvPath(
        path["prefill"], path["decode"], tuple(path["prefill_ports"]), tuple(path["decode_ports"])
    )
    _run(
        ["nft", "-f", "-"],
        stdin=wire_rules.ruleset(p, percent),
        step=f"dropping {percent} % of the KV packets",
    )


def heal() -> None:
    """Remove the table (present or not)."""
    _run(
        ["nft", "-f", "-"],
        stdin=wire_rules.remove_script(),
        step=f"removing table {wire_rules.FAMILY} {wire_rules.TABLE}",
    )


def rules_present() -> bool:
    code, _, _ = _run(
        ["nft", "list", "table", wire_rules.FAMILY, wire_rules.TABLE], step="listing the table", check=False
    )
    return code == 0


def counters() -> dict[str, int]:
    """The table's named counters (packets): {"seen": N, "dropped": M}."""
    _, out, _ = _run(
        ["nft", "-j", "list", "counters", "table", wire_rules.FAMILY, wire_rules.TABLE],
        step="reading the counters",
    )
    return wire_rules.counters(out)


def cap(ifname: str, rate_kbit: int, burst_bytes: int, latency_ms: int) -> None:
    _run(
        wire_rules.tbf_argv(ifname, rate_kbit=rate_kbit, burst_bytes=burst_bytes, latency_ms=latency_ms),
        step=f"capping {ifname} at {rate_kbit} kbit/s",
    )


def delay(ifname: str, delay_ms: int) -> str | None:
    """Add a netem delay; None when applied, else tc's message (no netem in this kernel: see
    core.wire_rules.netem_missing). Other failures raise."""
    code, _, err = _run(wire_rules.netem_argv(ifname, delay_ms=delay_ms), step="adding netem", check=False)
    if code == 0:
        return None
    if wire_rules.netem_missing(err):
        return err.strip()
    raise HostSetupError(f"wire faults: adding netem on {ifname}: {err.strip() or code}")


def qdisc(ifname: str, kind: str) -> dict[str, int] | None:
    """The root qdisc's statistics when it is ``kind``, else None."""
    _, out, _ = _run(["tc", "-s", "-j", "qdisc", "show", "dev", ifname], step=f"reading {ifname}'s qdisc")
    return wire_rules.qdisc_stats(out, kind)


def uncap(ifname: str, kind: str) -> bool:
    """Remove the root qdisc when it is ``kind`` (ours); whether one was removed."""
    if qdisc(ifname, kind) is None:
        return False
    _run(wire_rules.qdisc_del_argv(ifname), step=f"removing the {kind} qdisc of {ifname}")
    return True


def kv_ports(pid: int, exclude: Sequence[int], address: str) -> list[int]:
    """The TCP ports the process ``pid`` and its descendants listen on at ``address`` (or every
    address), less ``exclude`` (its HTTP port): the KV connector's ports on this host."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error as e:
        raise HostSetupError(f"wire faults: the instance's process {pid} is gone: {e}") from e
    ports: set[int] = set()
    for p in procs:
        with contextlib.suppress(psutil.Error):
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.ip in (address, "0.0.0.0", "::"):
                    ports.add(int(c.laddr.port))
    return sorted(ports - set(exclude))


OPS: dict[str, Callable[..., Any]] = {
    "missing": missing,
    "drop": drop,
    "heal": heal,
    "rules_present": rules_present,
    "counters": counters,
    "cap": cap,
    "delay": delay,
    "qdisc": qdisc,
    "uncap": uncap,
    "kv_ports": kv_ports,
}


def call(op: str, kwargs: dict[str, Any]) -> Any:
    """Run operation ``op`` of :data:`OPS` (ValueError naming the known ones)."""
    if op not in OPS:
        raise ValueError(f"unknown wire operation {op!r}; known: {', '.join(OPS)}")
    return OPS[op](**kwargs)
