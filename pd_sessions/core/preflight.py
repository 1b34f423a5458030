"""Before anything is installed or started: can this sweep run on this host?

Imports only the standard library and pure modules, so the noxfile can call it
before it installs anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from pd_sessions.core import connectors
from pd_sessions.core.config import TINY_MODELS, ClusterConfig, Sweep
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


# A model value that starts with one of these is a path (vLLM would take anything else that is not
# a local directory for a hub id, and fail seconds after launch: "Repo id must be in the form ...").
PATH_PREFIXES = ("/", "./", "../", "~")


def path_like(model: str, *, is_dir: Callable[[str], bool]) -> str | None:
    """Why ``model`` is a path (a phrase for messages), or None when it is not path-like.

    starts with /, ./, ../ or ~            -> "it starts with '/'" (etc.)
    names an existing relative directory  -> "it names the directory ... of the working directory"
    anything else (Qwen/Qwen3-0.6B, tiny-llama) -> None: a hub id or a generated model
    """
    for prefix in PATH_PREFIXES:
        if model.startswith(prefix):
            return f"it starts with {prefix!r}"
    if is_dir(model):
        return "it names a directory of the working directory"
    return None


def missing_model_path(
    configs: Sequence[ClusterConfig],
    *,
    exists: Callable[[str], bool],
    is_dir: Callable[[str], bool],
) -> tuple[str, str] | None:
    """(model, message) for the first config whose model is path-like (:func:`path_like`) but
    does not exist, or None. ``exists`` is asked with ``~`` already expanded by the caller's
    function (pass e.g. ``lambda p: os.path.exists(os.path.expanduser(p))``).

    model not path-like                  -> not judged (a hub id: vLLM resolves it)
    path-like, exists                    -> fine
    path-like, does not exist            -> (model, "... does not exist ...; give ...")
    """
    for c in configs:
        why = path_like(c.model, is_dir=is_dir)
        if why is None or exists(c.model):
            continue
        return c.model, (
            f"{c.model!r} (config {c.name}) is a path ({why}) and does not exist; give an "
            "existing model directory, a hub id such as Qwen/Qwen3-0.6B, or one of "
            f"{', '.join(TINY_MODELS)}"
        )
    return None
