"""Host inventory: which platform, which GPUs, which CPU cores.

``detect()`` is the edge (reads the environment, runs ``nvidia-smi``);
``resolve_platform()`` is the pure decision.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from pd_sessions.core.inventory import Inventory, parse_visible_devices, resolve_platform

RDMA_SYSFS = "/sys/class/infiniband"


def rdma_devices(sysfs: str = RDMA_SYSFS) -> tuple[str, ...]:
    """Names of the RDMA devices (e.g. mlx5_0); () when there are none."""
    try:
        return tuple(sorted(os.listdir(sysfs)))
    except OSError:
        return ()


def query_gpus(fields: str) -> list[str]:
    """``nvidia-smi --query-gpu=FIELDS`` as CSV lines without a header; [] where there is no
    nvidia-smi, it fails or it takes over 30 s."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run(
            [smi, f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.splitlines() if out.returncode == 0 else []


def detect(environ: dict[str, str] | None = None) -> Inventory:
    """Look at this host. Never raises for a host without GPUs."""
    env = os.environ if environ is None else environ
    physical = tuple(line.strip() for line in query_gpus("index") if line.strip())
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpus = parse_visible_devices(visible, physical) if physical else ()
    source = (
        f"CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "nvidia-smi" if physical else "none"
    )
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    return Inventory(gpus=gpus, cpus=cpus, gpu_source=source, rdma_devices=rdma_devices())


def inventory_json() -> str:
    """This host's inventory as ``pd-sessions inventory`` prints it: GPUs, cores, where the GPUs
    were found, and the platform a run picks by default."""
    inv = detect()
    doc = {"gpus": list(inv.gpus), "cpus": list(inv.cpus), "gpu_source": inv.gpu_source}
    return json.dumps({**doc, "platform": resolve_platform(None, inv)})


def gpu_names(ids: list[str] | tuple[str, ...]) -> list[str]:
    """The model name of each GPU id (as CUDA_VISIBLE_DEVICES spells it: an index or a UUID),
    from ``nvidia-smi``; "GPU <id>" where it does not say (no nvidia-smi, an unknown id)."""
    if not ids:
        return []
    names: dict[str, str] = {}
    try:
        for line in query_gpus("index,uuid,name"):
            index, uuid, name = (part.strip() for part in line.split(",", 2))
            names[index] = names[uuid] = name
    except ValueError:
        names = {}
    return [names.get(i, f"GPU {i}") for i in ids]
