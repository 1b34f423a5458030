"""NixlConnector (vLLM's pull mode, NixlPullConnector): everything the harness knows about it.

- Install: the ``nixl`` meta package plus the backend for torch's CUDA major (``nixl-cu12``,
  ``nixl-cu13``; CPU-only torch takes ``nixl-cu12``, whose UCX backend moves DRAM without a GPU),
  both ``--no-deps`` at one version. The canary imports ``nixl._api`` (native ``_bindings``,
  ``_utils``; the expert-parallel ``nixl_ep_*`` extensions are never loaded by it, so not judged).
- vLLM: ``{"kv_connector": "NixlConnector", "kv_buffer_device": "cuda"|"cpu"}``; every instance
  gets a block of side-channel ports (``VLLM_NIXL_SIDE_CHANNEL_PORT``, one per DP rank) and
  advertises ``VLLM_NIXL_SIDE_CHANNEL_HOST``.
- vllm-router: ``--kv-connector nixl``.
- Pair warm-up: the prefill hop asks for a remote decode; the decode hop carries the
  kv_transfer_params the prefill answered with.
- Success evidence: the decode READs, so the decode's ``vllm:nixl_xfer_time_seconds_count`` (one
  per completed transfer) must rise by one per router request and ``vllm:nixl_bytes_transferred``
  must rise, with its failure counters still.
- Limits: a hybrid model needs one explicit block size (vLLM derives unequal ones under different
  TP and every handshake fails); vLLM < 0.27.0 cannot feed lower-TP decode ranks from a
  higher-TP prefill for a hybrid model with MLA layers.
- CPU lane: ``kv_buffer_device: cpu``; NIXL's UCX progress thread is created with ``pthrDelay = 0``
  and spins a core per instance, so the planner sets ``PROGRESS.env`` (the CPU lane's environment)
  and pd-sessions' vLLM plugin creates agents with that delay (docs/cpu-lane.md, "What the 30 s stalls were").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pd_sessions.core.connectors.base import (
    AcrossHosts,
    ClientParams,
    ConfigView,
    ConnectorSpec,
    CpuLane,
    DetectionRate,
    Hops,
    HybridMlaHeteroTp,
    KvAccounting,
    Limits,
    MetricEvidence,
    Package,
    Ports,
    SendLayout,
)

PACKAGE = Package(
    name="nixl",
    title="NIXL",
    module="nixl",
    requirement="nixl",
    base="nixl",
    variants={12: "nixl-cu12", 13: "nixl-cu13", None: "nixl-cu12"},
    imports=("nixl._api",),
    native_prefixes=("_bindings.", "_utils."),
    no_deps=True,
)


@dataclass(frozen=True)
class ProgressShim:
    """Where pd-sessions' vLLM plugin wraps NIXL's agent constructor, and the variable that asks it to."""

    env: str  # the delay in microseconds; unset = NIXL's own busy polling
    api_module: str  # NIXL's Python front (re-exports the backend built for this host)
    agent_class: str  # the front's class whose module holds the bindings
    bindings: str  # the attribute of that module holding the native bindings
    constructor: str  # the bindings' agent constructor, ``(name, config)``
    cpu_delay_us: int  # what the CPU lane asks for


PROGRESS = ProgressShim(
    env="PD_SESSIONS_NIXL_PROGRESS_DELAY_US",
    api_module="nixl._api",
    agent_class="nixl_agent",
    bindings="nixlBind",
    constructor="nixlAgent",
    cpu_delay_us=1000,
)


@dataclass(frozen=True)
class CoresShim:
    """Where pd-sessions' vLLM plugin keeps NIXL's worker on its instance's cores, and the
    variable that asks it to."""

    env: str  # "1": keep the calling thread's cores across the worker's __init__
    module: str  # vLLM's NIXL worker module
    worker_class: str  # its base worker class (the pull and push workers inherit __init__)


# On a CPU host vLLM's NIXL worker moves the thread that builds it (the engine's own, which runs
# the model) to the last core of each NUMA node (os.sched_setaffinity in its __init__, "reserve
# different cores for start_load_kv() from model_forward()"): on the CPU lane every NIXL instance,
# prefill and decode, ended up computing on the machine's last core, whatever its own binding, and
# across simulated hosts on another host's core.
KEEP_CORES = CoresShim(
    env="PD_SESSIONS_NIXL_KEEP_CORES",
    module="vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
    worker_class="NixlBaseConnectorWorker",
)


@dataclass(frozen=True)
class HandshakeShim:
    """Where pd-sessions' vLLM plugin gives NIXL's side-channel handshake a longer answer timeout,
    and the variable that asks it to."""

    env: str  # seconds the handshake waits for the peer's answer; unset = vLLM's own vllm_ms
    module: str  # vLLM's NIXL worker module: its module-level zmq_ctx opens the handshake's socket
    socket_factory: str  # that module's name for the context manager (REQ: the handshake's query)
    listener_module: str  # vLLM's NIXL scheduler module: its zmq_ctx opens the listener's ROUTER
    scheduler_class: str  # its scheduler class, whose set_xfer_handshake_metadata starts the listener
    decode_delay_env: str  # a fault (the known issue's reproducer): the decode's listener answers late
    vllm_ms: int  # what vLLM sets (``sock.setsockopt(zmq.RCVTIMEO, 5000)``, no setting changes it)
    cpu_s: int  # what the CPU lane asks for (push mode only: NIXL_PUSH's cpu_lane)


# vLLM's NixlBaseConnectorWorker._nixl_handshake (nixl/base_worker.py, vLLM 0.32) asks the peer's
# side-channel listener (a thread of the peer's engine-core process, nixl/base_scheduler.py) for its
# metadata and gives up after a fixed 5 s: on a loaded CPU host that thread may answer later (push
# mode's reverse handshake, docs/cpu-lane.md "NIXL push mode"). 20 s stays under the prefill's 30 s
# block lease (kv_lease_duration), so a late answer still finds the blocks it must WRITE from.
HANDSHAKE = HandshakeShim(
    env="PD_SESSIONS_NIXL_HANDSHAKE_TIMEOUT_S",
    module=KEEP_CORES.module,
    socket_factory="zmq_ctx",
    listener_module="vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler",
    scheduler_class="NixlBaseConnectorScheduler",
    decode_delay_env="PD_SESSIONS_NIXL_DECODE_LISTENER_DELAY_S",
    vllm_ms=5000,
    cpu_s=20,
)

# Prometheus sample names after the text parser, summed over label sets (engine, model).
XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
XFER_BYTES = "vllm:nixl_bytes_transferred_sum"
# One transfer's time, posting time and descriptors (histograms; the perf check's TTFT split).
XFER_TIME = "vllm:nixl_xfer_time_seconds"
POST_TIME = "vllm:nixl_post_time_seconds"
DESCRIPTORS = "vllm:nixl_num_descriptors"
FAILURE_COUNTERS = ("vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_failed_notifications_total")

# Lines of an instance log that mean a transfer failed (vLLM 0.26/0.32).
FAILURE_LINES = (
    r"NIXL transfer failure",  # base_worker._log_failure (all kinds)
    r"handshake_setup_failed",
    r"is not divisible by remote block size",  # the handshake's block-size check
)


def kv_config(config: ConfigView, platform: str) -> dict[str, object]:
    out: dict[str, object] = {"kv_buffer_device": "cpu" if platform == "cpu" else "cuda"}
    if config.decode_weights_seed is not None:
        # Parity's fault injection: the decode's model path differs, and NIXL's handshake
        # compares a hash that includes it; let the KV move so only the weights differ.
        out["kv_connector_extra_config"] = {"enforce_handshake_compat": False}
    return out


def prefill_params(transfer_id: str) -> dict[str, object]:
    """do_remote_decode; the prefill's answer carries what the decode needs."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def decode_params(
    transfer_id: str, answer: Mapping[str, object], bootstrap_url: str | None, engine_id: str | None
) -> dict[str, object]:
    """The kv_transfer_params the prefill answered with (ValueError when absent)."""
    params = answer.get("kv_transfer_params")
    if not isinstance(params, Mapping) or not params:
        raise ValueError("the prefill's answer has no kv_transfer_params")
    return dict(params)


