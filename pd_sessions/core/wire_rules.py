"""Faults on the wire between the prefill and decode hosts (pure): the nftables ruleset, the tc
argv, and the parsing of their counters. ``runtime/wire_apply.py`` runs them on a host (its agent, in
its network namespace); ``checks/faults/wire_*.py`` hold the scenarios.

What the rules match: only the KV traffic between the two hosts. A packet is KV when it goes
between the prefill host's address and the decode host's, to or from a port one of the two
instances' process trees listens on (other than its HTTP port): NIXL's side channel and UCX's
listeners, Mooncake's bootstrap server and transfer engine. The router's HTTP (from the driver's
host) and Ray's control traffic (each node with the head, Ray's own ports) never match. The ports
are read from the running instances (runtime/wire_apply.py), not guessed.

The table lives on the decode host, which sees every KV packet: from the prefill on its input
hook, to the prefill on its output hook. Its name is fixed (:data:`TABLE`), so a table a killed
run left behind is replaced by the next scenario and removed by its end::

    table inet pds_wire {
        counter seen { }
        counter dropped { }
        chain input  { type filter hook input priority -10; policy accept;
                       ip saddr P ip daddr D tcp sport { P ports } jump kv
                       ip saddr P ip daddr D tcp dport { D ports } jump kv }
        chain output { type filter hook output priority -10; policy accept;
                       ip saddr D ip daddr P tcp dport { P ports } jump kv
                       ip saddr D ip daddr P tcp sport { D ports } jump kv }
        chain kv     { counter name "seen"
                       numgen random mod 100 < RATE counter name "dropped" drop }
    }

RATE 100 is a partition (every KV packet dropped). The proof the fault bit is the ``dropped``
counter above zero; ``seen`` says how many KV packets passed the rules meanwhile.

The bandwidth cap is a tbf qdisc on the prefill host's interface: the KV leaves there (NIXL's
decode reads it, Mooncake's prefill writes it; both ways the bytes flow prefill -> decode), so a
cap on the decode's own egress would shape only acknowledgements. Its proof: tbf's ``overlimits``
or ``drops`` above zero. A delay needs netem; a kernel without it answers "Specified qdisc kind
is unknown" (:func:`netem_missing`), and the delay scenario says so.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

TABLE = "pds_wire"
FAMILY = "inet"
SEEN, DROPPED = "seen", "dropped"
# nft's priority for our chains: before the default filter chains (0) a user may have.
PRIORITY = -10
NO_NETEM = "Specified qdisc kind is unknown"


@dataclass(frozen=True)
class KvPath:
    """The two ends of the KV path: each host's address and the ports its instance listens on."""

    prefill: str  # the prefill host's address
    decode: str  # the decode host's address
    prefill_ports: tuple[int, ...]
    decode_ports: tuple[int, ...]

    def __post_init__(self) -> None:
        """ValueError naming the field: addresses are IPv4, different; ports 1..65535, some."""
        for name in ("prefill", "decode"):
            try:
                ipaddress.IPv4Address(getattr(self, name))
            except ValueError:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not an IPv4 address") from None
        if self.prefill == self.decode:
            raise ValueError(
                f"prefill and decode are both {self.prefill}: the KV never crosses a wire between hosts"
            )
        for name in ("prefill_ports", "decode_ports"):
            bad = [p for p in getattr(self, name) if not 0 < p < 65536]
            if bad:
                raise ValueError(f"{name}: {bad} are not ports")
        if not self.prefill_ports and not self.decode_ports:
            raise ValueError(
                "prefill_ports, decode_ports: neither instance listens on a KV port: nothing to match"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "prefill_ports": list(self.prefill_ports),
            "decode_ports": list(self.decode_ports),
        }


def _ports(ports: Collection[int]) -> str:
    return "{ " + ", ".join(str(p) for p in sorted(set(ports))) + " }"


