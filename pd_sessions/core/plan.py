"""Pure planner: config + host inventory + ports -> one spec per process.

Nothing here starts a process, binds a port or reads the environment: the
inventory and a :class:`~pd_sessions.core.ports.PortSource` are passed in.

Rules (each enforced below, each unit-tested):
- GPUs (cuda): prefill instances take the first visible GPUs, decode instances
  the next ones; no two instances share a GPU; too few GPUs is a PlanError
  before anything starts ("needs 4 GPUs, 2 visible: 0,1").
- CPU lane: --dtype float32 (bf16 dies with SIGILL on AMX-less VMs), block size
  a multiple of 32 (default 128), one core list per TP rank in
  VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE, Mooncake over tcp, and
  --enforce-eager (no torch.compile: the CPU build spends 10-27 s per instance
  start in inductor, and upstream's own P/D tests run eager too), and for NIXL
  PD_SESSIONS_NIXL_PROGRESS_DELAY_US (CPU_NIXL_PROGRESS_DELAY_US; vllm_plugin.py: NIXL's
  progress thread otherwise spins a core per instance, and 2 cores cannot spare two).
- Every process advertises and binds ``config.host`` (VLLM_HOST_IP too).
- Ports: HTTP, bootstrap and internal (VLLM_PORT block) ports come from the
  PortSource; explicit ports in a config are claimed; all are unique in the plan.
- kv-transfer-config JSON is built from data: producer for prefill, consumer for decode.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pd_sessions.core import connector_support
from pd_sessions.core.config import PLATFORMS, TINY_MODELS, ClusterConfig, Dtype, Platform
from pd_sessions.core.envnames import NIXL_DELAY_ENV
from pd_sessions.core.errors import PlanError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.ports import PortSource

# Consecutive ports each vLLM instance may scan upward into from VLLM_PORT
# (engine-core handshake, ZMQ sockets, torch.distributed for TP ranks).
INTERNAL_PORT_BLOCK = 16
CPU_KVCACHE_GIB = 1
# NIXL's progress thread polls at least this often (microseconds) instead of spinning (CPU lane)
CPU_NIXL_PROGRESS_DELAY_US = 1000
CPU_DEFAULT_BLOCK_SIZE = 128
CPU_BLOCK_MULTIPLE = 32
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ROUTER_MODULE = "vllm_router.launch_router"
# The router waits this long for its workers; the harness's readiness deadline governs.
ROUTER_STARTUP_TIMEOUT_S = 86400


@dataclass(frozen=True)
class ProcessSpec:
    """Everything needed to start and probe one process."""

    name: str  # "prefill-0", "decode-1", "router"
    role: str  # "prefill" | "decode" | "router"
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # added to the inherited environment
    host: str
    port: int  # HTTP port
    log_name: str
    gpus: tuple[str, ...] = ()
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND value on the CPU lane
    bootstrap_port: int | None = None
    internal_ports: tuple[int, int] | None = None  # [first, last] of the VLLM_PORT block

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


@dataclass(frozen=True)
class ClusterPlan:
    config: ClusterConfig
    platform: Platform
    model: str  # what --model gets (path or hub id)
    served_model_name: str  # what requests name
    prefill: tuple[ProcessSpec, ...]
    decode: tuple[ProcessSpec, ...]
    router: ProcessSpec
    warnings: tuple[str, ...] = ()
    ports: tuple[tuple[str, int], ...] = field(default=())
    # The command line's overrides, described; the config above already has them.
    overrides: tuple[str, ...] = ()
    # Facts worth reading in the plan that are not warnings (where passed-through env came from...).
    notes: tuple[str, ...] = ()

    @property
    def instances(self) -> tuple[ProcessSpec, ...]:
        return self.prefill + self.decode

    @property
    def processes(self) -> tuple[ProcessSpec, ...]:
        return self.instances + (self.router,)

    def render(self) -> str:
        """Human-readable plan for --dry-run and logs."""
        c = self.config
        lines = [
            f"plan {c.name}: {c.shape}, connector {c.connector}, platform {self.platform}",
            f"  model: {self.model} (served as {self.served_model_name})",
        ]
        for o in self.overrides:
            lines.append(f"  override (command line): {o}")
        if c.trust_remote_code:
            pin = (
                "generated locally (pd_sessions.runtime.tiny_model), no hub revision"
                if c.model in TINY_MODELS and not c.revision
                else f"revision {c.revision or 'UNPINNED'}"
            )
            lines.append(f"  remote code: trusted, {pin}")
        for w in self.warnings:
            lines.append(f"  WARNING: {w}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        for p in self.processes:
            place = (
                f"GPUs {','.join(p.gpus)}" if p.gpus else f"cores {p.cpu_bind}" if p.cpu_bind else "no device"
            )
            extra = f", bootstrap port {p.bootstrap_port}" if p.bootstrap_port else ""
            if p.internal_ports:
                extra += f", internal ports {p.internal_ports[0]}-{p.internal_ports[1]}"
            lines.append(f"  {p.name}: {p.url} ({place}{extra})")
            for k, v in p.env:
                lines.append(f"      env {k}={v}")
            lines.append(f"      argv {shlex.join(p.argv)}")
        named = [(label, port) for label, port in self.ports if "+" not in label]
        lines.append(
            f"  ports: all {len(self.ports)} distinct; "
            + ", ".join(f"{label}={port}" for label, port in named)
        )
        return "\n".join(lines)


class _Ports:
    """Wraps a PortSource and enforces uniqueness within one plan."""

    def __init__(self, source: PortSource):
        self.source = source
        self.taken: list[tuple[str, int]] = []

    def _record(self, label: str, port: int) -> int:
        for other, p in self.taken:
            if p == port:
                raise PlanError(label, f"port {port} is already used by {other} in this plan")
        self.taken.append((label, port))
        return port

    def get(self, label: str, explicit: int | None = None) -> int:
        if explicit is not None:
            return self._record(label, self.source.claim(label, explicit))
        return self._record(label, self.source.take(label))

    def block(self, label: str, size: int) -> int:
        base = self.source.take_block(label, size)
        for i in range(size):
            self._record(f"{label}+{i}" if i else label, base + i)
        return base


def kv_transfer_config(config: ClusterConfig, role: str, platform: str) -> dict[str, object]:
    """The --kv-transfer-config value for an instance of ``role``."""
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    if config.connector == "mooncake":
        protocol = "tcp" if platform == "cpu" else config.mooncake_protocol
        return {
            "kv_connector": "MooncakeConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {
                "mooncake_protocol": protocol,
                "device_name": config.mooncake_device_name,
            },
        }
    if config.connector == "nixl":
        out: dict[str, object] = {
            "kv_connector": "NixlConnector",
            "kv_role": kv_role,
            "kv_buffer_device": "cpu" if platform == "cpu" else "cuda",
        }
        if config.decode_weights_seed is not None:
            # Parity's fault injection: the decode's model path differs, and NIXL's handshake
            # compares a hash that includes it; let the KV move so only the weights differ.
            out["kv_connector_extra_config"] = {"enforce_handshake_compat": False}
        return out
    raise PlanError("connector", f"no planner rule for connector {config.connector!r}")


def place_gpus(
    config: ClusterConfig, inv: Inventory, *, share: bool = False
) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]], bool]:
    """GPU sets: prefill instances first, then decode instances. Returns (prefill, decode, shared).

    enough GPUs             -> disjoint sets, shared = False
    too few, share=False    -> PlanError "needs N GPUs, M visible: ..."
    too few, share=True     -> sets taken round-robin over the visible GPUs (instances
                               share), shared = True; each instance's own ranks stay on
                               distinct GPUs when it has at most as many ranks as GPUs
    no GPU at all           -> PlanError, shared or not
    """
    need = config.num_prefill * config.prefill_tp + config.num_decode * config.decode_ranks
    seen = ",".join(inv.gpus) if inv.gpus else "none"
    if need > len(inv.gpus) and (not share or not inv.gpus):
        raise PlanError(
            "gpus",
            f"config {config.name} needs {need} GPUs "
            f"({config.shape}), {len(inv.gpus)} visible: {seen} "
            f"(from {inv.gpu_source})"
            + ("" if share or not inv.gpus else "; --share-gpus lets instances share them"),
        )
    if need > len(inv.gpus):
        ring = [inv.gpus[i % len(inv.gpus)] for i in range(need)]
        it = iter(ring)
        prefill = [tuple(next(it) for _ in range(config.prefill_tp)) for _ in range(config.num_prefill)]
        decode = [tuple(next(it) for _ in range(config.decode_ranks)) for _ in range(config.num_decode)]
        return prefill, decode, True
    it = iter(inv.gpus)
    prefill = [tuple(next(it) for _ in range(config.prefill_tp)) for _ in range(config.num_prefill)]
    decode = [tuple(next(it) for _ in range(config.decode_ranks)) for _ in range(config.num_decode)]
    return prefill, decode, False


def place_cpus(config: ClusterConfig, inv: Inventory) -> tuple[list[str], list[str], list[str]]:
    """One VLLM_CPU_OMP_THREADS_BIND value per instance ('0|1' = rank 0 on core 0, rank 1 on 1).

    Ranks get disjoint, equal core lists when there are at least as many cores as
    ranks; otherwise ranks share cores round-robin and a warning says so.
    Returns (prefill binds, decode binds, warnings).
    """
    ranks = [config.prefill_tp] * config.num_prefill + [config.decode_ranks] * config.num_decode
    total = sum(ranks)
    cores = list(inv.cpus) or [0]
    warnings: list[str] = []
    if total <= len(cores):
        per = len(cores) // total
        lists = [cores[i * per : (i + 1) * per] for i in range(total)]
    else:
        lists = [[cores[i % len(cores)]] for i in range(total)]
        warnings.append(
            f"{total} TP ranks share {len(cores)} CPU cores "
            f"({','.join(map(str, cores))}): expect slow, contended runs"
        )
    binds, i = [], 0
    for n in ranks:
        binds.append("|".join(_core_list(lists[i + r]) for r in range(n)))
        i += n
    return binds[: config.num_prefill], binds[config.num_prefill :], warnings


def _core_list(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def _cpu_dtype_and_block(config: ClusterConfig) -> tuple[Dtype, int]:
    if config.dtype not in (None, "auto", "float32"):
        raise PlanError(
            "dtype",
            f"got {config.dtype!r} on the CPU lane; allowed: float32 "
            "(bfloat16 kills the worker with SIGILL in the AMX attention kernel "
            "on VMs without AMX tile state)",
        )
    block = CPU_DEFAULT_BLOCK_SIZE if config.block_size is None else config.block_size
    if block % CPU_BLOCK_MULTIPLE:
        raise PlanError(
            "block_size",
            f"got {block} on the CPU lane; allowed: a multiple of "
            f"{CPU_BLOCK_MULTIPLE} (CPU attention rejects others), e.g. 128",
        )
    return "float32", block


def remote_code_args(config: ClusterConfig, *, allow_unpinned: bool) -> tuple[list[str], str | None]:
    """(argv additions, warning) for the remote-code policy.

    trust_remote_code  revision  allow_unpinned  -> result
    false              any       any             -> nothing
    true, generated tiny model (local, no hub)   -> --trust-remote-code (its code is ours)
    true               set       any             -> --trust-remote-code --revision R --tokenizer-revision R
    true               unset     true            -> --trust-remote-code + an "UNPINNED" warning
    true               unset     false           -> PlanError naming both ways out
    """
    if not config.trust_remote_code:
        return (
            ([], None)
            if config.revision is None
            else (["--revision", config.revision, "--tokenizer-revision", config.revision], None)
        )
    if config.model in TINY_MODELS and config.revision is None:
        return ["--trust-remote-code"], None
    if config.revision:
        return [
            "--trust-remote-code",
            "--revision",
            config.revision,
            "--tokenizer-revision",
            config.revision,
        ], None
    if allow_unpinned:
        return ["--trust-remote-code"], (
            f"UNPINNED remote code: {config.model} runs its hub code "
            "at whatever revision the hub serves now "
            "(--allow-unpinned-remote-code)"
        )
    raise PlanError(
        "revision",
        f"{config.name}: trust_remote_code needs a pinned revision (set "
        'revision = "<commit>" in the config) or the explicit '
        "--allow-unpinned-remote-code flag",
    )


# Environment a multi-GPU host may require of every GPU process (the lent H200 x2 host
# does: NVLink multicast off). Taken from the harness's own environment when set there.
GPU_PASSTHROUGH_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
# Generated models that are hybrid whatever the config says.
HYBRID_TINY_MODELS = ("tiny-kimi-linear",)


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in an argv list (``--f v`` or ``--f=v``), or None when absent."""
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1] if i + 1 < len(args) else ""
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def flag_warnings(config: ClusterConfig) -> list[str]:
    """Flags of the config that cannot take effect, said before anything starts.

    a known hybrid generated model with hybrid = false
        -> warning: block sizes are left to vLLM (unequal under different TP)
    --mamba-cache-mode M (M != none), no --enable-prefix-caching
        -> warning: vLLM sets it to 'none' when prefix caching is off, and hybrid
           models have prefix caching off by default
    """
    out = []
    if config.model in HYBRID_TINY_MODELS and not config.hybrid:
        out.append(
            f"{config.model} is hybrid but the config says hybrid = false: block sizes are left to "
            "vLLM, which derives unequal ones under different TP (NIXL handshakes then fail)"
        )
    mode = _flag_value(config.extra_args, "--mamba-cache-mode")
    if mode not in (None, "none") and "--enable-prefix-caching" not in config.extra_args:
        out.append(
            f"--mamba-cache-mode {mode} cannot take effect: vLLM sets the Mamba cache mode to "
            "'none' when prefix caching is disabled, and it is off by default for hybrid models "
            "(\"Mamba cache mode is set to 'none' when prefix caching is disabled\"); add "
            "--enable-prefix-caching to extra_args to make it count"
        )
    return out


