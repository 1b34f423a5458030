"""Tiny, deterministic models the project generates itself (no hub access).

One generator, one :class:`TinySpec` per model (:data:`SPECS`): a 1k-token byte-level BPE
tokenizer trained locally on a seeded synthetic corpus, with a chat template, and seeded random
weights, for
- tiny-llama: 2 layers, hidden 128, 2 heads of 64, float32;
- tiny-mixtral: the same with 4 experts (top-2), for DP/EP decode shapes;
- tiny-kimi-linear: KimiLinearForCausalLM (KDA + MLA + MoE with a shared expert), bf16,
  shaped like the real 48B config, ~13 MiB, with remote code (auto_map);
- tiny-llama-remote: tiny-llama with remote code, for the CPU lane (KDA is GPU only);
- dummy-llama-1b: shaped like Llama 3.2 1B (16 layers, hidden 2048, 32 heads of 64, 8 KV heads,
  1.2 B parameters) with the same tokenizer and NO weights: it serves with ``--load-format
  dummy`` (the planner adds it), so that KV transfers are big enough to measure (32 KiB of KV
  per token in bf16) without generating or carrying gigabytes.
Written once into a cache directory (atomic rename) and reused.

Heavy imports (torch, transformers, tokenizers) happen inside ``build`` only,
so the planner and the CLI's dry run never need them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Bump when the generator's output changes, so caches are not reused across versions.
GENERATOR_VERSION = 1

# The chat template every generated tokenizer carries, so that /v1/chat/completions really runs
# (without one vLLM answers 400). A spec field: changing it changes the model's cache key.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 2048
    architecture: str = "llama"  # llama | mixtral | kimi_linear
    num_experts: int = 4  # mixtral, kimi_linear
    # Seed of the weights when it differs from ``seed`` (the tokenizer always follows
    # ``seed``): another model with the same tokenizer and shapes, for parity's can-fail test.
    weights_seed: int | None = None
    # Ship a tokenizer class and a config class in the folder (auto_map), so that loading it
    # needs trust_remote_code, as hub models with their own code do.
    remote_code: bool = False
    # The tokenizer's chat template (jinja), part of the cache key.
    chat_template: str = CHAT_TEMPLATE
    # KV heads (grouped-query attention); None = num_heads.
    num_kv_heads: int | None = None
    # Write weights; False writes the config and tokenizer only (vLLM's --load-format dummy).
    weights: bool = True

    def key(self) -> str:
        fields = asdict(self)
        for name in _KEY_OPTIONAL:  # fields added later stay out of the key at their default,
            if fields[name] == _DEFAULTS[name]:  # so existing caches keep their names
                del fields[name]
        blob = json.dumps({"v": GENERATOR_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def name(self) -> str:
        return f"tiny-{self.architecture.replace('_', '-')}" + ("-remote" if self.remote_code else "")


_KEY_OPTIONAL = ("weights_seed", "remote_code", "num_kv_heads", "weights")
_DEFAULTS = {"weights_seed": None, "remote_code": False, "num_kv_heads": None, "weights": True}

# Model values of a config that name a generated model, and their specs.
SPECS: dict[str, TinySpec] = {
    "tiny-llama": TinySpec(),
    "tiny-mixtral": TinySpec(architecture="mixtral"),
    # Shaped like moonshotai/Kimi-Linear-48B-A3B-Instruct (KDA + MLA + MoE with a shared
    # expert), scaled down to the config that served on an H200 with vLLM 0.26.
    "tiny-kimi-linear": TinySpec(
        architecture="kimi_linear",
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
        num_experts=8,
        remote_code=True,
    ),
    # A Llama whose tokenizer and config classes ship in the folder (trust_remote_code), for the
    # CPU lane: the Kimi-Linear KDA kernels are Triton, GPU only.
    "tiny-llama-remote": TinySpec(remote_code=True),
    # Llama 3.2 1B's shape, no weights (served with --load-format dummy): big KV transfers.
    "dummy-llama-1b": TinySpec(
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        head_dim=64,
        num_kv_heads=8,
        max_position_embeddings=4096,
        weights=False,
    ),
}


def spec_for(model: str, *, weights_seed: int | None = None) -> TinySpec:
    """The spec of a generated model named in a config (e.g. "tiny-kimi-linear")."""
    if model not in SPECS:
        raise ValueError(f"unknown tiny model {model!r}; known: {', '.join(SPECS)}")
    import dataclasses

    return dataclasses.replace(SPECS[model], weights_seed=weights_seed)


def default_cache_dir() -> Path:
    """$PD_SESSIONS_CACHE, else $XDG_CACHE_HOME/pd-sessions, else ~/.cache/pd-sessions."""
    if os.environ.get("PD_SESSIONS_CACHE"):
        return Path(os.environ["PD_SESSIONS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pd-sessions"


def model_dir(spec: TinySpec, cache_dir: Path | None = None) -> Path:
    """Where the model for ``spec`` lives (pure: nothing is created)."""
    return (cache_dir or default_cache_dir()) / "models" / f"tiny-{spec.architecture}-{spec.key()}"


_WORDS = (
    "the a one two three four five six seven eight nine ten cat dog bird fish tree "
    "house river stone cloud rain sun moon star road city field apple bread water "
    "runs jumps sleeps eats sees finds takes gives makes reads writes sings walks "
    "red blue green small large old new quick slow happy quiet bright dark warm cold "
    "and or but then so because while after before under over near far with without "
    "plus minus times equals number answer question how many total left each"
).split()


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """A seeded synthetic English-like corpus with digits and arithmetic."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(5, 18)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.4:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            words += [str(a), "plus", str(b), "equals", str(a + b), "####", str(a + b)]
        out.append(" ".join(words).capitalize() + ".")
    return out


