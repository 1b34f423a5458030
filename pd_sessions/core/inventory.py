"""Host inventory types and the pure decisions on them: which GPUs are visible, which platform.

Detection (reading the environment, running ``nvidia-smi``) is ``runtime.machine``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_sessions.core.errors import ConfigError, PlanError


@dataclass(frozen=True)
class Inventory:
    # GPU ids as CUDA_VISIBLE_DEVICES spells them (what we hand to children), in order.
    gpus: tuple[str, ...]
    # CPU cores this process may run on.
    cpus: tuple[int, ...]
    # Where the GPU list came from, for messages ("CUDA_VISIBLE_DEVICES=0,1", "nvidia-smi").
    gpu_source: str = "none"
    # RDMA devices (HCAs) the kernel knows, from /sys/class/infiniband; None = not looked at.
    rdma_devices: tuple[str, ...] | None = None


def parse_visible_devices(value: str | None, physical: tuple[str, ...]) -> tuple[str, ...]:
    """Apply CUDA_VISIBLE_DEVICES to the physical GPU list.

    None         -> every physical GPU
    "" or "-1"   -> none
    "2,3"        -> those ids (checked against the physical list when it is known)
    """
    if value is None:
        return physical
    ids = tuple(v.strip() for v in value.split(",") if v.strip())
    if not ids or ids[0] == "-1":
        return ()
    # Ids after an invalid one are ignored by CUDA; we are stricter and report it.
    if physical:
        known = set(physical)
        for v in ids:
            if v.isdigit() and v not in known:
                raise ConfigError(
                    "CUDA_VISIBLE_DEVICES", f"names GPU {v}, but this host has GPUs {','.join(physical)}"
                )
    return ids


def resolve_platform(requested: str | None, inv: Inventory) -> str:
    """Pick the platform.

    requested  GPUs visible  -> platform
    None       yes           -> cuda
    None       no            -> cpu
    "cpu"      any           -> cpu
    "cuda"     yes           -> cuda
    "cuda"     no            -> error (never a silent fallback)
    """
    if requested not in (None, "cpu", "cuda"):
        raise ConfigError("--platform", f"got {requested!r}; allowed: cpu, cuda")
    if requested == "cpu":
        return "cpu"
    if requested == "cuda":
        if not inv.gpus:
            raise PlanError(
                "--platform",
                "cuda was asked for, but no GPU is visible "
                f"(source: {inv.gpu_source}); run on a GPU host or use --platform cpu",
            )
        return "cuda"
    return "cuda" if inv.gpus else "cpu"
