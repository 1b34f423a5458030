"""One vLLM instance rendered: its ports (from the plan's ledger), env and argv, from its slot
and the plan-wide settings. Nothing here decides where an instance runs (``placement``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pd_sessions.core import connectors, digest_records, faults
from pd_sessions.core.config import DUMMY_WEIGHT_MODELS, ClusterConfig
from pd_sessions.core.errors import PlanError
from pd_sessions.core.plan.across_hosts import host_env, host_problems, loopback_advertised
from pd_sessions.core.plan.ledger import PortLedger
from pd_sessions.core.plan.placement import Slot
from pd_sessions.core.plan.settings import Lane, ModelSettings
from pd_sessions.core.plan.specs import ProcessSpec

# Consecutive ports each vLLM instance may scan upward into from VLLM_PORT
# (engine-core handshake, ZMQ sockets, torch.distributed for TP ranks).
INTERNAL_PORT_BLOCK = 16
CPU_KVCACHE_GIB = 1
# The CPU lane runs --enforce-eager (no compiled model), yet vLLM still torch.compiles (inductor)
# helpers decorated with @torch.compile on their first use, the engine answering nothing meanwhile:
# e.g. vllm/v1/sample/ops/logprobs.py batched_count_greater_than on an engine's first request with
# logprobs, 3-7 s on the CPU lane (docs/cpu-lane.md, "Request paths users send"). Dynamo disabled,
# they run eagerly: the same results.
CPU_NO_COMPILE_ENV = (("TORCHDYNAMO_DISABLE", "1"),)
# vllm/platforms/cpu.py turns a one-rank engine's in-process executor ("uni", what a GPU instance
# of TP 1 runs) into the multiprocess one unless VLLM_ENABLE_V1_MULTIPROCESSING=0: a third process
# per instance, spawned, importing torch and vLLM again (6-9 s of one core per instance start on
# the CPU lane). With the variable the worker runs in the engine core, as on a GPU; the API server
# still starts its engine core as a process of its own (AsyncLLM always does). Only for a slot of
# one rank (TP 1, DP 1): with more ranks vLLM picks the multiprocess executor anyway.
CPU_ONE_RANK_ENV = (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),)


def omp_env(cores: str) -> tuple[tuple[str, str], ...]:
    """The OpenMP binding of one rank on ``cores`` ("0" or "0,1"), as vLLM's multiprocess executor
    sets it in the worker it spawns (vllm/utils/ompmultiprocessing.py, OMPProcessManager.
    configure_omp_envs, neither libiomp nor libgomp preloaded): with the worker in the engine core
    no one else would, and torch would run one unbound thread per core of the machine."""
    ids = [c.strip() for c in cores.split(",") if c.strip()]
    return (
        ("OMP_NUM_THREADS", str(len(ids))),
        ("OMP_PLACES", "{" + ",".join(ids) + "}"),
        ("OMP_PROC_BIND", "true"),
    )


API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class Launch:
    """What every vLLM instance of one plan starts with: one per plan, read per instance."""

    config: ClusterConfig
    platform: str
    python: str  # the interpreter that runs vLLM
    model: ModelSettings
    lane: Lane
    shared_gpus: bool  # instances share GPUs: explicit KV cache bytes, not a memory share
    # across hosts: plan an instance that would advertise loopback anyway (warned), not refuse it
    allow_loopback: bool = False
    # The fault scenarios' control file (absolute path): every instance's connector is then
    # pd-sessions' fault-injecting wrapper of it (pd_sessions/vllm_side/fault_connector.py); None = plain.
    faults_control: str | None = None
    # The KV digest's directory (the config's run directory, absolute): each instance's connector is
    # then wrapped too, its observer writing <dir>/<instance>.kv_digest.jsonl (core/digest_records.py).
    kv_digest_dir: str | None = None


@dataclass(frozen=True)
class InstancePorts:
    """One instance's ports, taken from the plan's ledger in this order (fields top to bottom)."""

    http: int
    internal: int  # VLLM_PORT: the first of INTERNAL_PORT_BLOCK ports per DP rank
    bootstrap: int | None  # the connector's bootstrap port (every instance; only prefill serves it)
    side_channel: int | None  # the connector's side channel: the first of one port per DP rank
    dp_rpc: int | None  # --data-parallel-rpc-port (DP > 1)


@dataclass(frozen=True)
class PlannedInstance:
    spec: ProcessSpec
    warnings: tuple[str, ...]


def address(slot: Slot, launch: Launch) -> str:
    """What the instance binds and advertises: its host's address across hosts, else config.host."""
    return slot.host.address if slot.host else launch.config.host


