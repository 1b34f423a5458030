"""Typed, frozen configs and their loading. Reads no environment, touches no GPU.

A *sweep* file (TOML, see ``pd_sessions/configs/``) holds defaults, per-platform
overrides and a list of cluster configs::

    name = "mooncake_sweep"
    [defaults]            # fields of ClusterConfig
    [platform.cpu]        # overrides applied on the CPU lane
    [[config]]            # one table per cluster config: name + fields

Every value is validated when a :class:`ClusterConfig` is built; errors name the
file, the field, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from pd_sessions.core import check_registry as registry
from pd_sessions.core import connectors
from pd_sessions.core.errors import ConfigError, did_you_mean

# The closed choices: the Literal types for mypy, the tuples (the same values) for the runtime checks
# that name the field and the allowed values when a TOML file or a --set override gets one wrong.
Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Platform = Literal["cpu", "cuda"]
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
PLATFORMS: tuple[Platform, ...] = get_args(Platform)
PARITY_MODES = ("auto", "exact", "margin")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
# Model values that ask for one of the project's own generated tiny models.
TINY_MODELS = ("tiny-llama", "tiny-mixtral", "tiny-kimi-linear", "tiny-llama-remote", "dummy-llama-1b")
# Generated models written without weights: every instance gets --load-format dummy.
DUMMY_WEIGHT_MODELS = ("dummy-llama-1b",)
MAX_TP = 8
MAX_INSTANCES = 8


@dataclass(frozen=True)
class ClusterConfig:
    """One P/D cluster: prefill instances + decode instances + one router."""

    # Short name used in plans, results and `--only` (e.g. "tp1x1").
    name: str
    # Hub id or local path of the model, or "tiny-llama" for the generated model.
    model: str
    # KV connector: one of the registry's (pd_sessions/core/connectors/: "mooncake", "nixl", ...).
    connector: str = connectors.DEFAULT.name
    # How many prefill and decode vLLM instances to start.
    num_prefill: int = 1
    num_decode: int = 1
    # Tensor-parallel size of each prefill / decode instance.
    prefill_tp: int = 1
    decode_tp: int = 1
    # Data-parallel size of each decode instance (DP ranks, each decode_tp GPUs).
    decode_dp: int = 1
    # --enable-expert-parallel on the decode instances (MoE models only).
    expert_parallel: bool = False
    # The model is a mixture of experts (DP/EP is only allowed then).
    moe: bool = False
    # The model is hybrid (linear-attention/Mamba layers beside attention, e.g. Kimi-Linear):
    # vLLM derives its KV block size from the per-GPU state, so P and D may disagree; over
    # NIXL the planner then requires an explicit block_size. Set it for tiny-kimi-linear too.
    hybrid: bool = False
    # --trust-remote-code: only with a pinned revision, or the CLI's --allow-unpinned-remote-code.
    trust_remote_code: bool = False
    # Hub commit the model and tokenizer are pinned to (--revision, --tokenizer-revision).
    revision: str | None = None
    # --gpu-memory-utilization for every instance (ignored on the CPU lane), in (0, 1].
    gpu_memory_utilization: float = 0.6
    # --block-size; None = vLLM's default on GPU, 128 on the CPU lane (must be a multiple of 32 there).
    block_size: int | None = None
    # --max-model-len; None = the model's own limit.
    max_model_len: int | None = None
    # --dtype; None = platform default (auto on GPU, float32 on CPU: bf16 SIGILLs there).
    dtype: Dtype | None = None
    # Extra `vllm serve` arguments, one list element per argv element (never a string to split).
    extra_args: tuple[str, ...] = ()
    # More arguments for decode instances only, after extra_args (e.g. the preemption sweep's
    # ["--num-gpu-blocks-override", "16"]: a decode KV cache smaller than a burst needs).
    decode_extra_args: tuple[str, ...] = ()
    # Extra environment for every vLLM instance, as (name, value) pairs.
    extra_env: tuple[tuple[str, str], ...] = ()
    # VLLM_ATTENTION_BACKEND / --attention-backend value; None = vLLM chooses.
    attention_backend: str | None = None
    # Mooncake transport: "rdma" or "tcp" (the CPU lane always uses tcp). The connector options
    # (these two) are declared with their choices and flags in their connector's module.
    mooncake_protocol: str = "rdma"
    # Mooncake RDMA device (HCA) allow-list, e.g. "mlx5_12"; "" = let Mooncake choose.
    mooncake_device_name: str = ""
    # Explicit ports; None/() = allocate free ones on the host. Honoured and checked.
    router_port: int | None = None
    prefill_ports: tuple[int, ...] = ()
    decode_ports: tuple[int, ...] = ()
    # Address every process binds and advertises (one host). Across hosts (``--ray``) each
    # instance binds and advertises its own host's address; the router keeps this one.
    host: str = "127.0.0.1"
    # Across hosts (``--ray``): which Ray nodes serve each role, as node-label selectors
    # "key=value" (a node matching any entry serves that role), e.g. ["pd-role=prefill"].
    # Empty: the nodes other than the driver's, sorted by address, the first half prefill.
    prefill_hosts: tuple[str, ...] = ()
    decode_hosts: tuple[str, ...] = ()
    # KV cache bytes per instance when instances share a GPU (--share-gpus): vLLM then
    # skips memory profiling, which races when two instances profile one GPU.
    shared_kv_cache_bytes: int = 2 * 1024**3
    # Fault injection for the KV check's own test: false starts decode instances without
    # --kv-transfer-config, so they silently recompute. Never set it in a real sweep.
    decode_kv_transfer: bool = True
    # Parity mode: "auto" (exact when prefill-0 and decode share one numeric layout, else
    # margin), "exact" (token for token) or "margin" (teacher-forced logprobs within
    # parity_margin nats of the reference's top-1). See pd_sessions/checks/parity.py.
    parity_mode: str = "auto"
    # Margin mode's allowed logprob gap (nats) between the reference's top-1 and a P/D token.
    parity_margin: float = 1.0
    # Fault injection for parity's own test: decode instances load the tiny model generated
    # with this weight seed (same tokenizer and shapes, other weights). Tiny models only;
    # never set it in a real sweep.
    decode_weights_seed: int | None = None
    # vLLM's kv_load_failure_policy for a KV load that fails: "fail" (the request ends with an
    # error) or "recompute" (the decode computes the prompt itself); None = vLLM's default.
    kv_load_failure_policy: str | None = None
    # Retries the P/D path makes on purpose (a load balancer or proxy in front of an instance
    # that retries a failed call): each request may then make up to 1 + this many calls to each
    # hop (prefill, decode); 0 = exactly one of each (the pd_calls check holds it).
    declared_retries: int = 0

    def __post_init__(self) -> None:
        validate_cluster(self)

    @property
    def shape(self) -> str:
        """Human shape, e.g. 'P1xTP2 + D1xTP2'."""
        dp = f",DP{self.decode_dp}" if self.decode_dp > 1 else ""
        ep = "+EP" if self.expert_parallel else ""
        return f"{self.num_prefill}xP(TP{self.prefill_tp}) + {self.num_decode}xD(TP{self.decode_tp}{dp}{ep})"

    @property
    def injected(self) -> dict[str, Any]:
        """The fault-injection settings this config sets (its result's "injected": the recall
        table, core/recall_table.py, finds the bug classes they inject by them): decode_weights_seed
        when set, decode_kv_transfer when false, decode_num_gpu_blocks_override when the decode's
        extra arguments cap its KV cache (``--num-gpu-blocks-override N``)."""
        out: dict[str, Any] = {}
        if self.decode_weights_seed is not None:
            out["decode_weights_seed"] = self.decode_weights_seed
        if not self.decode_kv_transfer:
            out["decode_kv_transfer"] = False
        blocks = _flag_value(self.decode_extra_args, "--num-gpu-blocks-override")
        if blocks is not None and blocks.isdigit():
            out["decode_num_gpu_blocks_override"] = int(blocks)
        return out

    @property
    def decode_ranks(self) -> int:
        return self.decode_tp * self.decode_dp


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value ``args`` give ``flag`` (``flag V`` or ``flag=V``; the last one wins), or None."""
    found = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


