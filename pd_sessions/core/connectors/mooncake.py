"""MooncakeConnector: everything the harness knows about it.

- Install: one wheel per torch build (``mooncake-transfer-engine`` for CUDA 12, ``-cuda13``,
  ``-non-cuda`` for CPU); they ship the same ``mooncake`` package, so exactly one may be installed.
  The canary imports ``mooncake.engine`` (native module ``engine.*.so``).
- vLLM: ``{"kv_connector": "MooncakeConnector", "kv_connector_extra_config": {"mooncake_protocol":
  "rdma"|"tcp", "device_name": HCAs}}``; every instance gets its own ``VLLM_MOONCAKE_BOOTSTRAP_PORT``
  (only prefill instances serve it: the decode asks it for the prefill's engine per DP rank).
- vllm-router: ``--kv-connector mooncake`` and ``--prefill URL BOOTSTRAP_PORT``.
- Pair warm-up: the decode hop names the prefill's bootstrap URL and engine id (from ``/query``)
  and repeats the prefill hop's transfer id.
- Success evidence: vLLM (0.26 and 0.32) exposes no Mooncake Prometheus metrics (its stats.py
  says "TODO(mooncake-stats): add MooncakePromMetrics"); the sender logs "KV Transfer metrics:
  Num successful transfers=N, ... Num failed transfers=M ..." on each stats interval.
- Limits: over RDMA on a CUDA host it needs an RDMA device (``/sys/class/infiniband``), and the
  HCAs ``mooncake_device_name`` names must be among them.
- CPU lane: TCP (no RDMA device); its worker calls ``torch.accelerator.current_device_index()``,
  which raises on CPU-only torch: pd-sessions' vLLM plugin makes it return 0 there.
"""

from __future__ import annotations

from collections.abc import Mapping

from pd_sessions.core.connectors.base import (
    AcrossHosts,
    ClientParams,
    ConfigView,
    ConnectorSpec,
    CpuLane,
    DetectionRate,
    Hops,
    KvAccounting,
    Limits,
    LogEvidence,
    Option,
    Package,
    Ports,
    Refusal,
    SendLayout,
)
from pd_sessions.core.inventory import Inventory

PROTOCOLS = ("rdma", "tcp")
DEVICE_ENV = "MOONCAKE_DEVICE_NAME"

PACKAGE = Package(
    name="mooncake",
    title="Mooncake",
    module="mooncake",
    requirement="mooncake-transfer-engine",
    variants={
        12: "mooncake-transfer-engine",  # the default wheel
        13: "mooncake-transfer-engine-cuda13",
        None: "mooncake-transfer-engine-non-cuda",
    },
    imports=("mooncake.engine",),
    native_prefixes=("engine.",),
)


def protocol(config: ConfigView, platform: str) -> str:
    """The transport: the config's on GPU hosts, TCP on the CPU lane (no RDMA device there)."""
    return "tcp" if platform == "cpu" else config.mooncake_protocol


def kv_config(config: ConfigView, platform: str) -> dict[str, object]:
    return {
        "kv_connector_extra_config": {
            "mooncake_protocol": protocol(config, platform),
            "device_name": config.mooncake_device_name,
        }
    }


def host_env(config: ConfigView, platform: str, address: str, interface: str | None) -> dict[str, str]:
    """Across hosts, over TCP: Mooncake's TCP transport binds (and so advertises) the host's address,
    not whatever its own detection picks (in seed 000, the docker bridge's)."""
    return {"MC_TCP_BIND_ADDRESS": address} if protocol(config, platform) == "tcp" else {}


def prefill_params(transfer_id: str) -> dict[str, object]:
    """do_remote_decode + a transfer id the decode hop repeats."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def decode_params(
    transfer_id: str, answer: Mapping[str, object], bootstrap_url: str | None, engine_id: str | None
) -> dict[str, object]:
    """do_remote_prefill, the prefill's bootstrap URL and engine id, the transfer id."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": bootstrap_url,
        "remote_engine_id": engine_id,
    }