def ruleset(path: KvPath, percent: int) -> str:
    """The nft script (for ``nft -f -``) that drops ``percent`` % of the KV packets between the
    two hosts (100: all of them, a partition), replacing any table of that name."""
    if isinstance(percent, bool) or not isinstance(percent, int) or not 0 < percent <= 100:
        raise ValueError(f"percent: got {percent!r}; allowed: an integer from 1 to 100")
    p, d = path.prefill, path.decode
    into, out = [], []
    if path.prefill_ports:
        into.append(f"ip saddr {p} ip daddr {d} tcp sport {_ports(path.prefill_ports)} jump kv")
        out.append(f"ip saddr {d} ip daddr {p} tcp dport {_ports(path.prefill_ports)} jump kv")
    if path.decode_ports:
        into.append(f"ip saddr {p} ip daddr {d} tcp dport {_ports(path.decode_ports)} jump kv")
        out.append(f"ip saddr {d} ip daddr {p} tcp sport {_ports(path.decode_ports)} jump kv")
    drop = (
        f'counter name "{DROPPED}" drop'
        if percent == 100
        else f'numgen random mod 100 < {percent} counter name "{DROPPED}" drop'
    )
    hook = "type filter hook {} priority " + str(PRIORITY) + "; policy accept;"
    lines = [
        f"table {FAMILY} {TABLE}",  # made if absent, so the delete below never fails
        f"delete table {FAMILY} {TABLE}",
        f"table {FAMILY} {TABLE} {{",
        f"  counter {SEEN} {{ }}",
        f"  counter {DROPPED} {{ }}",
        "  chain kv {",
        f'    counter name "{SEEN}"',
        f"    {drop}",
        "  }",
        "  chain input {",
        f"    {hook.format('input')}",
        *(f"    {r}" for r in into),
        "  }",
        "  chain output {",
        f"    {hook.format('output')}",
        *(f"    {r}" for r in out),
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def remove_script() -> str:
    """The nft script that removes the table, present or not."""
    return f"table {FAMILY} {TABLE}\ndelete table {FAMILY} {TABLE}\n"


def counters(nft_json: str) -> dict[str, int]:
    """Packets per named counter of our table, from ``nft -j list counters table inet pds_wire``
    (``{"seen": N, "dropped": M}``); ValueError when the output is not nft's JSON."""
    doc = json.loads(nft_json)
    if not isinstance(doc, dict) or "nftables" not in doc:
        raise ValueError(f"not nft's JSON output: {nft_json[:120]!r}")
    out: dict[str, int] = {}
    for item in doc["nftables"]:
        c = item.get("counter") if isinstance(item, dict) else None
        if isinstance(c, dict) and c.get("table") == TABLE:
            out[str(c["name"])] = int(c.get("packets", 0))
    return out


def tbf_argv(ifname: str, *, rate_kbit: int, burst_bytes: int, latency_ms: int) -> list[str]:
    """``tc qdisc replace dev IF root tbf rate ... burst ... latency ...``."""
    return [
        "tc",
        "qdisc",
        "replace",
        "dev",
        ifname,
        "root",
        "tbf",
        "rate",
        f"{rate_kbit}kbit",
        "burst",
        str(burst_bytes),
        "latency",
        f"{latency_ms}ms",
    ]


def netem_argv(ifname: str, *, delay_ms: int) -> list[str]:
    return ["tc", "qdisc", "replace", "dev", ifname, "root", "netem", "delay", f"{delay_ms}ms"]


def qdisc_del_argv(ifname: str) -> list[str]:
    """Back to the interface's default root qdisc."""
    return ["tc", "qdisc", "del", "dev", ifname, "root"]


def qdisc_stats(tc_json: str, kind: str) -> dict[str, int] | None:
    """The root qdisc of ``kind``'s statistics from ``tc -s -j qdisc show dev IF``
    (bytes, packets, drops, overlimits), or None when the root qdisc is another kind."""
    doc = json.loads(tc_json or "[]")
    if not isinstance(doc, list):
        raise ValueError(f"not tc's JSON output: {tc_json[:120]!r}")
    for q in doc:
        if isinstance(q, Mapping) and q.get("kind") == kind and q.get("root", False):
            return {k: int(q.get(k, 0)) for k in ("bytes", "packets", "drops", "overlimits")}
    return None


def netem_missing(stderr: str) -> bool:
    """Whether tc's answer to adding a netem qdisc says this kernel has no netem."""
    return NO_NETEM.lower() in stderr.lower()
