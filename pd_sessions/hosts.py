"""Host inventory: which platform, which GPUs, which CPU cores.

``detect()`` is the edge (reads the environment, runs ``nvidia-smi``);
``resolve_platform()`` is the pure decision.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from pd_sessions.errors import ConfigError, PlanError


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


RDMA_SYSFS = "/sys/class/infiniband"


def rdma_devices(sysfs: str = RDMA_SYSFS) -> tuple[str, ...]:
    """Names of the RDMA devices (e.g. mlx5_0); () when there are none."""
    try:
        return tuple(sorted(os.listdir(sysfs)))
    except OSError:
        return ()


def detect(environ: dict[str, str] | None = None) -> Inventory:
    """Look at this host. Never raises for a host without GPUs."""
    env = os.environ if environ is None else environ
    physical: tuple[str, ...] = ()
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=index", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            if out.returncode == 0:
                physical = tuple(line.strip() for line in out.stdout.splitlines() if line.strip())
        except (OSError, subprocess.TimeoutExpired):
            physical = ()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpus = parse_visible_devices(visible, physical) if physical else ()
    source = (
        f"CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "nvidia-smi" if physical else "none"
    )
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    return Inventory(gpus=gpus, cpus=cpus, gpu_source=source, rdma_devices=rdma_devices())


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
