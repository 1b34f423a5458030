"""Which instance goes where: one slot per vLLM instance, with its GPUs (cuda) or cores (cpu).

Placement decides devices only; ports, env and argv are rendered per slot afterwards
(``instance``). Prefill instances come first, then decode instances, on GPUs and on cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import PlanError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan.across_hosts import Assignment, HostFacts


@dataclass(frozen=True)
class Slot:
    """One vLLM instance's place in the plan: who it is, its ranks and what it runs on."""

    role: str  # "prefill" | "decode"
    index: int  # within its role
    tp: int  # --tensor-parallel-size
    dp: int  # --data-parallel-size (decode instances; 1 for prefill)
    gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES (cuda)
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND (cpu)
    http_port: int | None = None  # the config's explicit HTTP port; None: one is allocated
    host: HostFacts | None = None  # across hosts: the host it runs on; None: this one

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


@dataclass(frozen=True)
class Placement:
    prefill: tuple[Slot, ...]
    decode: tuple[Slot, ...]
    shared_gpus: bool  # instances share GPUs (--share-gpus, too few GPUs)
    warnings: tuple[str, ...]


def place(config: ClusterConfig, inv: Inventory, *, platform: str, share_gpus: bool) -> Placement:
    """One slot per instance, prefill first.

    platform  devices                                          warning
    cuda      place_gpus: disjoint GPU sets, or shared ones    when instances share GPUs
              (--share-gpus); too few GPUs is a PlanError
    cpu       place_cpus: a core list per TP rank              when ranks share cores
    """
    n_p, n_d = config.num_prefill, config.num_decode
    if platform == "cuda":
        p_gpus, d_gpus, shared = place_gpus(config, inv, share=share_gpus)
        said = [_shared_gpus_warning(config, inv)] if shared else []
        return _placement(config, (p_gpus, [None] * n_p), (d_gpus, [None] * n_d), shared, said)
    p_binds, d_binds, said = place_cpus(config, inv)
    return _placement(config, ([()] * n_p, p_binds), ([()] * n_d, d_binds), False, said)


Devices = tuple[Sequence[tuple[str, ...]], Sequence[str | None]]  # per instance: (GPUs, cpu bind)


def _placement(
    config: ClusterConfig, prefill: Devices, decode: Devices, shared: bool, warnings: Sequence[str]
) -> Placement:
    return Placement(
        prefill=_slots("prefill", config.prefill_tp, 1, config.prefill_ports, prefill),
        decode=_slots("decode", config.decode_tp, config.decode_dp, config.decode_ports, decode),
        shared_gpus=shared,
        warnings=tuple(warnings),
    )


def _slots(role: str, tp: int, dp: int, ports: Sequence[int], devices: Devices) -> tuple[Slot, ...]:
    """The slots of one role, in order (``ports``: the config's explicit HTTP ports, or none)."""
    gpus, binds = devices
    return tuple(
        Slot(role, i, tp, dp, gpus[i], binds[i], ports[i] if ports else None) for i in range(len(gpus))
    )


def _shared_gpus_warning(config: ClusterConfig, inv: Inventory) -> str:
    return (
        f"--share-gpus: {config.shape} shares GPUs {','.join(inv.gpus)}; each "
        f"instance gets --kv-cache-memory-bytes {config.shared_kv_cache_bytes} "
        "instead of a share of --gpu-memory-utilization (profiling races)"
    )


def place_gpus(
    config: ClusterConfig, inv: Inventory, *, share: bool = False
) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]], bool]:
    """GPU sets: prefill instances first, then decode instances. Returns (prefill, decode, shared).

    enough GPUs             -> disjoint sets, shared = False
    too few, share=False    -> PlanError "needs N GPUs, M visible: ..."
    too few, share=True     -> sets taken round-robin over the visible GPUs (instances
                               share), shared = True; each instance's own ranks stay on
                               distinct GPUs when it has at most as many ranks as GPUs
    no GPU at all           -> PlanError, shared or not
    """
    need = config.num_prefill * config.prefill_tp + config.num_decode * config.decode_ranks
    seen = ",".join(inv.gpus) if inv.gpus else "none"
    if need > len(inv.gpus) and (not share or not inv.gpus):
        raise PlanError(
            "gpus",
            f"config {config.name} needs {need} GPUs "
            f"({config.shape}), {len(inv.gpus)} visible: {seen} "
            f"(from {inv.gpu_source})"
            + ("" if share or not inv.gpus else "; --share-gpus lets instances share them"),
        )
    ranks = [config.prefill_tp] * config.num_prefill + [config.decode_ranks] * config.num_decode
    sets = gpu_sets(ranks, inv.gpus)
    return sets[: config.num_prefill], sets[config.num_prefill :], need > len(inv.gpus)


