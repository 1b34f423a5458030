"""Across hosts: the Ray cluster a run plans over (``--ray ADDRESS|auto``), and phase 1's facts
for one config's plan. Without ``--ray`` nothing here imports Ray, and a run is planned and
launched on this host as before."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from pd_sessions.core.config import TINY_MODELS, ClusterConfig
from pd_sessions.core.plan.across_hosts import HostLayout
from pd_sessions.run.sweep_options import SweepOptions, model_path
from pd_sessions.runtime.raylaunch import RayHosts, RemotePorts, ray_hosts


@contextmanager
def hosts_for(opts: SweepOptions, say: Callable[[str], None]) -> Iterator[RayHosts | None]:
    """The Ray cluster of ``opts.ray`` joined for the whole run (its agents killed and the
    driver disconnected at the end); with ``opts.simulate_hosts``, that many simulated hosts made
    for the run (runtime/simhosts.py) and joined the same way; else None (one host)."""
    if opts.simulate_hosts:
        from pd_sessions.runtime.simhosts import simulated_hosts

        with (
            simulated_hosts(opts.simulate_hosts, opts.results_dir, say=say) as sim,
            ray_hosts(sim.ray_address, say=say) as hosts,
        ):
            yield hosts
    elif opts.ray:
        with ray_hosts(opts.ray, say=say) as hosts:
            yield hosts
    else:
        yield None


def loopback_said(warnings: Sequence[str]) -> str:
    """What a failure adds when the plan advertised loopback across hosts by request
    (--allow-loopback-advertise): each such warning names the instance, its host and the
    variable. "" when there is none."""
    said = [w for w in warnings if "--allow-loopback-advertise" in w]
    return ("; across hosts: " + "; ".join(said)) if said else ""


def phase_one(
    hosts: RayHosts, config: ClusterConfig, opts: SweepOptions, *, create_model: bool
) -> tuple[HostLayout, dict[str, RemotePorts]]:
    """(the hosts' facts, a port source per host) for planning ``config`` across hosts: the
    generated tiny models generated on each host (from their seed), a local model path checked
    there. ``create_model=False`` (a dry run) generates nothing anywhere."""
    layout = hosts.layout(allow_loopback=opts.allow_loopback_advertise)
    if create_model:
        models = []
        if config.model in TINY_MODELS:
            seeds = [None] + ([config.decode_weights_seed] if config.decode_weights_seed is not None else [])
            for seed in seeds:
                path = model_path(config, create=True, cache=opts.model_cache, weights_seed=seed)
                assert path is not None
                models.append((path, config.model, seed))
        local = [config.model] if config.model not in TINY_MODELS and Path(config.model).exists() else []
        cache = str(opts.model_cache) if opts.model_cache else None
        layout = hosts.with_models(layout, models, cache, local)
    return layout, hosts.port_sources()
