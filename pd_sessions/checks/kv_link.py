"""Across hosts, proof that the KV crossed the link: part of the kv_transfer check.

On one machine, simulated hosts share a kernel and /dev/shm, so a "transfer" could be shared
memory in disguise; across real hosts a transfer could go over another path than the one meant.
So the byte counters of the hosts' interfaces (read on each host by its agent:
``/sys/class/net/<interface>/statistics``), from before the host's first process started to the
end of the check window, must have risen by at least the KV bytes the connector reports having
moved over the window (from the start, not the window's: a transfer just before the window may be
logged in it; the counters then include it too):

- a connector with metric evidence (NIXL): the bytes its metric says over the window (the spec's
  ``evidence.bytes``, e.g. the decode's ``vllm:nixl_bytes_transferred_sum``);
- a connector with log evidence (Mooncake): the prefill instances' "KV Transfer metrics" lines
  over the window, successes x their mean size (the spec's ``evidence.success`` and
  ``evidence.mean_mib``, e.g. ``Num successful transfers`` x ``Avg MB per transfer``; see
  :func:`logged_bytes`).

The KV flows from the prefill hosts to the decode hosts (NIXL's decode reads it, Mooncake's
prefill writes it): the decode hosts' received bytes and the prefill hosts' sent bytes must
each cover it. Both numbers are recorded in the result (``details["link"]``). A host serving
both roles moves its KV without crossing a link: that fails too.

Pure: :func:`evaluate`, :func:`logged_bytes`. The counters are read through the launcher.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

# The mean size field is rounded to 3 decimals of a MiB (Mooncake's "Avg MB per transfer"): take
# each line's mean this much lower, so the bytes reported are never over-counted.
MEAN_MIB_ROUNDING = 0.0005
_LINE = re.compile(r"KV Transfer metrics: (.*)$")

Counters = Mapping[str, tuple[int, int]]  # host -> (rx_bytes, tx_bytes) of its interface


def logged_bytes(log_text: str, count_field: str, mean_mib_field: str) -> float:
    """Bytes the "KV Transfer metrics" lines of ``log_text`` report: each line's ``count_field``
    (e.g. "Num successful transfers") x ``mean_mib_field`` (e.g. "Avg MB per transfer", MiB, less
    its rounding), in bytes."""
    total = 0.0
    for line in log_text.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        fields = dict(part.partition("=")[::2] for part in m.group(1).split(", "))
        try:
            n = float(fields.get(count_field, 0))
            avg = float(fields.get(mean_mib_field, 0))
        except ValueError:
            continue
        total += n * max(0.0, avg - MEAN_MIB_ROUNDING) * 2**20
    return total


def evaluate(
    before: Counters,
    after: Counters,
    *,
    prefill_hosts: Collection[str],
    decode_hosts: Collection[str],
    kv_bytes: float,
    source: str,
) -> tuple[str | None, dict[str, Any]]:
    """(failure reason or None, details) for the link proof.

    a host serves both roles                      -> fail: its KV never crosses a link
    counters missing for a host                   -> fail, naming it
    kv_bytes <= 0                                 -> fail: the connector reported no bytes
    decode hosts' rx rose < kv_bytes              -> fail: the KV did not come over the link
    prefill hosts' tx rose < kv_bytes             -> fail: it did not leave the prefill hosts
    otherwise                                     -> None
    """
    delta = {h: (after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in after if h in before}
    rx = sum(delta[h][0] for h in decode_hosts if h in delta)
    tx = sum(delta[h][1] for h in prefill_hosts if h in delta)
    details: dict[str, Any] = {
        "kv_bytes": kv_bytes,
        "kv_bytes_source": source,
        "decode_hosts_rx": rx,
        "prefill_hosts_tx": tx,
        "before": {h: list(v) for h, v in before.items()},
        "after": {h: list(v) for h, v in after.items()},
    }
    both = sorted(set(prefill_hosts) & set(decode_hosts))
    if both:
        return f"{', '.join(both)} serves prefill and decode: its KV never crosses a link", details
    missing = sorted(h for h in (*prefill_hosts, *decode_hosts) if h not in delta)
    if missing:
        return f"no interface counters for {', '.join(missing)}", details
    if kv_bytes <= 0:
        return f"the connector reported no KV bytes moved ({source})", details
    if rx < kv_bytes:
        return (
            f"the decode hosts ({', '.join(decode_hosts)}) received {rx} bytes over their interfaces, "
            f"less than the {kv_bytes:.0f} KV bytes {source}: the KV did not cross the link"
        ), details
    if tx < kv_bytes:
        return (
            f"the prefill hosts ({', '.join(prefill_hosts)}) sent {tx} bytes over their interfaces, "
            f"less than the {kv_bytes:.0f} KV bytes {source}: the KV did not cross the link"
        ), details
    return None, details


def said(details: Mapping[str, Any]) -> str:
    """The passing verdict's words."""
    return (
        f"the KV crossed the link: decode hosts received {details['decode_hosts_rx']} bytes, prefill "
        f"hosts sent {details['prefill_hosts_tx']}, >= {details['kv_bytes']:.0f} KV bytes "
        f"{details['kv_bytes_source']}"
    )