def engine_id(entries: Mapping[str, object]) -> str:
    """DP rank 0's engine id from the bootstrap server's ``/query`` answer."""
    rank0 = entries.get("0") if isinstance(entries, Mapping) else None
    if not isinstance(rank0, Mapping) or "engine_id" not in rank0:
        raise ValueError(f"no DP rank 0 registered yet ({entries})")
    return str(rank0["engine_id"])


def cpu_warnings(config: ConfigView) -> tuple[str, ...]:
    if config.mooncake_protocol == "tcp":
        return ()
    return (
        f"mooncake_protocol {config.mooncake_protocol!r} replaced by 'tcp' on the CPU lane (no RDMA device)",
    )


def rdma_refusal(configs: tuple[ConfigView, ...], platform: str, inv: Inventory) -> Refusal | None:
    """Why Mooncake over RDMA cannot work on this host, or None.

    platform  protocol  RDMA devices            -> result
    cpu       any       any                     -> None (the CPU lane uses tcp)
    cuda      rdma      unknown (None)          -> None (not looked at)
    cuda      rdma      none                    -> "no RDMA device ... --mooncake-protocol tcp"
    cuda      rdma      some, device_name set   -> every listed name must be one of them
    cuda      tcp                               -> None
    Only configs over this connector are given.
    """
    if platform != "cuda" or inv.rdma_devices is None:
        return None
    for c in configs:
        if c.mooncake_protocol != "rdma":
            continue
        if not inv.rdma_devices:
            return Refusal(
                "mooncake_protocol",
                f"config {c.name}: Mooncake over RDMA (mooncake_protocol = 'rdma') needs an RDMA "
                "device, and this host has none (/sys/class/infiniband is empty); use "
                "--mooncake-protocol tcp (or --set mooncake_protocol=tcp)",
            )
        wanted = [d for d in c.mooncake_device_name.split(",") if d]
        unknown = [d for d in wanted if d not in inv.rdma_devices]
        if unknown:
            return Refusal(
                "mooncake_device_name",
                f"config {c.name}: mooncake_device_name names {', '.join(unknown)}, not an RDMA "
                f"device of this host ({', '.join(inv.rdma_devices)}); set --mooncake-device-name "
                f"or ${DEVICE_ENV} to one of them",
            )
    return None


# vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py,
# MooncakeConnectorScheduler._get_remote_prefill_token_count: N - 1 when the model has Mamba (SSM)
# layers (or DSV4.1's bounded sliding-window replay) and N > 1, else N.
KV_ACCOUNTING = KvAccounting(
    backoff_ssm=1,
    backoff_plain=0,
    code="vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py: "
    "MooncakeConnectorScheduler._get_remote_prefill_token_count",
)

# n > 1 through the router: the decode's child requests waited for their KV (seen on the CPU lane,
# docs/cpu-lane.md "Request paths users send"); request_features sends it over Mooncake last, with a
# short deadline, and the known-issues registry judges it (configs/known_issues.toml: mooncake-n-gt-1).
N_GT_1 = (
    "n > 1 over MooncakeConnector: the decode's child requests wait for their KV (Mooncake "
    "keys a transfer by the one transfer_id the router gives the request, which both "
    "children carry); seen on the CPU lane with vLLM 0.32.0, 2026-12-01: a 2-choice "
    "seeded request waited 9.5 s once and over 40 s the next time (decode-0 reporting "
    "1 deferred request), NIXL served the same requests at once; intermittent: on 2026-12-05 "
    "1 of 8 seeded 2-choice requests waited past 20 s, the others answered in 0.1-0.4 s"
)