def plan_instance(slot: Slot, launch: Launch, ledger: PortLedger) -> PlannedInstance:
    """The spec of the instance in ``slot``, with what it has to say. Across hosts, what its host
    lacks raises (hosts.host_problems), and so does an address it would advertise that only
    reaches itself, unless ``launch.allow_loopback`` (then a warning)."""
    host = address(slot, launch)
    ports = reserve_ports(slot, launch.config.connector, ledger)
    argv, warnings = instance_argv(slot, launch, ports)
    env = instance_env(slot, launch, ports)
    if slot.host:
        host_problems(slot.host, launch.config, launch.platform, env)
        warnings += _loopback(slot, launch, env)
    spec = ProcessSpec(
        name=slot.name,
        role=slot.role,
        argv=tuple(argv),
        env=tuple(env.items()),
        host=host,
        port=ports.http,
        log_name=f"{slot.name}.log",
        gpus=slot.gpus,
        cpu_bind=slot.cpu_bind,
        bootstrap_port=ports.bootstrap if slot.role == "prefill" else None,
        internal_ports=(ports.internal, ports.internal + INTERNAL_PORT_BLOCK - 1),
        bind=host if slot.host else None,
        node=slot.host.name if slot.host else None,
    )
    return PlannedInstance(spec, tuple(warnings))


def _loopback(slot: Slot, launch: Launch, env: dict[str, str]) -> list[str]:
    """Warnings for the loopback addresses the instance would advertise (allowed), or PlanError
    naming the first one: the variable, the instance and its host."""
    assert slot.host is not None
    found = loopback_advertised(slot.name, slot.host, env, address(slot, launch), launch.config.connector)
    if found and not launch.allow_loopback:
        var, msg = found[0]
        raise PlanError(
            var,
            f"{msg}; the planner gives every instance its host's own address: remove {var} from "
            "extra_env, or pass --allow-loopback-advertise to run it anyway (it must then fail)",
        )
    return [f"{msg} (--allow-loopback-advertise: the KV transfer must fail)" for _, msg in found]


def reserve_ports(slot: Slot, connector: str, ledger: PortLedger) -> InstancePorts:
    """Take the instance's ports, labelled ``<name>.<use>``, in this order:

    always                       http (the slot's explicit port when set), internal (a block)
    connector with a bootstrap   bootstrap: every instance its own, so none falls back to the
                                 connector's fixed default; only prefill instances serve it
    connector with side channel  side_channel: a block, one per DP rank (vLLM listens on port + rank)
    DP > 1                       dp_rpc
    """
    name, spec = slot.name, connectors.get(connector)
    http = ledger.get(f"{name}.http", slot.http_port)
    internal = ledger.block(f"{name}.internal", INTERNAL_PORT_BLOCK * slot.dp)
    # Fresh ports every run. (vLLM hashes these two ports into its torch.compile cache
    # key, so on GPU hosts each run compiles again; fixed ports would collide between
    # clusters on one host, because vLLM binds them long after the plan was made.)
    bootstrap = ledger.get(f"{name}.bootstrap") if spec.ports.bootstrap_env else None
    side_channel = ledger.block(f"{name}.side_channel", slot.dp) if spec.ports.side_channel_env else None
    dp_rpc = ledger.get(f"{name}.dp_rpc") if slot.dp > 1 else None
    return InstancePorts(http, internal, bootstrap, side_channel, dp_rpc)


