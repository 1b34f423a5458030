"""Pure planner: config + host inventory + ports -> one spec per process.

Nothing here starts a process, binds a port or reads the environment: the
inventory and a :class:`~pd_sessions.core.port_source.PortSource` are passed in.

The steps, one module each (``planner.plan_cluster`` runs them in order):
- ``settings``: what the config means for every instance (--model, remote code, flags that
  cannot take effect; the platform's dtype, block size and GPU env);
- ``placement``: which instance goes where (one slot per instance: its GPUs or cores);
- ``ledger``: the plan's ports, each recorded under a label, none twice;
- ``instance``: one instance's ports, env and argv, from its slot and the settings;
- ``router``: the router in front of the instances;
- ``specs``: what comes out (ProcessSpec, ClusterPlan and its rendering);
- ``hosts``: across hosts, phase 1's facts (HostFacts, HostLayout) and the decisions on them
  (which host each instance runs on, what each host adds, loopback refused).

Rules (each enforced in those modules, each unit-tested):
- GPUs (cuda): prefill instances take the first visible GPUs, decode instances
  the next ones; no two instances share a GPU; too few GPUs is a PlanError
  before anything starts ("needs 4 GPUs, 2 visible: 0,1").
- CPU lane: --dtype float32 (bf16 dies with SIGILL on AMX-less VMs), block size
  a multiple of 32 (default 128), one core list per TP rank in
  VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE, Mooncake over tcp, and
  --enforce-eager (no torch.compile: the CPU build spends 10-27 s per instance
  start in inductor, and upstream's own P/D tests run eager too), and the connector's
  CPU-lane environment (its spec's ``cpu_lane.env``: for NIXL
  PD_SESSIONS_NIXL_PROGRESS_DELAY_US, see vllm_plugin.py: NIXL's progress thread otherwise
  spins a core per instance, and 2 cores cannot spare two).
- Every process advertises and binds ``config.host`` (VLLM_HOST_IP too). Across hosts (a
  HostLayout) each instance binds and advertises its own host's address (VLLM_HOST_IP, NIXL's
  side channel, Mooncake's TCP transport), its ports unique on its host; the router stays on
  ``config.host`` on the driver's host. An address advertised to other hosts that only reaches
  itself (loopback, localhost) is a PlanError naming the variable and the host.
- Ports: HTTP, bootstrap and internal (VLLM_PORT block) ports come from the
  PortSource; explicit ports in a config are claimed; all are unique in the plan.
- kv-transfer-config JSON, the connector's ports and env, the router's --kv-connector: from the
  connector's spec (pd_sessions/core/connectors/): producer for prefill, consumer for decode.

The names below are the planner's face: callers import them from ``pd_sessions.core.plan``.
"""

from __future__ import annotations

from pd_sessions.core.plan.instance import INTERNAL_PORT_BLOCK, kv_transfer_config
from pd_sessions.core.plan.planner import plan_cluster
from pd_sessions.core.plan.router import router_argv
from pd_sessions.core.plan.settings import (
    CPU_DEFAULT_BLOCK_SIZE,
    GPU_PASSTHROUGH_ENV,
    flag_warnings,
    gpu_env,
    hybrid_block_size,
)
from pd_sessions.core.plan.specs import ClusterPlan, ProcessSpec

__all__ = [
    "CPU_DEFAULT_BLOCK_SIZE",
    "GPU_PASSTHROUGH_ENV",
    "INTERNAL_PORT_BLOCK",
    "ClusterPlan",
    "ProcessSpec",
    "flag_warnings",
    "gpu_env",
    "hybrid_block_size",
    "kv_transfer_config",
    "plan_cluster",
    "router_argv",
]