@dataclass(frozen=True)
class SweepEntry:
    """A cluster config as it sits in a sweep, with its per-platform policy."""

    config: ClusterConfig
    # Platforms where this config runs by default; elsewhere only with --include-opt-in.
    default_on: tuple[str, ...] = PLATFORMS
    # Why it is opt-in where it is (printed in the banner).
    opt_in_reason: str = ""


@dataclass(frozen=True)
class Sweep:
    name: str
    description: str
    source: str
    # Platforms this sweep can run on at all (a GPU-only nightly says ["cuda"]).
    platforms: tuple[str, ...]
    # entries resolved per platform (overrides applied)
    entries_by_platform: dict[str, tuple[SweepEntry, ...]] = field(hash=False)
    # Checks run on every config, in running order (TOML `checks = [...]`; default: the
    # registry's defaults), and their options (TOML `[check_options.<check>]`).
    checks: tuple[str, ...] = registry.DEFAULTS
    check_options: dict[str, dict[str, Any]] = field(default_factory=dict, hash=False)
    # Whether the TOML listed its checks; if not, each platform runs its own defaults.
    checks_listed: bool = False
    # The checks that must run (TOML `required_checks = [...]`): one of them NOT RUN (it could not
    # look: no netem, no perf baseline) fails its config. None (the key left out): every check the
    # sweep itself runs on the platform (checks_on) but perf (no baseline is NOT RUN: required
    # only where named); checks added with --check are not required unless named here. --strict
    # makes every NOT RUN fail.
    required: tuple[str, ...] | None = None

    def checks_on(self, platform: str) -> tuple[str, ...]:
        """The checks this sweep runs on ``platform``: its own list, else the platform's defaults
        (perf is a default on cuda only: see check_registry)."""
        return self.checks if self.checks_listed else registry.defaults(platform)

    def required_on(self, platform: str) -> tuple[str, ...]:
        """The checks that must run on ``platform``: the declared ones, else the sweep's own that
        the registry marks required (all but perf: CheckInfo.required)."""
        if self.required is not None:
            return self.required
        return tuple(c for c in self.checks_on(platform) if registry.BY_NAME[c].required)

    def entries(self, platform: str) -> tuple[SweepEntry, ...]:
        if platform not in self.entries_by_platform:
            raise ConfigError(
                "platform", f"sweep {self.name} runs on {', '.join(self.platforms)} only, not {platform}"
            )
        return self.entries_by_platform[platform]

    def gpus_needed(self) -> int:
        """The most GPUs any config of this sweep needs (for the cuda platform)."""
        return max(
            e.config.num_prefill * e.config.prefill_tp + e.config.num_decode * e.config.decode_ranks
            for e in self.entries(self.platforms[-1])
        )


