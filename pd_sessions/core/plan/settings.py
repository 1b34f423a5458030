"""Plan-wide settings: what a config means for every instance, decided before any is placed.

Each step returns a frozen result that holds its own warnings and notes; nothing here reads the
environment (the harness's values of GPU_PASSTHROUGH_ENV are passed in).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pd_sessions.core import connectors
from pd_sessions.core.config import TINY_MODELS, ClusterConfig, Dtype
from pd_sessions.core.errors import PlanError

CPU_DEFAULT_BLOCK_SIZE = 128
CPU_BLOCK_MULTIPLE = 32
# Environment a multi-GPU host may require of every GPU process (the lent H200 x2 host
# does: NVLink multicast off). Taken from the harness's own environment when set there.
GPU_PASSTHROUGH_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
# Generated models that are hybrid whatever the config says.
HYBRID_TINY_MODELS = ("tiny-kimi-linear",)


@dataclass(frozen=True)
class ModelSettings:
    """What every instance loads, and how (the remote-code policy)."""

    model: str  # what --model gets (path or hub id)
    decode_model: str | None  # what decode instances' --model gets instead, when set
    remote_args: tuple[str, ...]  # the remote-code policy's flags
    warnings: tuple[str, ...]
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Lane:
    """What the platform adds to every instance."""

    dtype: Dtype | None  # --dtype (None or "auto": left out)
    block_size: int | None  # --block-size (None: left out)
    gpu_env: tuple[tuple[str, str], ...]  # added to every GPU process's environment
    warnings: tuple[str, ...]
    notes: tuple[str, ...]


def model_settings(
    config: ClusterConfig, *, model: str | None, decode_model: str | None, allow_unpinned: bool
) -> ModelSettings:
    """--model for every instance, the remote-code flags, and what the config's flags cannot do.

    Checked in this order (the first that fails raises):
        remote code unpinned, not allowed        -> PlanError "revision"
        a generated tiny model without its path  -> PlanError "model"
        hybrid, connector needing one block size,
        no block size                            -> PlanError "block_size"
    Warnings, in order: unpinned remote code; flags that cannot take effect; decode instances
    loading other weights (``decode_model``, parity's fault injection). Notes: the hybrid block size.
    """
    remote_args, remote_warning = remote_code_args(config, allow_unpinned=allow_unpinned)
    if config.model in TINY_MODELS and model is None:
        raise PlanError("model", f"{config.model!r} needs the generated model's path")
    model_arg = model or config.model
    warnings = [remote_warning] if remote_warning else []
    warnings += flag_warnings(config)
    block_note = hybrid_block_size(config)
    if decode_model is not None:
        warnings.append(
            f"decode instances load {decode_model}, not {model_arg} (decode_weights_seed = "
            f"{config.decode_weights_seed}, fault injection): parity must fail"
        )
    return ModelSettings(
        model=model_arg,
        decode_model=decode_model,
        remote_args=tuple(remote_args),
        warnings=tuple(warnings),
        notes=(block_note,) if block_note else (),
    )


def lane_settings(config: ClusterConfig, platform: str, passthrough_env: Mapping[str, str]) -> Lane:
    """What ``platform`` adds to every instance.

    platform  dtype, block size                       env                     said
    cuda      the config's (None: vLLM's default)     gpu_env's passthrough   a note per variable
    cpu       float32, 128 or the config's (checked:  -                       the connector's CPU-lane
              _cpu_dtype_and_block raises)                                     warnings (values replaced)
    """
    if platform == "cuda":
        env, notes = gpu_env(passthrough_env, config.extra_env)
        return Lane(config.dtype, config.block_size, tuple(env.items()), (), tuple(notes))
    dtype, block = _cpu_dtype_and_block(config)
    warnings = connectors.get(config.connector).cpu_lane.warnings(config)
    return Lane(dtype, block, (), warnings, ())


def _cpu_dtype_and_block(config: ClusterConfig) -> tuple[Dtype, int]:
    """(--dtype, --block-size) on the CPU lane.

    dtype None, "auto" or "float32"   -> float32; any other -> PlanError "dtype" (bf16 SIGILLs)
    block_size None                   -> CPU_DEFAULT_BLOCK_SIZE
    block_size a multiple of 32       -> it; any other -> PlanError "block_size"
    """
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
            "vLLM, which derives unequal ones under different TP (a connector whose handshake "
            "compares block sizes then fails)"
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
    """A hybrid model over a connector whose handshake compares block sizes (its spec's
    ``limits.hybrid_needs_block_size``, NIXL's) needs one explicit block size on both sides.

        not hybrid, or the connector does not need it  -> None (nothing to say)
        hybrid, it needs it, block_size set            -> a note: both sides get --block-size N
        hybrid, it needs it, no block_size             -> PlanError naming the fix
    vLLM derives a hybrid model's block size from the per-GPU linear-attention state, which
    halves under TP2: on an H200, prefill TP2 chose 128 and decode DP2 240, and every NIXL
    handshake failed ("Local block size 240 is not divisible by remote block size 128").
    """
    spec = connectors.get(config.connector)
    # the config's word (``hybrid``); flag_warnings flags a known hybrid model without it
    if not config.hybrid or not spec.limits.hybrid_needs_block_size:
        return None
    if config.block_size is None:
        raise PlanError(
            "block_size",
            f"{config.name}: {config.model} is hybrid and the connector is {spec.title}: "
            "set block_size (e.g. 256) so prefill and decode register equal KV blocks; vLLM "
            "otherwise derives it from the per-GPU linear-attention state, which differs with "
            f"TP (TP2 prefill 128 vs DP decode 240 on an H200: every {spec.title} handshake failed)",
        )
    return (
        f"hybrid model over {spec.title}: --block-size {config.block_size} on both sides (vLLM would "
        "derive unequal sizes from the per-GPU state; it raises the size only when the state needs "
        "more, so check that both logs report the same block size)"
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