def instance_env(slot: Slot, launch: Launch, ports: InstancePorts) -> dict[str, str]:
    """The environment added to the instance's, in this order (later entries win):

    always         VLLM_HOST_IP, VLLM_PORT, PYTHONUNBUFFERED
    the connector  its ports' variables (spec.ports: a bootstrap port; a side channel and the host
                   it advertises)
    GPUs placed    CUDA_VISIBLE_DEVICES, then the lane's passed-through GPU env
    cpu            VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND ("auto" when unbound),
                   TORCHDYNAMO_DISABLE=1 (CPU_NO_COMPILE_ENV); for a slot of one rank bound to
                   cores, VLLM_ENABLE_V1_MULTIPROCESSING=0 (CPU_ONE_RANK_ENV) and that rank's
                   OpenMP binding (omp_env); then the connector's CPU-lane
                   environment (spec.cpu_lane.env, e.g. NIXL's progress-thread delay)
    across hosts   the host's own address above (not config.host), and hosts.host_env
    last           the config's extra_env: its value wins ("" turns the delay off)
    """
    c, host = launch.config, address(slot, launch)
    spec = connectors.get(c.connector)
    env = {"VLLM_HOST_IP": host, "VLLM_PORT": str(ports.internal), "PYTHONUNBUFFERED": "1"}
    env.update(spec.port_env(host, ports.bootstrap, ports.side_channel))
    if slot.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(slot.gpus)
        env.update(dict(launch.lane.gpu_env))
    if launch.platform == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(CPU_KVCACHE_GIB)
        env["VLLM_CPU_OMP_THREADS_BIND"] = slot.cpu_bind or "auto"
        env.update(dict(CPU_NO_COMPILE_ENV))
        if slot.tp == 1 and slot.dp == 1 and slot.cpu_bind and "|" not in slot.cpu_bind:
            env.update(dict(CPU_ONE_RANK_ENV))
            env.update(dict(omp_env(slot.cpu_bind)))
        env.update(dict(spec.cpu_lane.env))
    if slot.host:
        env.update(host_env(slot.host, c, launch.platform))
    env.update(dict(c.extra_env))
    return env


def instance_argv(slot: Slot, launch: Launch, ports: InstancePorts) -> tuple[list[str], list[str]]:
    """(argv, warnings): the server and its parallelism, the remote-code flags, the KV transfer,
    then the engine's flags, the config's extra_args, a decode's decode_extra_args last."""
    kv_args, warnings = _kv_args(slot, launch)
    argv = _server_args(slot, launch, ports) + list(launch.model.remote_args) + kv_args
    role_args = list(launch.config.decode_extra_args) if slot.role == "decode" else []
    return argv + _engine_args(launch) + role_args, warnings


def _server_args(slot: Slot, launch: Launch, ports: InstancePorts) -> list[str]:
    """python -m the API server (across hosts: the host's python), --model (decode: the decode
    model when set; across hosts: where the host has it), host, port, TP;
    DP size, address and RPC port when DP > 1; expert parallel for decode when the config asks."""
    c, host, m = launch.config, address(slot, launch), launch.model
    python = slot.host.python if slot.host and slot.host.python else launch.python
    model = m.decode_model if slot.role == "decode" and m.decode_model else m.model
    argv = [python, "-m", API_SERVER_MODULE]
    argv += ["--model", slot.host.model(model) if slot.host else model]
    argv += ["--served-model-name", c.model, "--host", host, "--port", str(ports.http)]
    argv += ["--tensor-parallel-size", str(slot.tp)]
    if slot.dp > 1:
        argv += ["--data-parallel-size", str(slot.dp), "--data-parallel-address", host]
        argv += ["--data-parallel-rpc-port", str(ports.dp_rpc)]
    if slot.role == "decode" and c.expert_parallel:
        argv += ["--enable-expert-parallel"]
    return argv