HOPS = Hops(prefill_params, decode_params)
PORTS = Ports(
    side_channel_env="VLLM_NIXL_SIDE_CHANNEL_PORT", side_channel_host_env="VLLM_NIXL_SIDE_CHANNEL_HOST"
)
# UCX transports that cross hosts on the CPU lane: TCP only. Simulated hosts (network namespaces
# of one machine) share /dev/shm and a kernel, so shm or cma would move the KV without crossing
# the link.
CPU_UCX_TLS = "tcp"


def host_env(config: ConfigView, platform: str, address: str, interface: str | None) -> dict[str, str]:
    """Across hosts on the CPU lane: UCX over TCP, on the host's interface when known. (The side
    channel's host is a port variable: ``PORTS.side_channel_host_env``.)"""
    if platform != "cpu":
        return {}
    return {"UCX_TLS": CPU_UCX_TLS, **({"UCX_NET_DEVICES": interface} if interface else {})}


ACROSS_HOSTS = AcrossHosts(env=host_env)
CPU_LANE = CpuLane(
    env=((PROGRESS.env, str(PROGRESS.cpu_delay_us)), (KEEP_CORES.env, "1")),
    shims=(
        f"NIXL agents poll every {PROGRESS.cpu_delay_us} us instead of spinning ({PROGRESS.env})",
        f"NIXL's worker stays on its instance's cores ({KEEP_CORES.env})",
    ),
)

# vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py,
# NixlBaseConnectorScheduler._prefill_backoff: max(1 if Mamba layers or bounded replay,
# num_prefill_lookahead_tokens - 1) (the lookahead is 0 without a multi-module MTP drafter, which
# no config of ours sets); _get_remote_prefill_token_count = N - backoff when N > backoff.
KV_ACCOUNTING = KvAccounting(
    backoff_ssm=1,
    backoff_plain=0,
    code="vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py: "
    "NixlBaseConnectorScheduler._prefill_backoff",
)

# What a client can forge (the hostile_clients check): nixl/base_scheduler.py and pull_scheduler.py,
# vLLM 0.32. The decode hop carries what the prefill answered: its engine (remote_engine_id), its
# request (remote_request_id), its block ids (remote_block_ids) and side channel (remote_host,
# remote_port); the prefill hop names no transfer (the prefill answers with its own request id). A
# decode hop whose remote_engine_id is not a string kills the decode's engine: the scheduler's
# NixlBaseConnectorScheduler.on_new_request looks it up in a dict (TypeError: unhashable type:
# 'dict', EngineDeadError), seen on the CPU lane 2026-12-05; the check does not send it to a shared
# cluster (known issue nixl-client-params-kill-decode; docs/hostile-clients.md gives the request).
CLIENT_PARAMS = ClientParams(
    engine_key="remote_engine_id",
    decode_id_key="remote_request_id",
    prefill_id_key=None,
    block_key="remote_block_ids",
    code="vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py: "
    "NixlBaseConnectorScheduler (the decode hop's keys), pull_scheduler.py update_state_after_alloc",
    not_sent=(
        (
            "wrong_types",
            "decode",
            "a decode hop with a non-string remote_engine_id kills decode-0's engine (TypeError: "
            "unhashable type: 'dict' in NixlBaseConnectorScheduler.on_new_request, inside the "
            "scheduler; seen 2026-12-05, vLLM 0.32.0): known issue nixl-client-params-kill-decode",
        ),
        (
            "block_ids_out_of_range",
            "decode",
            "a decode hop whose remote_block_ids is a flat list of ids (vLLM 0.32 expects one list per "
            "KV cache group) kills decode-0's engine (TypeError: 'int' object is not iterable in "
            "NixlPullConnectorWorker's group_ids, inside start_load_kv; seen 2026-12-05, vLLM 0.32.0): "
            "known issue nixl-client-params-kill-decode",
        ),
    ),
)

SPEC = ConnectorSpec(
    name="nixl",
    title="NIXL",
    vllm_class="NixlConnector",
    router_flag="nixl",
    package=PACKAGE,
    kv_config=kv_config,
    hops=HOPS,
    kv_accounting=KV_ACCOUNTING,
    evidence=MetricEvidence(
        count=XFER_COUNT,
        bytes=XFER_BYTES,
        failures=FAILURE_COUNTERS,
        role="decode",
        what="READ transfers",
        time=XFER_TIME,
        post_time=POST_TIME,
        descriptors=DESCRIPTORS,
    ),
    failure_lines=FAILURE_LINES,
    transfer_op="READ",  # the decode pulls (nixl/pull_worker.py)
    ports=PORTS,
    across_hosts=ACROSS_HOSTS,
    limits=Limits(
        hybrid_needs_block_size=True,
        hybrid_mla_hetero_tp=HybridMlaHeteroTp(
            fixed_in="0.27.0",
            why="its pull worker asserts a single source rank for MLA (`assert len(read_specs) == 1`, "
            "nixl/pull_worker.py) and the first transfer kills the decode's engine",
            fix="vllm-project/vllm#49297",
            known_issue="kimi-linear-hetero-tp-nixl",
        ),
    ),
    cpu_lane=CPU_LANE,
    sweep="nixl_sweep",
    recv_layout="flat",  # vLLM 0.32's nixl/metadata.py: reqs_to_recv
    # vLLM 0.32's nixl/base_scheduler.py and base_worker.py: kv_lease_duration, 30 s by default
    # (kv_connector_extra_config; pd-sessions does not set it), renewed only by a reading decode
    kv_lease_s=30.0,
    send_layout=SendLayout(
        key="request_id",
        recv_blocks="all",
        code="nixl/pull_scheduler.py request_finished (remote_request_id); nixl/metadata.py ReqMeta",
    ),
    # the CPU lane's CI runs in margin mode, 2026-12-05 (vLLM 0.32.0, the tiny Llama): zero 32/32
    # in each of 4 runs; swap 25-32/32 over 13 runs (a swapped answer whose tokens stay within the
    # margin passes: failure-modes row 32; 26 was required until a CI run saw 25); 22 is three below
    # the lowest seen: the spread passes, a collapse fails. kv_digest, in the same CI sweeps, caught
    # 32/32 swapped loads in every run it was in (7): the harness detects them all by the digest
    detection=(
        DetectionRate("zero", "margin", 32, 32, "32/32 in each of 4 CI runs, CPU lane"),
        DetectionRate("swap", "margin", 22, 32, "25-32/32 over 13 runs, CPU lane"),
    ),
    client_params=CLIENT_PARAMS,
)
