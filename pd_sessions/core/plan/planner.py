"""plan_cluster: the planner's steps in order, each a helper that returns what it has to say."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pd_sessions.core import connector_support
from pd_sessions.core.config import PLATFORMS, ClusterConfig
from pd_sessions.core.errors import PlanError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan.instance import Launch, plan_instance
from pd_sessions.core.plan.ledger import PortLedger
from pd_sessions.core.plan.placement import Placement, place
from pd_sessions.core.plan.router import plan_router
from pd_sessions.core.plan.settings import lane_settings, model_settings
from pd_sessions.core.plan.specs import ClusterPlan, ProcessSpec
from pd_sessions.core.ports import PortSource


def plan_cluster(
    config: ClusterConfig,
    inv: Inventory,
    ports: PortSource,
    *,
    platform: str,
    python: str,
    model: str | None = None,
    allow_unpinned: bool = False,
    share_gpus: bool = False,
    overrides: Sequence[str] = (),
    decode_model: str | None = None,
    passthrough_env: Mapping[str, str] | None = None,
    faults_control: str | None = None,
) -> ClusterPlan:
    """Plan every process of ``config``. ``model`` overrides what --model gets
    (e.g. the path of the generated tiny model); requests use ``config.model``.
    ``decode_model`` overrides it for decode instances only (parity's fault injection).
    ``passthrough_env``: the harness's values of GPU_PASSTHROUGH_ENV (cuda only).
    ``faults_control``: the fault scenarios' control file; every connector is then wrapped by
    pd-sessions' fault injector (see core/faults.py).

    The steps, in order; the first that fails raises a PlanError naming the field:
        platform                 -> "platform" unless cpu or cuda
        connector_support.check  -> the connector and the pair (or platform) it cannot serve
        model_settings           -> --model, remote-code flags ("revision", "model", "block_size")
        place                    -> one slot per instance: GPUs or cores ("gpus")
        lane_settings            -> dtype, block size, GPU env ("dtype", "block_size")
        plan_instance, each      -> ports, env, argv (a port used twice: its label)
        plan_router              -> the router, on the plan's last ports
    Warnings keep the steps' order; notes are the model's, then the lane's.
    """
    if platform not in PLATFORMS:
        raise PlanError("platform", f"got {platform!r}; allowed: cpu, cuda")
    connector_support.check(config, platform)  # before anything else: names the connector and the pair
    models = model_settings(config, model=model, decode_model=decode_model, allow_unpinned=allow_unpinned)
    placement = place(config, inv, platform=platform, share_gpus=share_gpus)
    lane = lane_settings(config, platform, passthrough_env or {})
    launch = Launch(config, platform, python, models, lane, placement.shared_gpus, faults_control)
    ledger = PortLedger(ports)
    prefill, decode, said = _plan_instances(placement, launch, ledger)
    router = plan_router(config, python, prefill, decode, ledger)
    return ClusterPlan(
        config=config,
        platform=platform,
        model=models.model,
        served_model_name=config.model,
        prefill=prefill,
        decode=decode,
        router=router,
        warnings=models.warnings + placement.warnings + lane.warnings + said,
        ports=tuple(ledger.taken),
        notes=models.notes + lane.notes,
        overrides=tuple(overrides),
    )


def _plan_instances(
    placement: Placement, launch: Launch, ledger: PortLedger
) -> tuple[tuple[ProcessSpec, ...], tuple[ProcessSpec, ...], tuple[str, ...]]:
    """(prefill specs, decode specs, their warnings): every slot planned in order, prefill first."""
    prefill = [plan_instance(slot, launch, ledger) for slot in placement.prefill]
    decode = [plan_instance(slot, launch, ledger) for slot in placement.decode]
    said = tuple(w for i in prefill + decode for w in i.warnings)
    return tuple(i.spec for i in prefill), tuple(i.spec for i in decode), said