# ---------------------------------------------------------------- validation


def _check_int(cfg_field: str, value: Any, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ConfigError(cfg_field, f"got {value!r}; allowed: an integer from {lo} to {hi}")


def _check_choice(cfg_field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = did_you_mean(str(value), choices)
        raise ConfigError(cfg_field, f"got {value!r}; allowed: {', '.join(choices)}{hint}")


def _check_port(cfg_field: str, value: Any) -> None:
    _check_int(cfg_field, value, 1024, 65535)


def validate_cluster(c: ClusterConfig) -> None:
    """Raise ConfigError naming the first bad field of ``c``."""
    if not c.name or not all(ch.isalnum() or ch in "-_." for ch in c.name):
        raise ConfigError("name", f"got {c.name!r}; allowed: letters, digits, '-', '_', '.'")
    if not isinstance(c.model, str) or not c.model:
        raise ConfigError(
            "model", f"got {c.model!r}; allowed: a hub id, a local path or one of {', '.join(TINY_MODELS)}"
        )
    connectors.get(c.connector)  # ConfigError("connector") naming the registered ones
    _check_int("num_prefill", c.num_prefill, 1, MAX_INSTANCES)
    _check_int("num_decode", c.num_decode, 1, MAX_INSTANCES)
    _check_int("prefill_tp", c.prefill_tp, 1, MAX_TP)
    _check_int("decode_tp", c.decode_tp, 1, MAX_TP)
    _check_int("decode_dp", c.decode_dp, 1, MAX_TP)
    for flag in ("expert_parallel", "moe", "hybrid", "trust_remote_code"):
        if not isinstance(getattr(c, flag), bool):
            raise ConfigError(flag, f"got {getattr(c, flag)!r}; allowed: true, false")
    if (c.expert_parallel or c.decode_dp > 1) and not c.moe:
        raise ConfigError(
            "expert_parallel" if c.expert_parallel else "decode_dp",
            f"decode DP/EP is only for mixture-of-experts models; {c.model!r} is not "
            "marked moe = true in the config",
        )
    _check_engine_fields(c)
    _check_ports_fields(c)
    _check_int("shared_kv_cache_bytes", c.shared_kv_cache_bytes, 64 * 1024**2, 1024**4)
    _check_choice("parity_mode", c.parity_mode, PARITY_MODES)
    m = c.parity_margin
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m <= 10.0:
        raise ConfigError("parity_margin", f"got {m!r}; allowed: a number of nats from 0 to 10 (e.g. 1.0)")
    if c.decode_weights_seed is not None:
        _check_int("decode_weights_seed", c.decode_weights_seed, 0, 2**31 - 1)
        if c.model not in TINY_MODELS:
            raise ConfigError(
                "decode_weights_seed",
                f"only for the generated tiny models ({', '.join(TINY_MODELS)}), not {c.model!r}",
            )
    _check_int("declared_retries", c.declared_retries, 0, 10)
    if c.kv_load_failure_policy is not None:
        _check_choice("kv_load_failure_policy", c.kv_load_failure_policy, KV_LOAD_FAILURE_POLICIES)
    if c.host != "127.0.0.1" and not c.host:
        raise ConfigError("host", "must not be empty")
    for name in ("prefill_hosts", "decode_hosts"):
        _check_selectors(name, getattr(c, name))


def _check_engine_fields(c: ClusterConfig) -> None:
    """What vLLM is started with: the revision, memory, block size, length, dtype, extra
    arguments and environment, the connector's own fields."""
    if c.revision is not None and (not isinstance(c.revision, str) or not c.revision.strip()):
        raise ConfigError("revision", f"got {c.revision!r}; allowed: a commit hash or tag")
    u = c.gpu_memory_utilization
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
        raise ConfigError("gpu_memory_utilization", f"got {u!r}; allowed: a number in (0, 1]")
    if c.block_size is not None:
        _check_int("block_size", c.block_size, 1, 4096)
    if c.max_model_len is not None:
        _check_int("max_model_len", c.max_model_len, 16, 10_000_000)
    if c.dtype is not None:
        _check_choice("dtype", c.dtype, DTYPES)
    for name in ("extra_args", "decode_extra_args"):
        value = getattr(c, name)
        if not isinstance(value, tuple) or not all(isinstance(a, str) for a in value):
            raise ConfigError(
                name,
                f'got {value!r}; allowed: a list of strings, one per argument (e.g. ["--enforce-eager"])',
            )
    if not isinstance(c.extra_env, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in c.extra_env
    ):
        raise ConfigError("extra_env", f"got {c.extra_env!r}; allowed: a table of string values")
    for option in connectors.options():
        value = getattr(c, option.field)
        if option.choices:
            _check_choice(option.field, value, option.choices)
        elif not isinstance(value, str):
            raise ConfigError(option.field, f"got {value!r}; allowed: a string")


def _check_ports_fields(c: ClusterConfig) -> None:
    """Explicit ports: in range, one per instance, none used twice."""
    if c.router_port is not None:
        _check_port("router_port", c.router_port)
    for name, ports, count in (
        ("prefill_ports", c.prefill_ports, c.num_prefill),
        ("decode_ports", c.decode_ports, c.num_decode),
    ):
        if ports:
            if len(ports) != count:
                raise ConfigError(
                    name,
                    f"got {len(ports)} ports {list(ports)}; allowed: none "
                    f"(allocate) or exactly {count} (one per instance)",
                )
            for p in ports:
                _check_port(name, p)
    explicit = [p for p in (c.router_port, *c.prefill_ports, *c.decode_ports) if p is not None]
    dupes = sorted({p for p in explicit if explicit.count(p) > 1})
    if dupes:
        raise ConfigError("ports", f"port(s) {dupes} used more than once; every port must be unique")


def _check_selectors(cfg_field: str, value: Any) -> None:
    """Node-label selectors: a list of "key=value" strings, each with a key and a value."""
    if not isinstance(value, tuple) or not all(isinstance(s, str) for s in value):
        raise ConfigError(cfg_field, f'got {value!r}; allowed: a list of "key=value" node labels')
    for s in value:
        key, eq, val = s.partition("=")
        if not eq or not key.strip() or not val.strip():
            raise ConfigError(
                cfg_field,
                f'got {s!r}; allowed: "key=value", a Ray node label (e.g. "pd-role=prefill", set '
                "with `ray start --labels pd-role=prefill`)",
            )


# ---------------------------------------------------------------- loading

_FIELDS = {f.name: f for f in dataclasses.fields(ClusterConfig)}
_TUPLE_FIELDS = {
    "extra_args",
    "decode_extra_args",
    "prefill_ports",
    "decode_ports",
    "prefill_hosts",
    "decode_hosts",
}


def _coerce(raw: dict[str, Any], *, where: str) -> dict[str, Any]:
    """Turn TOML values into ClusterConfig field values; unknown keys are errors."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _FIELDS:
            raise ConfigError(
                key,
                f"unknown field{did_you_mean(key, _FIELDS)}; allowed: {', '.join(sorted(_FIELDS))}",
                source=where,
            )
        if key in _TUPLE_FIELDS:
            if not isinstance(value, list):
                raise ConfigError(key, f"got {value!r}; allowed: a list", source=where)
            value = tuple(value)
        elif key == "extra_env":
            if not isinstance(value, dict):
                raise ConfigError(key, f'got {value!r}; allowed: a table NAME = "value"', source=where)
            value = tuple((str(k), v if isinstance(v, str) else repr(v)) for k, v in value.items())
        out[key] = value
    return out


# The fields a config must set (no default), in the project's words: what each expects. A test
# keeps this table equal to ClusterConfig's fields without a default.
REQUIRED: dict[str, str] = {
    "name": (
        'a short name for plans, results and --only (letters, digits, "-", "_", "."), e.g. name = "1x1"'
    ),
    "model": (
        'the model to serve: a hub id (e.g. model = "Qwen/Qwen3-0.6B"), a local path or one of '
        + ", ".join(TINY_MODELS)
        + "; set it in [defaults], [platform.<lane>] or this [[config]]"
    ),
}


def missing_fields(fields: Mapping[str, Any]) -> list[str]:
    """The required fields (:data:`REQUIRED`) that ``fields`` does not set, in the table's order."""
    return [f for f in REQUIRED if f not in fields]


def make_cluster(fields: dict[str, Any], *, where: str) -> ClusterConfig:
    """Build a ClusterConfig, re-raising validation errors with ``where`` attached.

    required fields missing -> ConfigError naming every missing field and what it expects
    a bad value             -> the validation's ConfigError, with ``where``
    """
    missing = missing_fields(fields)
    if missing:
        if len(missing) == 1:
            what = f"it: {REQUIRED[missing[0]]}"
        else:
            what = "them: " + "; ".join(f"{f}: {REQUIRED[f]}" for f in missing)
        raise ConfigError(", ".join(missing), f"missing; every config needs {what}", source=where)
    try:
        return ClusterConfig(**fields)
    except ConfigError as e:
        raise ConfigError(e.field, str(e).split(": ", 1)[1], source=where) from None


# The top-level keys of a sweep file.
SWEEP_KEYS = [
    "name", "description", "platforms", "defaults", "platform", "config", "checks", "required_checks",
    "check_options",
]  # fmt: skip


def load_sweep(path: Path) -> Sweep:
    """Load a sweep file; every error names the file and the field."""
    where = str(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("path", "sweep file not found", source=where) from None
    except IsADirectoryError:
        raise ConfigError("path", _directory_given(path), source=where) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("toml", str(e), source=where) from None
    for key in data:
        if key not in SWEEP_KEYS:
            raise ConfigError(key, f"unknown top-level key{did_you_mean(key, SWEEP_KEYS)}", source=where)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        got = "missing" if name is None else f"got {name!r}"
        raise ConfigError(
            "name",
            f"{got}; a sweep needs a name at the top of the file (it names the results folder "
            'and the summary), e.g. name = "my_sweep"',
            source=where,
        )
    defaults = _coerce(data.get("defaults", {}), where=f"{where} [defaults]")
    overrides = data.get("platform", {})
    for plat in overrides:
        _check_choice_src("platform", plat, PLATFORMS, where)
    raw_configs = data.get("config", [])
    if not raw_configs:
        raise ConfigError("config", "a sweep needs at least one [[config]] table", source=where)
    platforms = tuple(data.get("platforms", PLATFORMS))
    for plat in platforms:
        _check_choice_src("platforms", plat, PLATFORMS, where)
    by_platform: dict[str, tuple[SweepEntry, ...]] = {}
    for plat in platforms:
        plat_over = _coerce(overrides.get(plat, {}), where=f"{where} [platform.{plat}]")
        entries = []
        seen: set[str] = set()
        for i, raw in enumerate(raw_configs):
            loc = f"{where} [[config]] #{i + 1}"
            raw = dict(raw)
            default_on = tuple(raw.pop("default_on", PLATFORMS))
            for p in default_on:
                _check_choice_src("default_on", p, PLATFORMS, loc)
            reason = raw.pop("opt_in_reason", "")
            fields = {**defaults, **_coerce(raw, where=loc), **plat_over}
            cfg = make_cluster(fields, where=loc)
            if cfg.name in seen:
                raise ConfigError("name", f"config name {cfg.name!r} appears twice", source=loc)
            seen.add(cfg.name)
            if plat not in default_on and not reason:
                raise ConfigError(
                    "opt_in_reason",
                    f"config {cfg.name!r} is opt-in on {plat}: say why in opt_in_reason",
                    source=loc,
                )
            entries.append(SweepEntry(cfg, default_on, reason))
        by_platform[plat] = tuple(entries)
    checks = registry.resolve(data.get("checks"), source=where)
    required = _required_checks(data, where)
    check_options = registry.resolve_options(data.get("check_options"), source=where)
    return Sweep(
        name=name,
        description=data.get("description", ""),
        source=where,
        platforms=platforms,
        entries_by_platform=by_platform,
        checks=checks,
        check_options=check_options,
        checks_listed="checks" in data,
        required=required,
    )


def _required_checks(data: dict[str, Any], where: str) -> tuple[str, ...] | None:
    """``required_checks``: None when the key is left out; [] (nothing required) or check names,
    validated like ``checks`` (an unknown name is a ConfigError naming it)."""
    if "required_checks" not in data:
        return None
    value = data["required_checks"]
    if value == []:
        return ()
    return registry.resolve(value, field_name="required_checks", source=where)


def _check_choice_src(cfg_field: str, value: Any, choices: tuple[str, ...], where: str) -> None:
    try:
        _check_choice(cfg_field, value, choices)
    except ConfigError as e:
        raise ConfigError(e.field, str(e).split(": ", 1)[1], source=where) from None


CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def load(name: str) -> Sweep:
    """A built-in sweep by name, or a sweep .toml file."""
    path = Path(name)
    if name.endswith(".toml") or path.exists():
        return load_sweep(path)
    return builtin_sweep(name)


def _directory_given(path: Path) -> str:
    """What to say when the sweep file given is a directory: the .toml files in it, if any."""
    tomls = sorted(p.name for p in path.glob("*.toml"))
    inside = f" (it holds {', '.join(tomls[:5])}{', ...' if len(tomls) > 5 else ''})" if tomls else ""
    return f"is a directory, not a sweep file{inside}; give a .toml file's path or a built-in sweep name"


def builtin_sweep(name: str) -> Sweep:
    """Load ``pd_sessions/configs/<name>.toml``."""
    known = builtin_sweep_names()
    if name not in known:
        raise ConfigError(
            "sweep", f"no sweep named {name!r}{did_you_mean(name, known)}; known: {', '.join(known)}"
        )
    return load_sweep(CONFIG_DIR / f"{name}.toml")


def builtin_sweep_names() -> list[str]:
    """The built-in sweeps: files in configs/ with [[config]] tables (baselines.toml is data)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml") if "config" in tomllib.loads(p.read_text()))


def select(
    entries: tuple[SweepEntry, ...],
    platform: str,
    *,
    only: tuple[str, ...] = (),
    include_opt_in: bool = False,
) -> tuple[tuple[SweepEntry, ...], tuple[SweepEntry, ...]]:
    """Choose which entries run. Returns (selected, left_out).

    Decision table:
        --only names the entry          -> runs (opt-in or not)
        --only given, entry not named   -> left out
        entry default on this platform  -> runs
        entry opt-in here, flag given   -> runs
        entry opt-in here, no flag      -> left out (reason printed by the caller)
    """
    names = [e.config.name for e in entries]
    for o in only:
        if o not in names:
            raise ConfigError(
                "--only", f"no config named {o!r}{did_you_mean(o, names)}; known: {', '.join(names)}"
            )
    selected: list[SweepEntry] = []
    left: list[SweepEntry] = []
    for e in entries:
        if only:
            (selected if e.config.name in only else left).append(e)
        elif platform in e.default_on or include_opt_in:
            selected.append(e)
        else:
            left.append(e)
    return tuple(selected), tuple(left)


# ---------------------------------------------------------------- per-run overrides

# Fields a command line may not change (``--only`` selects configs by name).
NOT_OVERRIDABLE = ("name",)
OVERRIDE_SOURCE = "command line"


def parse_value(raw: str) -> Any:
    """A ``--set`` value, read as a TOML value; a bare word is a string.

    "16" -> 16   "0.8" -> 0.8   "true" -> True   '["--a", "b"]' -> ["--a", "b"]
    "{A = \"1\"}" -> {"A": "1"}   "FLASHINFER" -> "FLASHINFER"   '"16"' -> "16"
    """
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


@dataclass(frozen=True)
class Overrides:
    """What the command line changes in every selected config, in the order given."""

    # (field, value) pairs, values already parsed (TOML types).
    fields: tuple[tuple[str, Any], ...] = ()
    # Appended to each config's extra_args (not replacing them).
    extra_args: tuple[str, ...] = ()
    # ``--set checks=[...]``: the sweep's top-level ``checks``, replaced (in running order).
    checks: tuple[str, ...] | None = None
    # ``--set check_options.CHECK.OPTION=VALUE``: (check, option, value), each checked already.
    check_options: tuple[tuple[str, str, Any], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.fields or self.extra_args)

    def describe(self) -> list[str]:
        """One line per override, as recorded in plan.txt, result.json and the summary."""
        out = [f"{k} = {v!r}" for k, v in self.fields]
        out += [f"extra_args += {a!r}" for a in self.extra_args]
        if self.checks is not None:
            out.append(f"checks = {list(self.checks)!r}")
        out += [f"check_options.{c}.{k} = {v!r}" for c, k, v in self.check_options]
        return out

    def apply_check_options(self, base: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        """The sweep's check options (``[check_options.X]``, defaults filled in) with the
        command line's ``--set check_options.X.Y=V`` over them."""
        out = {check: dict(opts) for check, opts in base.items()}
        for check, key, value in self.check_options:
            out.setdefault(check, {})[key] = value
        return out

    def apply(self, config: ClusterConfig) -> ClusterConfig:
        """``config`` with the overrides, validated exactly like a TOML config."""
        if not self:
            return config
        current = {f: getattr(config, f) for f in _FIELDS}
        raw = dict(self.fields)
        if self.extra_args:
            raw["extra_args"] = [*config.extra_args, *self.extra_args]
        updated = _coerce(raw, where=OVERRIDE_SOURCE)
        return make_cluster({**current, **updated}, where=OVERRIDE_SOURCE)


def make_overrides(
    *,
    sets: Sequence[str] = (),
    model: str | None = None,
    revision: str | None = None,
    extra_args: Sequence[str] = (),
    named: Mapping[str, Any] | None = None,
) -> Overrides:
    """Build and check the command line's overrides (nothing is applied yet).

    ``sets`` are ``FIELD=VALUE`` items; ``named`` are fields set by their own flags
    (--mooncake-protocol ...). An unknown field, a field that cannot be overridden or a
    malformed item is a ConfigError naming it; values are checked when applied.
    ``checks=[...]`` is the sweep's own key, not a config field: it replaces the sweep's
    checks, checked at once like the TOML's (e.g. to add the opt-in ``perf`` on the CPU lane).
    """
    fields: list[tuple[str, Any]] = []
    checks: tuple[str, ...] | None = None
    check_opts: list[tuple[str, str, Any]] = []
    if model is not None:
        fields.append(("model", model))
    if revision is not None:
        fields.append(("revision", revision))
    fields += [(k, v) for k, v in (named or {}).items() if v is not None]
    for item in sets:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(
                "--set", f"got {item!r}; expected FIELD=VALUE, e.g. block_size=16", source=OVERRIDE_SOURCE
            )
        if key == "checks":
            checks = registry.resolve(parse_value(raw.strip()), source=OVERRIDE_SOURCE)
            continue
        if key.startswith("check_options"):
            check_opts.append(_check_option(key, parse_value(raw.strip())))
            continue
        fields.append((key, parse_value(raw.strip())))
    for key, _ in fields:
        if key in NOT_OVERRIDABLE:
            raise ConfigError(key, "cannot be overridden; select configs with --only", source=OVERRIDE_SOURCE)
        if key not in _FIELDS:
            raise ConfigError(
                key,
                f"unknown field{did_you_mean(key, _FIELDS)}; "
                f"allowed: {', '.join(sorted(set(_FIELDS) - set(NOT_OVERRIDABLE)))} "
                "(and the sweep's checks)",
                source=OVERRIDE_SOURCE,
            )
    for a in extra_args:
        if not isinstance(a, str) or not a:
            raise ConfigError(
                "--extra-arg", f"got {a!r}; allowed: one non-empty argv element", source=OVERRIDE_SOURCE
            )
    return Overrides(
        fields=tuple(fields), extra_args=tuple(extra_args), checks=checks, check_options=tuple(check_opts)
    )


def _check_option(key: str, value: Any) -> tuple[str, str, Any]:
    """``--set check_options.CHECK.OPTION=VALUE`` -> (check, option, value), checked as the
    sweep's ``[check_options.CHECK]`` table is (unknown check or option, wrong type: the
    ConfigError names it)."""
    parts = key.split(".")
    if len(parts) != 3 or not all(parts):
        raise ConfigError(
            "--set",
            f"got {key!r}; expected check_options.CHECK.OPTION=VALUE, e.g. check_options.wire_loss.rates=[2]",
            source=OVERRIDE_SOURCE,
        )
    _, check, option = parts
    return (
        check,
        option,
        registry.resolve_options({check: {option: value}}, source=OVERRIDE_SOURCE)[check][option],
    )