def hybrid_block_size(config: ClusterConfig) -> str | None:
    """A hybrid model over NIXL needs one explicit block size on both sides.

        not hybrid, or connector mooncake      -> None (nothing to say)
        hybrid + nixl + block_size set         -> a note: both sides get --block-size N
        hybrid + nixl + no block_size          -> PlanError naming the fix
    vLLM derives a hybrid model's block size from the per-GPU linear-attention state, which
    halves under TP2: on an H200, prefill TP2 chose 128 and decode DP2 240, and every NIXL
    handshake failed ("Local block size 240 is not divisible by remote block size 128").
    """
    # the config's word (``hybrid``); flag_warnings flags a known hybrid model without it
    if not config.hybrid or config.connector != "nixl":
        return None
    if config.block_size is None:
        raise PlanError(
            "block_size",
            f"{config.name}: {config.model} is hybrid and the connector is NIXL: "
            "set block_size (e.g. 256) so prefill and decode register equal KV blocks; vLLM "
            "otherwise derives it from the per-GPU linear-attention state, which differs with "
            "TP (TP2 prefill 128 vs DP decode 240 on an H200: every NIXL handshake failed)",
        )
    return (
        f"hybrid model over NIXL: --block-size {config.block_size} on both sides (vLLM would derive "
        "unequal sizes from the per-GPU state; it raises the size only when the state needs more, so "
        "check that both logs report the same block size)"
    )


