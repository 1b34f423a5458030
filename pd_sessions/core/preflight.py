"""Before anything is installed or started: can this sweep run on this host?

Imports only the standard library and pure modules, so the noxfile can call it
before it installs anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pd_sessions.core import connectors
from pd_sessions.core.config import ClusterConfig, Sweep
from pd_sessions.core.connectors.base import Refusal
from pd_sessions.core.errors import ConfigError, PlanError
from pd_sessions.core.inventory import Inventory, resolve_platform


def preflight(
    sweep: Sweep, requested: str | None, inv: Inventory, *, dry_run: bool = False, share_gpus: bool = False
) -> tuple[str, Inventory, str | None]:
    """(platform, inventory to plan with, note).

    sweep platforms  host GPUs        dry run  -> result
    cpu+cuda         any              any      -> resolve_platform(requested, host)
    cuda only        --platform cpu   any      -> ConfigError
    cuda only        >= needed        any      -> cuda, host inventory
    cuda only        >= 1, --share-gpus  any   -> cuda, host inventory (instances share)
    cuda only        <  needed        no       -> PlanError "needs N GPUs, M visible: ..."
    cuda only        <  needed        yes      -> cuda, GPUs 0..N-1 assumed (noted)
    """
    if "cpu" in sweep.platforms:
        return resolve_platform(requested, inv), inv, None
    if requested == "cpu":
        raise ConfigError("--platform", f"{sweep.name} runs on {', '.join(sweep.platforms)} only")
    need = sweep.gpus_needed()
    if len(inv.gpus) >= need or (share_gpus and inv.gpus):
        return "cuda", inv, None
    seen = ",".join(inv.gpus) if inv.gpus else "none"
    if dry_run:
        assumed = replace(
            inv,
            gpus=tuple(str(i) for i in range(need)),
            gpu_source=f"assumed for --dry-run (this host: {seen})",
        )
        return (
            "cuda",
            assumed,
            (
                f"dry run: {sweep.name} needs {need} GPUs and this host has "
                f"{len(inv.gpus)} visible ({seen}); planning as if GPUs "
                f"{','.join(assumed.gpus)} were visible"
            ),
        )
    raise PlanError(
        "gpus",
        f"{sweep.name} needs {need} GPUs, {len(inv.gpus)} visible: {seen} "
        f"(from {inv.gpu_source}); nothing was started",
    )


def host_refusal(configs: Sequence[ClusterConfig], platform: str, inv: Inventory) -> Refusal | None:
    """Why this host cannot run ``configs``' connectors, or None: each connector's
    ``limits.host_refusal`` is asked about the configs over it, in registry order (Mooncake over
    RDMA without an RDMA device, or with HCAs the host does not have)."""
    for spec in connectors.ALL:
        mine = tuple(c for c in configs if c.connector == spec.name)
        if mine and (refusal := spec.limits.host_refusal(mine, platform, inv)):
            return refusal
    return None