def build(spec: TinySpec, out: Path) -> None:
    """Write tokenizer + config + weights for ``spec`` into ``out`` (must not exist).

    One generator: the tokenizer, the seeding and the remote-code files are shared; each
    architecture adds its config and weights (:data:`_BUILDERS`).
    """
    import torch

    if spec.architecture not in _BUILDERS:
        raise ValueError(f"unknown tiny architecture {spec.architecture!r}; allowed: {', '.join(_BUILDERS)}")
    fast = _tokenizer(spec)
    fast.chat_template = spec.chat_template
    torch.manual_seed(spec.seed if spec.weights_seed is None else spec.weights_seed)
    out.mkdir(parents=True, exist_ok=True)
    _BUILDERS[spec.architecture](spec, fast, out)
    fast.save_pretrained(out)
    if spec.remote_code:
        _ship_remote_code(spec, out)
    (out / "pd_sessions_spec.json").write_text(
        json.dumps({"generator_version": GENERATOR_VERSION, **asdict(spec)}, indent=2) + "\n"
    )


def _tokenizer(spec: TinySpec):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        show_progress=False,
        special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(spec.seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


def _llama_like(spec: TinySpec, fast, out: Path) -> None:
    """Llama or Mixtral through transformers' own classes (their checkpoint names)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads or spec.num_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    if not spec.weights:  # served with --load-format dummy: the config is all vLLM reads
        LlamaConfig(**common).save_pretrained(out)
        return
    if spec.architecture == "mixtral":  # a mixture of experts, for the DP/EP decode shape
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(
            MixtralConfig(num_local_experts=spec.num_experts, num_experts_per_tok=2, **common)
        )
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():  # larger weights than HF's init give more varied greedy text
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)


# Kimi-Linear's fixed sub-shapes, from the config that served on an H200 (vLLM 0.26): MLA
# without q LoRA (vLLM asserts q_lora_rank is None and mla_use_nope), KDA heads 4 x 128.
KIMI_MLA = {
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
}
KIMI_KDA_HEADS, KIMI_KDA_HEAD_DIM, KIMI_SHORT_CONV = 4, 128, 4
KIMI_MOE_INTERMEDIATE = 128


def kimi_linear_config(spec: TinySpec, *, bos: int, eos: int, pad: int) -> dict:
    """config.json of the tiny Kimi-Linear: the real model's fields, small numbers. The last
    layer is MLA (full attention), the others KDA; layer numbers count from 1, as in the
    real config; layer 0 is dense (first_k_dense_replace = 1), the rest MoE."""
    n = spec.num_layers
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": spec.vocab_size,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "tie_word_embeddings": False,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "num_hidden_layers": n,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_heads,
        "head_dim": spec.head_dim,
        **KIMI_MLA,
        "rope_theta": 10000.0,
        "num_experts": spec.num_experts,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": KIMI_MOE_INTERMEDIATE,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 0,
        "torch_dtype": "bfloat16",
        "linear_attn_config": {
            "kda_layers": list(range(1, n)),
            "full_attn_layers": [n],
            "num_heads": KIMI_KDA_HEADS,
            "head_dim": KIMI_KDA_HEAD_DIM,
            "short_conv_kernel_size": KIMI_SHORT_CONV,
        },
    }


def kimi_linear_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, under the real checkpoint's names (those vLLM's
    KimiLinearForCausalLM.load_weights maps: q/k/v/f_a/f_b/g_a/g_b/b_proj, q/k/v_conv1d,
    A_log (1, 1, H, 1), dt_bias, o_norm for KDA; q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
    kv_b_proj for MLA; block_sparse_moe.experts.E.w1/w2/w3 + gate + shared_experts for MoE)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    la = cfg["linear_attn_config"]
    hh, hd, k = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    proj = hh * hd
    heads, nope, rope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    vh, lora = cfg["v_head_dim"], cfg["kv_lora_rank"]
    moe_i, e = cfg["moe_intermediate_size"], cfg["num_experts"]
    shared = moe_i * cfg["num_shared_experts"]
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        a = p + "self_attn."
        if i + 1 in la["kda_layers"]:
            for name in ("q_proj", "k_proj", "v_proj"):
                out[a + name + ".weight"] = (proj, h)
                out[a + name[0] + "_conv1d.weight"] = (proj, 1, k)
            out.update(
                {
                    a + "f_a_proj.weight": (hd, h),
                    a + "f_b_proj.weight": (proj, hd),
                    a + "g_a_proj.weight": (hd, h),
                    a + "g_b_proj.weight": (proj, hd),
                    a + "b_proj.weight": (hh, h),
                    a + "dt_bias": (proj,),
                    a + "A_log": (1, 1, hh, 1),
                    a + "o_norm.weight": (hd,),
                    a + "o_proj.weight": (h, proj),
                }
            )
        else:
            out.update(
                {
                    a + "q_proj.weight": (heads * (nope + rope), h),
                    a + "kv_a_proj_with_mqa.weight": (lora + rope, h),
                    a + "kv_a_layernorm.weight": (lora,),
                    a + "kv_b_proj.weight": (heads * (nope + vh), lora),
                    a + "o_proj.weight": (h, heads * vh),
                }
            )
        if i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0:
            m = p + "block_sparse_moe."
            out[m + "gate.weight"] = (e, h)
            out[m + "gate.e_score_correction_bias"] = (e,)
            for x in range(e):
                out.update(
                    {
                        f"{m}experts.{x}.w1.weight": (moe_i, h),
                        f"{m}experts.{x}.w3.weight": (moe_i, h),
                        f"{m}experts.{x}.w2.weight": (h, moe_i),
                    }
                )
            out.update(
                {
                    m + "shared_experts.gate_proj.weight": (shared, h),
                    m + "shared_experts.up_proj.weight": (shared, h),
                    m + "shared_experts.down_proj.weight": (h, shared),
                }
            )
        else:
            out.update(
                {
                    p + "mlp.gate_proj.weight": (cfg["intermediate_size"], h),
                    p + "mlp.up_proj.weight": (cfg["intermediate_size"], h),
                    p + "mlp.down_proj.weight": (h, cfg["intermediate_size"]),
                }
            )
    return out


def _kimi_linear(spec: TinySpec, fast, out: Path) -> None:
    """No transformers class needed (the GPU host's transformers may not know the model):
    the config as data, the weights as seeded tensors under the checkpoint's names."""
    import math

    import torch
    from safetensors.torch import save_file

    cfg = kimi_linear_config(spec, bos=fast.bos_token_id, eos=fast.eos_token_id, pad=fast.pad_token_id)
    tensors = {}
    for name, shape in sorted(kimi_linear_shapes(cfg).items()):
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith(("norm.weight", "layernorm.weight")):
            t = torch.ones(shape)
        elif leaf == "A_log":  # decay rates as the real init: log(U(1, 16))
            t = torch.empty(shape).uniform_(1, 16).log()
        elif leaf in ("dt_bias", "e_score_correction_bias"):
            t = torch.zeros(shape)
        else:  # fan-in scaled, so bf16 activations stay tame
            t = torch.randn(shape) * (0.5 / math.sqrt(shape[-1]))
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2)
        + "\n"
    )