def gpu_sets(ranks: Sequence[int], gpus: Sequence[str]) -> list[tuple[str, ...]]:
    """One GPU set per instance of ``ranks`` ranks, taken in order from ``gpus``: disjoint when
    there are enough, else round-robin (instances share; each instance's own ranks stay on
    distinct GPUs when it has at most as many ranks as GPUs)."""
    ring = iter([gpus[i % len(gpus)] for i in range(sum(ranks))])
    return [tuple(next(ring) for _ in range(n)) for n in ranks]


def place_cpus(config: ClusterConfig, inv: Inventory) -> tuple[list[str], list[str], list[str]]:
    """One VLLM_CPU_OMP_THREADS_BIND value per instance ('0|1' = rank 0 on core 0, rank 1 on 1).

    Ranks get disjoint, equal core lists when there are at least as many cores as
    ranks; otherwise ranks share cores round-robin and a warning says so.
    Returns (prefill binds, decode binds, warnings).
    """
    ranks = [config.prefill_tp] * config.num_prefill + [config.decode_ranks] * config.num_decode
    binds, warnings = core_binds(ranks, inv.cpus)
    return binds[: config.num_prefill], binds[config.num_prefill :], warnings


def core_binds(ranks: Sequence[int], cpus: Sequence[int], where: str = "") -> tuple[list[str], list[str]]:
    """(one VLLM_CPU_OMP_THREADS_BIND value per instance of ``ranks`` ranks, warnings): disjoint,
    equal core lists per rank when there are enough cores, else cores shared round-robin and
    a warning (``where``: " on host1" across hosts)."""
    total = sum(ranks)
    cores = list(cpus) or [0]
    warnings: list[str] = []
    if total <= len(cores):
        per = len(cores) // total
        lists = [cores[i * per : (i + 1) * per] for i in range(total)]
    else:
        lists = [[cores[i % len(cores)]] for i in range(total)]
        warnings.append(
            f"{total} TP ranks share {len(cores)} CPU cores{where} "
            f"({','.join(map(str, cores))}): expect slow, contended runs"
        )
    binds, i = [], 0
    for n in ranks:
        binds.append("|".join(_core_list(lists[i + r]) for r in range(n)))
        i += n
    return binds, warnings


def _core_list(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def place_on_hosts(
    config: ClusterConfig, assignment: Assignment, *, platform: str, share_gpus: bool
) -> Placement:
    """Across hosts: each host places the instances assigned to it on its own GPUs or cores, as
    one host places a whole config (prefill first); slots keep the plan's order and names.

    cuda, a host with too few GPUs   -> PlanError "gpus" naming the host (--share-gpus: they share)
    cpu, a host with too few cores   -> its ranks share cores, and a warning names the host
    """
    roles = [("prefill", config.prefill_tp, 1, i, h) for i, h in enumerate(assignment.prefill)]
    roles += [("decode", config.decode_tp, config.decode_dp, i, h) for i, h in enumerate(assignment.decode)]
    devices: dict[int, tuple[tuple[str, ...], str | None]] = {}
    warnings: list[str] = []
    shared = False
    for host in dict.fromkeys(r[4] for r in roles):
        mine = [n for n, r in enumerate(roles) if r[4] == host]
        placed, said, host_shared = _place_on_host(config, host, [roles[n][1] * roles[n][2] for n in mine],
                                                   platform=platform, share_gpus=share_gpus)  # fmt: skip
        devices.update(zip(mine, placed, strict=True))
        warnings += said
        shared = shared or host_shared
    ports = {"prefill": config.prefill_ports, "decode": config.decode_ports}
    slots = [
        Slot(role, i, tp, dp, *devices[n], ports[role][i] if ports[role] else None, h)
        for n, (role, tp, dp, i, h) in enumerate(roles)
    ]
    n_p = config.num_prefill
    return Placement(tuple(slots[:n_p]), tuple(slots[n_p:]), shared, tuple(warnings))


def _place_on_host(
    config: ClusterConfig, host: HostFacts, ranks: list[int], *, platform: str, share_gpus: bool
) -> tuple[list[tuple[tuple[str, ...], str | None]], list[str], bool]:
    """(GPUs or cores of each of ``host``'s instances, warnings, whether they share GPUs)."""
    if platform != "cuda":
        binds, said = core_binds(ranks, host.inventory.cpus, f" on {host.name}")
        return [((), b) for b in binds], said, False
    gpus, need = host.inventory.gpus, sum(ranks)
    if need > len(gpus) and (not share_gpus or not gpus):
        hint = "" if share_gpus or not gpus else "; --share-gpus lets them share"
        raise PlanError(
            "gpus",
            f"config {config.name} puts {len(ranks)} instances needing {need} GPUs on "
            f"{host.name} ({host.address}), which has {len(gpus)}: {','.join(gpus) or 'none'}{hint}",
        )
    return [(g, None) for g in gpu_sets(ranks, gpus)], [], need > len(gpus)