def _kv_args(slot: Slot, launch: Launch) -> tuple[list[str], list[str]]:
    """(argv, warnings) for the KV transfer.

    prefill, or decode_kv_transfer (the default)  -> --kv-transfer-config JSON, no warning
    decode with decode_kv_transfer = false        -> nothing, and a warning (fault injection)
    """
    if slot.role == "prefill" or launch.config.decode_kv_transfer:
        digest = digest_records.side_file(launch.kv_digest_dir, slot.name) if launch.kv_digest_dir else None
        kv = kv_transfer_config(
            launch.config, slot.role, launch.platform, faults_control=launch.faults_control, digest=digest
        )
        return ["--kv-transfer-config", json.dumps(kv, sort_keys=True, separators=(",", ":"))], []
    return [], [
        f"{slot.name} starts WITHOUT --kv-transfer-config (decode_kv_transfer = "
        "false, fault injection): it will recompute every prompt"
    ]


def _engine_args(launch: Launch) -> list[str]:
    """The engine's flags, each only when it says something.

    shared GPUs          --kv-cache-memory-bytes (no profiling race); else on cuda
                         --gpu-memory-utilization
    dtype not None/auto  --dtype;   block size set   --block-size
    max_model_len set    --max-model-len;   attention_backend set   --attention-backend
    cpu                  --enforce-eager unless extra_args has it
    a model without      --load-format dummy unless extra_args sets a load format
    weights (DUMMY_WEIGHT_MODELS)
    always, last         the config's extra_args
    """
    c, lane = launch.config, launch.lane
    argv: list[str] = []
    if launch.shared_gpus:
        argv += ["--kv-cache-memory-bytes", str(c.shared_kv_cache_bytes)]
    elif launch.platform == "cuda":
        argv += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
    if lane.dtype not in (None, "auto"):
        argv += ["--dtype", lane.dtype]
    if lane.block_size is not None:
        argv += ["--block-size", str(lane.block_size)]
    if c.max_model_len is not None:
        argv += ["--max-model-len", str(c.max_model_len)]
    if c.attention_backend:
        argv += ["--attention-backend", c.attention_backend]
    if launch.platform == "cpu" and "--enforce-eager" not in c.extra_args:
        argv += ["--enforce-eager"]
    if c.model in DUMMY_WEIGHT_MODELS and not any(a.startswith("--load-format") for a in c.extra_args):
        argv += ["--load-format", "dummy"]
    return argv + list(c.extra_args)


def kv_transfer_config(
    config: ClusterConfig,
    role: str,
    platform: str,
    *,
    faults_control: str | None = None,
    digest: str | None = None,
) -> dict[str, object]:
    """The --kv-transfer-config value for an instance of ``role``.

    the connector's spec builds its own settings, then
    kv_load_failure_policy set    -> "kv_load_failure_policy" (else vLLM's default, "fail")
    faults_control or digest set  -> "kv_connector_module_path": pd-sessions' fault-injecting
                                     wrapper, which keeps the connector's name, and its settings
                                     under kv_connector_extra_config (see core/faults.py): the
                                     control file ("" when only the digest is asked for: faults
                                     off) and the KV digest's side file (core/digest_records.py)
    """
    kv = connectors.get(config.connector).kv_transfer_config(config, role, platform)
    if config.kv_load_failure_policy is not None:
        kv["kv_load_failure_policy"] = config.kv_load_failure_policy
    if faults_control is not None or digest is not None:
        kv["kv_connector_module_path"] = faults.CONNECTOR_MODULE
        extra = dict(kv.get("kv_connector_extra_config") or {})  # type: ignore[call-overload]
        settings: dict[str, str] = {"control": faults_control or ""}
        if digest is not None:
            settings[digest_records.SETTING] = digest
        extra[faults.EXTRA_CONFIG_KEY] = settings
        kv["kv_connector_extra_config"] = extra
    return kv
