"""The generated tiny models: one generator, a spec each; the Kimi-Linear's config and weight
names against vLLM's own model class; remote code that needs trust_remote_code."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.needs import needs
from helpers.waiting import free_port

from pd_sessions.core.config import TINY_MODELS
from pd_sessions.runtime import tiny_model as tm

HERE = Path(__file__).parent

# The config.json that served on one H200 with vLLM 0.26 (docs: the gpu-x2 notes).
SERVED_ON_H200 = json.loads("""{"architectures":["KimiLinearForCausalLM"],"model_type":"kimi_linear",
  "vocab_size":1024,
  "bos_token_id":0,"eos_token_id":1,"pad_token_id":2,"tie_word_embeddings":false,
  "max_position_embeddings":8192,"hidden_size":256,"intermediate_size":512,"hidden_act":"silu",
  "rms_norm_eps":1e-05,"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":4,
  "head_dim":64,"q_lora_rank":null,"kv_lora_rank":512,"qk_nope_head_dim":128,"qk_rope_head_dim":64,
  "v_head_dim":128,"mla_use_nope":true,"rope_theta":10000.0,"num_experts":8,
  "num_experts_per_token":2,"num_shared_experts":1,"moe_intermediate_size":128,
  "moe_renormalize":true,"moe_router_activation_func":"sigmoid","routed_scaling_factor":2.446,
  "first_k_dense_replace":1,"moe_layer_freq":1,"use_grouped_topk":true,"num_expert_group":1,
  "topk_group":1,"num_nextn_predict_layers":0,"linear_attn_config":{"kda_layers":[1,2,3],
  "full_attn_layers":[4],"num_heads":4,"head_dim":128,"short_conv_kernel_size":4}}""")


def test_every_config_model_name_has_a_spec_and_the_key_follows_the_chat_template():
    assert set(TINY_MODELS) == set(tm.SPECS)
    # the keys since the tokenizers carry a chat template (before: 2f096378fb26, 556d5899e4ee)
    assert tm.SPECS["tiny-llama"].key() == "aea537ac66da"
    assert tm.SPECS["tiny-mixtral"].key() == "c1f9f93d1f8f"
    assert tm.spec_for("tiny-llama", weights_seed=1).key() != tm.SPECS["tiny-llama"].key()
    # another template is another model: its cache is not reused
    other = dataclasses.replace(tm.SPECS["tiny-llama"], chat_template="{{ messages[0]['content'] }}")
    assert other.key() != tm.SPECS["tiny-llama"].key()
    with pytest.raises(ValueError, match="known: tiny-llama"):
        tm.spec_for("tiny-gpt")


def test_kimi_linear_config_is_the_one_that_served():
    cfg = tm.kimi_linear_config(tm.SPECS["tiny-kimi-linear"], bos=0, eos=1, pad=2)
    assert {k: v for k, v in cfg.items() if k != "torch_dtype"} == SERVED_ON_H200


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    needs("torch")
    return tm.ensure(tm.SPECS["tiny-kimi-linear"], tmp_path_factory.mktemp("cache"))


@pytest.mark.procs
def test_kimi_linear_checkpoint_carries_the_real_names_and_a_few_mib(kimi_dir):
    from safetensors import safe_open

    with safe_open(str(kimi_dir / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    cfg = json.loads((kimi_dir / "config.json").read_text())
    assert shapes == tm.kimi_linear_shapes(cfg)
    assert "model.layers.0.self_attn.A_log" in shapes and shapes["model.layers.0.self_attn.A_log"] == (
        1,
        1,
        4,
        1,
    )
    assert "model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in shapes  # MLA, last layer
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in shapes  # MoE from layer 1
    assert "model.layers.0.mlp.gate_proj.weight" in shapes  # dense layer 0
    assert (kimi_dir / "model.safetensors").stat().st_size < 16 * 2**20
    assert cfg["auto_map"] == {"AutoConfig": "pd_tiny_remote.KimiLinearConfig"}
    assert (kimi_dir / "pd_tiny_remote.py").exists()


@pytest.mark.procs
def test_vllm_loads_every_parameter_of_the_tiny_kimi_linear_and_nothing_else(kimi_dir):
    """vLLM's own KimiLinearForCausalLM, built on CPU, loads exactly its parameters from our file."""
    needs("vllm")
    out = subprocess.run(
        [sys.executable, str(HERE / "vllm_kimi_load_check.py"), str(kimi_dir), str(free_port())],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["arch"] == "KimiLinearForCausalLM"
    assert got["params"] and got["loaded"] == got["params"]


@pytest.mark.procs
def test_remote_code_model_needs_trust_remote_code(tmp_path):
    needs("torch")
    d = tm.ensure(tm.SPECS["tiny-llama-remote"], tmp_path)
    code = (
        "import sys; from transformers import AutoTokenizer as A; "
        "t = A.from_pretrained(sys.argv[1], trust_remote_code=sys.argv[2] == '1'); print(type(t).__name__)"
    )
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path / "hf")}
    ok = subprocess.run(
        [sys.executable, "-c", code, str(d), "1"], capture_output=True, text=True, env=env, check=False
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "PdTinyTokenizerFast", ok.stderr[-2000:]
    no = subprocess.run(
        [sys.executable, "-c", code, str(d), "0"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert no.returncode != 0 and "trust_remote_code" in no.stderr


@pytest.mark.procs
def test_other_weights_seed_keeps_the_tokenizer(tmp_path):
    needs("torch")
    a = tm.ensure(tm.TinySpec(), tmp_path)
    b = tm.ensure(tm.spec_for("tiny-llama", weights_seed=1), tmp_path)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


@pytest.mark.procs
def test_the_generated_tokenizer_renders_chat(tmp_path):
    """/v1/chat/completions needs a chat template (vLLM answers 400 without one)."""
    needs("torch")
    from transformers import AutoTokenizer

    d = tm.ensure(tm.SPECS["tiny-llama"], tmp_path)
    tok = AutoTokenizer.from_pretrained(str(d))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Seven plus five?"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|> Be brief.\n<|user|> Seven plus five?\n<|assistant|> "
    assert json.loads((d / "pd_sessions_spec.json").read_text())["chat_template"] == tm.CHAT_TEMPLATE
