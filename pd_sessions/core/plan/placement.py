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
    if need > len(inv.gpus):
        ring = [inv.gpus[i % len(inv.gpus)] for i in range(need)]
        it = iter(ring)
        prefill = [tuple(next(it) for _ in range(config.prefill_tp)) for _ in range(config.num_prefill)]
        decode = [tuple(next(it) for _ in range(config.decode_ranks)) for _ in range(config.num_decode)]
        return prefill, decode, True
    it = iter(inv.gpus)
    prefill = [tuple(next(it) for _ in range(config.prefill_tp)) for _ in range(config.num_prefill)]
    decode = [tuple(next(it) for _ in range(config.decode_ranks)) for _ in range(config.num_decode)]
    return prefill, decode, False


def place_cpus(config: ClusterConfig, inv: Inventory) -> tuple[list[str], list[str], list[str]]:
    """One VLLM_CPU_OMP_THREADS_BIND value per instance ('0|1' = rank 0 on core 0, rank 1 on 1).

    Ranks get disjoint, equal core lists when there are at least as many cores as
    ranks; otherwise ranks share cores round-robin and a warning says so.
    Returns (prefill binds, decode binds, warnings).
    """
    ranks = [config.prefill_tp] * config.num_prefill + [config.decode_ranks] * config.num_decode
    total = sum(ranks)
    cores = list(inv.cpus) or [0]
    warnings: list[str] = []
    if total <= len(cores):
        per = len(cores) // total
        lists = [cores[i * per : (i + 1) * per] for i in range(total)]
    else:
        lists = [[cores[i % len(cores)]] for i in range(total)]
        warnings.append(
            f"{total} TP ranks share {len(cores)} CPU cores "
            f"({','.join(map(str, cores))}): expect slow, contended runs"
        )
    binds, i = [], 0
    for n in ranks:
        binds.append("|".join(_core_list(lists[i + r]) for r in range(n)))
        i += n
    return binds[: config.num_prefill], binds[config.num_prefill :], warnings


def _core_list(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)