_BUILDERS = {"llama": _llama_like, "mixtral": _llama_like, "kimi_linear": _kimi_linear}

REMOTE_MODULE = "pd_tiny_remote"
# The code a remote-code model ships: a tokenizer class and a config class per architecture.
REMOTE_CODE = """\
# Generated by pd_sessions.runtime.tiny_model: the classes this model folder's auto_map names, so that
# loading it needs trust_remote_code (as hub models with their own code do).
from transformers import PreTrainedTokenizerFast

try:
    from transformers import PretrainedConfig
except ImportError:  # transformers >= 5 spells it PreTrainedConfig
    from transformers import PreTrainedConfig as PretrainedConfig
from transformers import LlamaConfig


class PdTinyTokenizerFast(PreTrainedTokenizerFast):
    pass


class PdTinyLlamaConfig(LlamaConfig):
    pass


class KimiLinearConfig(PretrainedConfig):
    model_type = "kimi_linear"

    def __init__(self, linear_attn_config=None, **kwargs):
        self.linear_attn_config = linear_attn_config
        super().__init__(**kwargs)
"""
_REMOTE_CONFIG_CLASS = {"llama": "PdTinyLlamaConfig", "kimi_linear": "KimiLinearConfig"}


def _ship_remote_code(spec: TinySpec, out: Path) -> None:
    if spec.architecture not in _REMOTE_CONFIG_CLASS:
        raise ValueError(
            f"remote_code is not supported for {spec.architecture!r}; "
            f"allowed: {', '.join(_REMOTE_CONFIG_CLASS)}"
        )
    (out / f"{REMOTE_MODULE}.py").write_text(REMOTE_CODE)
    cfg_path, tok_path = out / "config.json", out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["auto_map"] = {"AutoConfig": f"{REMOTE_MODULE}.{_REMOTE_CONFIG_CLASS[spec.architecture]}"}
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    tok = json.loads(tok_path.read_text())
    tok["tokenizer_class"] = "PdTinyTokenizerFast"
    tok["auto_map"] = {"AutoTokenizer": [None, f"{REMOTE_MODULE}.PdTinyTokenizerFast"]}
    tok_path.write_text(json.dumps(tok, indent=2) + "\n")


def ensure(spec: TinySpec | None = None, cache_dir: Path | None = None) -> Path:
    """Return the model directory for ``spec``, generating it on first use."""
    spec = spec or TinySpec()
    final = model_dir(spec, cache_dir)
    if (final / "pd_sessions_spec.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        log.info("generating tiny model %s", final)
        build(spec, tmp / "m")
        try:
            os.rename(tmp / "m", final)
        except OSError:
            # Another process won the race: its copy is identical.
            if not (final / "pd_sessions_spec.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
