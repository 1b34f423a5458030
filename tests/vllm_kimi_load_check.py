"""Run by tests/test_tiny_model.py in a subprocess (vLLM's distributed state is per process):
instantiate vLLM's own KimiLinearForCausalLM on CPU for the generated model folder (argv[1]),
feed it the folder's weights through its load_weights, and print one JSON line with the
model's parameter names and those load_weights reported as loaded. GPU-only pieces it
reaches at construction (CUDA streams, the cute_dsl GEMM) are stubbed or switched off:
nothing here runs a kernel."""

import json
import os
import sys

os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")
os.environ.setdefault("VLLM_ENABLE_GEMM_RS", "0")
import torch
from safetensors.torch import load_file
from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.registry import ModelRegistry

path, port = sys.argv[1], sys.argv[2]

mc = ModelConfig(
    model=path,
    tokenizer=path,
    trust_remote_code=True,
    dtype="float32",
    max_model_len=1024,
    enforce_eager=True,
)
vc = VllmConfig(model_config=mc, cache_config=CacheConfig(enable_prefix_caching=False))
with set_current_vllm_config(vc):
    init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
    )
    initialize_model_parallel(1, 1)
    cls, arch = ModelRegistry.resolve_model_cls(mc.architectures, model_config=mc)

    class _NoStream:
        def __init__(self, *a, **k):
            pass

    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    model = cls(vllm_config=vc)
    params = sorted(n for n, _ in model.named_parameters())
    loaded = sorted(model.load_weights(iter(load_file(os.path.join(path, "model.safetensors")).items())))
print(
    json.dumps(
        {"class": f"{cls.__module__}.{cls.__name__}", "arch": arch, "params": params, "loaded": loaded}
    )
)
