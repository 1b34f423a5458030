"""plan_cluster: the planner's steps in order, each a helper that returns what it has to say."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from pd_sessions.core import connector_support
from pd_sessions.core.config import PLATFORMS, ClusterConfig
from pd_sessions.core.errors import PlanError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan.across_hosts import HostLayout, assign_hosts
from pd_sessions.core.plan.instance import Launch, plan_instance
from pd_sessions.core.plan.ledger import PortLedger
from pd_sessions.core.plan.placement import Placement, Slot, place, place_on_hosts
from pd_sessions.core.plan.router import plan_router
from pd_sessions.core.plan.settings import lane_settings, model_settings
from pd_sessions.core.plan.specs import ClusterPlan, ProcessSpec
from pd_sessions.core.port_source import PortSource


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
    layout: HostLayout | None = None,
    host_ports: Mapping[str, PortSource] | None = None,
    faults_control: str | None = None,
    kv_digest_dir: str | None = None,
) -> ClusterPlan:
    """Plan every process of ``config``. ``model`` overrides what --model gets
    (e.g. the path of the generated tiny model); requests use ``config.model``.
    ``decode_model`` overrides it for decode instances only (parity's fault injection).
    ``passthrough_env``: the harness's values of GPU_PASSTHROUGH_ENV (cuda only).
    ``layout``: across hosts (phase 1's facts, see core/plan/across_hosts.py): each instance on its
    host, binding and advertising that host's address, its ports from ``host_ports[host]`` (each
    host's ports unique on that host; ``ports`` is the driver's, where the router runs).
    ``faults_control``: the fault scenarios' control file; every connector is then wrapped by
    pd-sessions' fault injector (see core/faults.py).
    ``kv_digest_dir``: where the KV digest's side files go (the config's run directory); every
    connector is then wrapped by the same module, its observer on (see core/digest_records.py).

    The steps, in order; the first that fails raises a PlanError naming the field:
        platform                 -> "platform" unless cpu or cuda
        connector_support.check  -> the connector and the pair (or platform) it cannot serve
        model_settings           -> --model, remote-code flags ("revision", "model", "block_size")
        place                    -> one slot per instance: GPUs or cores ("gpus"); across
                                    hosts first its host (assign_hosts: "prefill_hosts", ...)
        lane_settings            -> dtype, block size, GPU env ("dtype", "block_size")
        plan_instance, each      -> ports, env, argv (a port used twice: its label); across
                                    hosts also a device the host lacks, a loopback advertised
        plan_router              -> the router, on the plan's last ports
    Warnings keep the steps' order; notes are the model's, then the lane's.
    """
    if platform not in PLATFORMS:
        raise PlanError("platform", f"got {platform!r}; allowed: cpu, cuda")
    connector_support.check(config, platform)  # before anything else: names the connector and the pair
    models = model_settings(config, model=model, decode_model=decode_model, allow_unpinned=allow_unpinned)
    host_notes: tuple[str, ...] = ()
    if layout is None:
        placement = place(config, inv, platform=platform, share_gpus=share_gpus)
    else:
        assignment = assign_hosts(config, layout)
        placement = place_on_hosts(config, assignment, platform=platform, share_gpus=share_gpus)
        host_notes = assignment.notes
    lane = lane_settings(config, platform, passthrough_env or {})
    allow = layout is not None and layout.allow_loopback
    launch = Launch(
        config, platform, python, models, lane, placement.shared_gpus,
        allow_loopback=allow, faults_control=faults_control, kv_digest_dir=kv_digest_dir,
    )  # fmt: skip
    ledgers = _Ledgers(ports, layout, host_ports or {})
    prefill, decode, said = _plan_instances(placement, launch, ledgers)
    router = plan_router(config, python, prefill, decode, ledgers.driver)
    if layout is not None:
        router = replace(router, node=layout.driver)
    return ClusterPlan(
        config=config,
        platform=platform,
        model=models.model,
        served_model_name=config.model,
        prefill=prefill,
        decode=decode,
        router=router,
        warnings=models.warnings + placement.warnings + lane.warnings + said,
        ports=ledgers.taken(),
        notes=models.notes + lane.notes + host_notes,
        overrides=tuple(overrides),
        hosts=ledgers.hosts(),
    )


class _Ledgers:
    """One PortLedger per host: the driver's (the router's, and of every instance on one host)
    from ``ports``, each other host's from its own source."""

    def __init__(self, ports: PortSource, layout: HostLayout | None, sources: Mapping[str, PortSource]):
        self.layout = layout
        self.driver = PortLedger(ports)
        self.by_host: dict[str, PortLedger] = {}
        if layout is not None:
            self.by_host[layout.driver] = self.driver
        self.sources = sources

    def of(self, slot: Slot) -> PortLedger:
        if slot.host is None:
            return self.driver
        if slot.host.name not in self.by_host:
            if slot.host.name not in self.sources:
                raise PlanError("hosts", f"no port source for {slot.host.name} ({slot.host.address})")
            self.by_host[slot.host.name] = PortLedger(self.sources[slot.host.name])
        return self.by_host[slot.host.name]

    def taken(self) -> tuple[tuple[str, int], ...]:
        """(label, port) in the order taken; across hosts each label is "host/label"."""
        if self.layout is None:
            return tuple(self.driver.taken)
        return tuple((f"{h}/{label}", p) for h, ledger in self._ordered() for label, p in ledger.taken)

    def hosts(self) -> tuple[tuple[str, str], ...]:
        """(name, address) of the hosts the plan uses, the router's first; () on one host."""
        if self.layout is None:
            return ()
        return tuple((h, self.layout.by_name(h).address) for h, _ in self._ordered())

    def _ordered(self) -> list[tuple[str, PortLedger]]:
        assert self.layout is not None
        driver = self.layout.driver
        return [(driver, self.driver)] + [(h, led) for h, led in self.by_host.items() if h != driver]


def _plan_instances(
    placement: Placement, launch: Launch, ledgers: _Ledgers
) -> tuple[tuple[ProcessSpec, ...], tuple[ProcessSpec, ...], tuple[str, ...]]:
    """(prefill specs, decode specs, their warnings): every slot planned in order, prefill first."""
    prefill = [plan_instance(slot, launch, ledgers.of(slot)) for slot in placement.prefill]
    decode = [plan_instance(slot, launch, ledgers.of(slot)) for slot in placement.decode]
    said = tuple(w for i in prefill + decode for w in i.warnings)
    return tuple(i.spec for i in prefill), tuple(i.spec for i in decode), said