def gpu_env(
    passthrough: Mapping[str, str], extra_env: Sequence[tuple[str, str]]
) -> tuple[dict[str, str], list[str]]:
    """(env for every GPU process, one note per variable saying where its value came from).

    set in the config's extra_env       -> the config's value ("from the config's extra_env")
    set in the harness's environment    -> that value ("from the harness's environment")
    neither                             -> not set, no note
    """
    env, notes = {}, []
    extra = dict(extra_env)
    for name in GPU_PASSTHROUGH_ENV:
        if name in extra:
            notes.append(f"{name}={extra[name]} (from the config's extra_env)")
        elif name in passthrough:
            env[name] = passthrough[name]
            notes.append(
                f"{name}={passthrough[name]} (from the harness's environment, passed to every GPU process)"
            )
    return env, notes


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
) -> ClusterPlan:
    """Plan every process of ``config``. ``model`` overrides what --model gets
    (e.g. the path of the generated tiny model); requests use ``config.model``.
    ``decode_model`` overrides it for decode instances only (parity's fault injection).
    ``passthrough_env``: the harness's values of GPU_PASSTHROUGH_ENV (cuda only)."""
    if platform not in PLATFORMS:
        raise PlanError("platform", f"got {platform!r}; allowed: cpu, cuda")
    connector_support.check(config)  # before anything else: names the connector and the pair
    remote_args, remote_warning = remote_code_args(config, allow_unpinned=allow_unpinned)
    if config.model in TINY_MODELS and model is None:
        raise PlanError("model", f"{config.model!r} needs the generated model's path")
    model_arg = model or config.model
    warnings: list[str] = [remote_warning] if remote_warning else []
    warnings += flag_warnings(config)
    notes: list[str] = []
    block_note = hybrid_block_size(config)
    if block_note:
        notes.append(block_note)
    extra_gpu_env: dict[str, str] = {}
    if platform == "cuda":
        extra_gpu_env, env_notes = gpu_env(passthrough_env or {}, config.extra_env)
        notes += env_notes
    if decode_model is not None:
        warnings.append(
            f"decode instances load {decode_model}, not {model_arg} (decode_weights_seed = "
            f"{config.decode_weights_seed}, fault injection): parity must fail"
        )
    p = _Ports(ports)
    host = config.host

    shared = False
    if platform == "cuda":
        p_gpus, d_gpus, shared = place_gpus(config, inv, share=share_gpus)
        if shared:
            warnings.append(
                f"--share-gpus: {config.shape} shares GPUs {','.join(inv.gpus)}; each "
                f"instance gets --kv-cache-memory-bytes {config.shared_kv_cache_bytes} "
                "instead of a share of --gpu-memory-utilization (profiling races)"
            )
        p_binds: list[str | None] = [None] * config.num_prefill
        d_binds: list[str | None] = [None] * config.num_decode
        dtype, block = config.dtype, config.block_size
    else:
        p_gpus = [()] * config.num_prefill
        d_gpus = [()] * config.num_decode
        pb, db, w = place_cpus(config, inv)
        p_binds, d_binds = list(pb), list(db)
        warnings += w
        dtype, block = _cpu_dtype_and_block(config)
        if config.connector == "mooncake" and config.mooncake_protocol != "tcp":
            warnings.append(
                f"mooncake_protocol {config.mooncake_protocol!r} replaced by 'tcp' "
                "on the CPU lane (no RDMA device)"
            )

    def instance(
        role: str, i: int, tp: int, gpus: tuple[str, ...], bind: str | None, explicit_port: int | None
    ) -> ProcessSpec:
        name = f"{role}-{i}"
        dp = config.decode_dp if role == "decode" else 1
        port = p.get(f"{name}.http", explicit_port)
        internal = p.block(f"{name}.internal", INTERNAL_PORT_BLOCK * dp)
        env: dict[str, str] = {"VLLM_HOST_IP": host, "VLLM_PORT": str(internal), "PYTHONUNBUFFERED": "1"}
        bootstrap = None
        # Fresh ports every run. (vLLM hashes these two ports into its torch.compile cache
        # key, so on GPU hosts each run compiles again; fixed ports would collide between
        # clusters on one host, because vLLM binds them long after the plan was made.)
        if config.connector == "mooncake":
            # Only prefill instances serve bootstrap; every instance gets its own port so
            # none falls back to the fixed default (8998).
            bootstrap = p.get(f"{name}.mooncake_bootstrap")
            env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap)
        elif config.connector == "nixl":
            # vLLM listens on VLLM_NIXL_SIDE_CHANNEL_PORT + DP rank: one port per rank.
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(p.block(f"{name}.nixl_side_channel", dp))
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            env.update(extra_gpu_env)
        if platform == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(CPU_KVCACHE_GIB)
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind or "auto"
            if config.connector == "nixl":
                env[NIXL_DELAY_ENV] = str(CPU_NIXL_PROGRESS_DELAY_US)
        env.update(dict(config.extra_env))  # a config's own value wins ("" turns the delay off)
        argv = [
            python,
            "-m",
            API_SERVER_MODULE,
            "--model",
            decode_model if role == "decode" and decode_model else model_arg,
            "--served-model-name",
            config.model,
            "--host",
            host,
            "--port",
            str(port),
            "--tensor-parallel-size",
            str(tp),
        ]
        if dp > 1:
            argv += [
                "--data-parallel-size",
                str(dp),
                "--data-parallel-address",
                host,
                "--data-parallel-rpc-port",
                str(p.get(f"{name}.dp_rpc")),
            ]
        if role == "decode" and config.expert_parallel:
            argv += ["--enable-expert-parallel"]
        argv += remote_args
        if role == "prefill" or config.decode_kv_transfer:
            argv += [
                "--kv-transfer-config",
                json.dumps(kv_transfer_config(config, role, platform), sort_keys=True, separators=(",", ":")),
            ]
        else:
            warnings.append(
                f"{name} starts WITHOUT --kv-transfer-config (decode_kv_transfer = "
                "false, fault injection): it will recompute every prompt"
            )
        if shared:
            argv += ["--kv-cache-memory-bytes", str(config.shared_kv_cache_bytes)]
        elif platform == "cuda":
            argv += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
        if dtype not in (None, "auto"):
            argv += ["--dtype", dtype]
        if block is not None:
            argv += ["--block-size", str(block)]
        if config.max_model_len is not None:
            argv += ["--max-model-len", str(config.max_model_len)]
        if config.attention_backend:
            argv += ["--attention-backend", config.attention_backend]
        if platform == "cpu" and "--enforce-eager" not in config.extra_args:
            argv += ["--enforce-eager"]
        argv += list(config.extra_args)
        return ProcessSpec(
            name=name,
            role=role,
            argv=tuple(argv),
            env=tuple(env.items()),
            host=host,
            port=port,
            log_name=f"{name}.log",
            gpus=gpus,
            cpu_bind=bind,
            bootstrap_port=bootstrap if role == "prefill" else None,
            internal_ports=(internal, internal + INTERNAL_PORT_BLOCK - 1),
        )

    prefill = tuple(
        instance(
            "prefill",
            i,
            config.prefill_tp,
            p_gpus[i],
            p_binds[i],
            config.prefill_ports[i] if config.prefill_ports else None,
        )
        for i in range(config.num_prefill)
    )
    decode = tuple(
        instance(
            "decode",
            i,
            config.decode_tp,
            d_gpus[i],
            d_binds[i],
            config.decode_ports[i] if config.decode_ports else None,
        )
        for i in range(config.num_decode)
    )

    router_port = p.get("router.http", config.router_port)
    metrics_port = p.get("router.prometheus")
    rargv = router_argv(
        python,
        [(s.url, s.bootstrap_port) for s in prefill],
        [s.url for s in decode],
        connector=config.connector,
        host=host,
        port=router_port,
        metrics_port=metrics_port,
    )
    router = ProcessSpec(
        name="router",
        role="router",
        argv=tuple(rargv),
        env=(),
        host=host,
        port=router_port,
        log_name="router.log",
    )
    return ClusterPlan(
        config=config,
        platform=platform,
        model=model_arg,
        served_model_name=config.model,
        prefill=prefill,
        decode=decode,
        router=router,
        warnings=tuple(warnings),
        ports=tuple(p.taken),
        notes=tuple(notes),
        overrides=tuple(overrides),
    )


def router_argv(
    python: str,
    prefill: Sequence[tuple[str, int | None]],
    decode: Sequence[str],
    *,
    connector: str,
    host: str,
    port: int,
    metrics_port: int,
) -> list[str]:
    """vllm-router in vLLM P/D mode: ``prefill`` is (url, Mooncake bootstrap port or None)."""
    argv = [python, "-m", ROUTER_MODULE, "--vllm-pd-disaggregation"]
    for url, bootstrap in prefill:
        argv += ["--prefill", url] + ([str(bootstrap)] if bootstrap else [])
    for url in decode:
        argv += ["--decode", url]
    return argv + [
        "--kv-connector",
        connector,
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        # it starts with the instances: see them ready within a second, and
        # never give up before the harness's own deadline does
        "--worker-startup-check-interval",
        "1",
        "--worker-startup-timeout-secs",
        str(ROUTER_STARTUP_TIMEOUT_S),
        # a failed P/D hop must surface, not be retried into a pass
        "--disable-retries",
    ]