# What a client can forge (the hostile_clients check): mooncake_connector.py, vLLM 0.32. The decode
# hop names the prefill engine (remote_engine_id) and its bootstrap server, and the transfer by the
# id both hops carry (transfer_id, which the prefill hop names too: a client chooses it); no block
# ids (the decode asks the prefill for the transfer's blocks). A decode hop whose remote_engine_id
# is not a string kills the decode's engine: MooncakeConnectorMetadata.add_new_req keys a dict by
# it inside the scheduler (TypeError: unhashable type: 'dict', EngineDeadError), seen on the CPU
# lane 2026-12-05; the check does not send it to a shared cluster (known issue
# mooncake-client-params-kill-decode; docs/hostile-clients.md gives the request).
CLIENT_PARAMS = ClientParams(
    engine_key="remote_engine_id",
    decode_id_key="transfer_id",
    prefill_id_key="transfer_id",
    block_key=None,
    code="vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py: "
    "MooncakeConnectorScheduler.update_state_after_alloc, MooncakeConnectorMetadata.add_new_req",
    not_sent=(
        (
            "wrong_types",
            "decode",
            "a decode hop with a non-string remote_engine_id kills decode-0's engine (TypeError: "
            "unhashable type: 'dict' in MooncakeConnectorMetadata.add_new_req, inside the scheduler; "
            "seen 2026-12-05, vLLM 0.32.0): known issue mooncake-client-params-kill-decode",
        ),
    ),
)

SPEC = ConnectorSpec(
    name="mooncake",
    title="Mooncake",
    vllm_class="MooncakeConnector",
    router_flag="mooncake",
    package=PACKAGE,
    kv_config=kv_config,
    hops=Hops(prefill_params, decode_params, bootstrap_query="/query", engine_id=engine_id),
    kv_accounting=KV_ACCOUNTING,
    evidence=LogEvidence(
        success="Num successful transfers",
        failures=("Num failed transfers", "Num failed recvs"),
        mean_mib="Avg MB per transfer",
    ),
    failure_lines=(
        r"pulling kv_caches for .* failed",  # decode
        r"Mooncake transfer engine returned",
        r"Sending to \S+ failed \(ret=",  # prefill
        r"Error in Mooncake sender thread",
        r"Error processing Mooncake xfer request",
    ),
    transfer_op="WRITE",  # the prefill's sender thread: batch_transfer_sync_write
    ports=Ports(bootstrap_env="VLLM_MOONCAKE_BOOTSTRAP_PORT"),
    across_hosts=AcrossHosts(advertised_env=("MC_TCP_BIND_ADDRESS",), env=host_env),
    limits=Limits(host_refusal=rdma_refusal, unserved_requests=(("n>1", N_GT_1),)),
    cpu_lane=CpuLane(
        warnings=cpu_warnings,
        shims=("torch.accelerator.current_device_index() returns 0 without an accelerator",),
    ),
    options=(
        Option(
            "mooncake_protocol",
            "--mooncake-protocol",
            "same as --set mooncake_protocol=...",
            choices=PROTOCOLS,
        ),
        Option(
            "mooncake_device_name",
            "--mooncake-device-name",
            f"RDMA HCA allow-list (default: ${DEVICE_ENV}); same as --set mooncake_device_name=...",
            env=DEVICE_ENV,
        ),
    ),
    sweep="mooncake_sweep",
    recv_layout="by_engine",  # vLLM 0.32's mooncake_connector.py: reqs_to_recv
    send_layout=SendLayout(
        key="transfer_id",
        recv_blocks="tail",
        code="mooncake_connector.py: PullReqMeta.transfer_id, the scheduler's unhashed_block_ids",
    ),
    # the CPU lane's CI runs in exact mode, 2026-12-05 (vLLM 0.32.0, the tiny Llama): zero and swap
    # 32/32 in each of 4 runs (tests/test_e2e_faults.py); failure-modes rows 31-32
    detection=(
        DetectionRate("zero", "exact", 32, 32, "32/32 in each of 4 CI runs, CPU lane"),
        DetectionRate("swap", "exact", 32, 32, "32/32 in each of 4 CI runs, CPU lane"),
    ),
    client_params=CLIENT_PARAMS,
)
