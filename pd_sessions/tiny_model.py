"""A tiny, deterministic Llama the project generates itself (no hub access).

2 layers, hidden 128, 2 heads of 64, a 1k-token byte-level BPE tokenizer
trained locally on a seeded synthetic corpus, seeded random weights, float32.
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
    architecture: str = "llama"
    num_experts: int = 4           # mixtral only

    def key(self) -> str:
        blob = json.dumps({"v": GENERATOR_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """$PD_SESSIONS_CACHE, else $XDG_CACHE_HOME/pd-sessions, else ~/.cache/pd-sessions."""
    if os.environ.get("PD_SESSIONS_CACHE"):
        return Path(os.environ["PD_SESSIONS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pd-sessions"


def model_dir(spec: TinySpec, cache_dir: Path | None = None) -> Path:
    """Where the model for ``spec`` lives (pure: nothing is created)."""
    return (cache_dir or default_cache_dir()) / "models" / f"tiny-{spec.architecture}-{spec.key()}"


_WORDS = ("the a one two three four five six seven eight nine ten cat dog bird fish tree "
          "house river stone cloud rain sun moon star road city field apple bread water "
          "runs jumps sleeps eats sees finds takes gives makes reads writes sings walks "
          "red blue green small large old new quick slow happy quiet bright dark warm cold "
          "and or but then so because while after before under over near far with without "
          "plus minus times equals number answer question how many total left each").split()


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
    """Write tokenizer + config + weights for ``spec`` into ``out`` (must not exist)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if spec.architecture not in ("llama", "mixtral"):
        raise ValueError(f"unknown tiny architecture {spec.architecture!r}; allowed: llama, mixtral")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, show_progress=False,
                                  special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|pad|>")
    vocab = spec.vocab_size
    torch.manual_seed(spec.seed)
    common = dict(vocab_size=vocab, hidden_size=spec.hidden_size,
                  intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_heads, head_dim=spec.head_dim,
                  max_position_embeddings=spec.max_position_embeddings,
                  bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                  pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
    if spec.architecture == "mixtral":  # a mixture of experts, for the DP/EP decode shape
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(MixtralConfig(num_local_experts=spec.num_experts,
                                                 num_experts_per_tok=2, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():  # larger weights than HF's init give more varied greedy text
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    (out / "pd_sessions_spec.json").write_text(
        json.dumps({"generator_version": GENERATOR_VERSION, **asdict(spec)}, indent=2) + "\n")


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
