"""Which configs of a sweep run side by side: waves packed by resources (pure).

A config needs its GPUs (cuda: every TP/DP rank of every instance its own GPU) or its cores
(cpu: one core per rank, at least). Configs whose needs fit on the host at once form a wave and
run concurrently, each on a disjoint share of the inventory (its own GPU ids, its own cores),
which the planner then places the config on as it would on a host of that size. A config alone
in its wave gets the whole inventory, exactly as a serial sweep gives it.

The sweep starts configs in the packing's order (wave after wave, each wave in the sweep's
order); a config starts once the configs before it that hold any of its GPUs or cores have
freed them (their engine cores and workers gone) and fewer than ``max_parallel`` configs hold
resources. A wave is therefore what runs at once at most, and the sweep's wall comes close to
the sum of its waves' longest configs.

Decisions (:func:`pack`):

| situation                                          | packing                                  |
| max_parallel 1                                     | one config per wave, whole inventory     |
| across hosts (--ray, --simulate-hosts)             | one per wave (max_parallel > 1 refused)  |
| a config needs more than the host has              | alone, whole inventory (the planner then |
|   (cuda: --share-gpus shares inside it; else       |   shares, or refuses it naming the GPUs) |
|   the planner's PlanError)                         |                                          |
| a config with explicit ports                       | alone (two configs cannot both bind them)|
| otherwise, in the sweep's order                    | first wave with room (fewer than         |
|                                                    |   max_parallel configs, enough free GPUs |
|                                                    |   or cores): there, its first free ones; |
|                                                    |   none: a new wave                       |

GPUs are never shared between configs, also with --share-gpus (that lets one config's instances
share GPUs when it needs more than there are). ``max_parallel`` None: as many as fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import UsageError
from pd_sessions.core.inventory import Inventory


@dataclass(frozen=True)
class Placed:
    """One config in a wave, with the share of the inventory it runs on."""

    index: int  # its position in the sweep
    name: str
    wave: int  # 0-based
    inventory: Inventory  # what its plan sees: its own GPUs/cores (alone in its wave: all)
    need: int  # GPUs (cuda) or cores (cpu) it needs

    def holds(self, platform: str) -> frozenset[str]:
        """The resources it holds while it runs: GPU ids (cuda) or cores (cpu), as strings."""
        if platform == "cuda":
            return frozenset(f"gpu {g}" for g in self.inventory.gpus)
        return frozenset(f"cpu {c}" for c in self.inventory.cpus)


@dataclass(frozen=True)
class Packing:
    platform: str
    max_parallel: int  # the most configs holding resources at once
    waves: tuple[tuple[Placed, ...], ...]
    reason: str = ""  # why configs run one at a time, when they must
    auto: bool = False  # max_parallel was not given: as many as fit

    @property
    def order(self) -> list[Placed]:
        """Every config in the order the sweep starts them: wave after wave."""
        return [p for wave in self.waves for p in wave]

    @property
    def parallel(self) -> bool:
        return any(len(w) > 1 for w in self.waves)

    def render(self) -> str:
        """The waves, as --dry-run shows them."""
        unit = "GPUs" if self.platform == "cuda" else "cores"
        most = "as many as fit at once" if self.auto else f"at most {self.max_parallel} at once"
        why = f" ({self.reason})" if self.reason else ""
        head = f"packing: {len(self.order)} config(s) in {len(self.waves)} wave(s), {most}{why}"
        lines = [head]
        for i, wave in enumerate(self.waves, 1):
            parts = [f"{p.name} ({p.need} {unit}: {_ids(p, self.platform)})" for p in wave]
            lines.append(f"  wave {i}: " + ", ".join(parts))
        return "\n".join(lines)


def _ids(p: Placed, platform: str) -> str:
    ids = p.inventory.gpus if platform == "cuda" else tuple(str(c) for c in p.inventory.cpus)
    return ",".join(ids) or "none"


def need(config: ClusterConfig, platform: str) -> int:
    """GPUs (cuda) or cores (cpu) ``config`` needs: one per rank of every instance."""
    return config.num_prefill * config.prefill_tp + config.num_decode * config.decode_ranks


def _fixed_ports(config: ClusterConfig) -> bool:
    return config.router_port is not None or bool(config.prefill_ports) or bool(config.decode_ports)


def pack(
    configs: Sequence[ClusterConfig],
    inv: Inventory,
    *,
    platform: str,
    max_parallel: int | None = None,
    across_hosts: bool = False,
) -> Packing:
    """The sweep's waves (see the module's table). ``max_parallel``: None = as many as fit;
    below 1, or above 1 across hosts, is a UsageError naming --max-parallel."""
    if max_parallel is not None and max_parallel < 1:
        raise UsageError(f"--max-parallel: got {max_parallel}; give 1 (one config at a time) or more")
    if across_hosts and max_parallel not in (None, 1):
        raise UsageError(
            f"--max-parallel {max_parallel}: across hosts (--ray, --simulate-hosts) configs run one "
            "at a time (each spreads over the hosts); leave it out or give 1"
        )
    limit = 1 if across_hosts else (max_parallel or len(configs) or 1)
    reason = "across hosts" if across_hosts else ("--max-parallel 1" if max_parallel == 1 else "")
    pool = list(inv.gpus) if platform == "cuda" else [str(c) for c in inv.cpus]
    waves: list[list[tuple[int, ClusterConfig, tuple[str, ...]]]] = []
    free: list[list[str]] = []
    for i, config in enumerate(configs):
        n = need(config, platform)
        alone = limit == 1 or n > len(pool) or _fixed_ports(config)
        slot = None if alone else _first_fit(waves, free, n, limit)
        if slot is None:
            waves.append([])
            free.append([] if alone else list(pool))
            slot = len(waves) - 1
            if alone:
                waves[slot].append((i, config, tuple(pool)))
                free[slot] = []
                continue
        taken, free[slot] = tuple(free[slot][:n]), free[slot][n:]
        waves[slot].append((i, config, taken))
    return Packing(
        platform=platform,
        max_parallel=limit,
        waves=tuple(
            tuple(
                Placed(i, c.name, w, _share(inv, platform, taken, whole=len(wave) == 1), need(c, platform))
                for i, c, taken in wave
            )
            for w, wave in enumerate(waves)
        ),
        reason=reason,
        auto=max_parallel is None and not across_hosts,
    )


def _first_fit(
    waves: list[list[tuple[int, ClusterConfig, tuple[str, ...]]]], free: list[list[str]], n: int, limit: int
) -> int | None:
    """The first wave with fewer than ``limit`` configs and ``n`` free resources, or None."""
    for w, wave in enumerate(waves):
        if len(wave) < limit and len(free[w]) >= n:
            return w
    return None


def _share(inv: Inventory, platform: str, taken: tuple[str, ...], *, whole: bool) -> Inventory:
    """The inventory a config's plan sees: all of it when it runs alone, else its own share."""
    if whole:
        return inv
    if platform == "cuda":
        return Inventory(gpus=taken, cpus=inv.cpus, gpu_source=inv.gpu_source, rdma_devices=inv.rdma_devices)
    return Inventory(
        gpus=inv.gpus,
        cpus=tuple(int(c) for c in taken),
        gpu_source=inv.gpu_source,
        rdma_devices=inv.rdma_devices,
    )
