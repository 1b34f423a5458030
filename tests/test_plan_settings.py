"""Plan-wide settings (core.plan.settings): what a config means for every instance; each step
returns its own warnings and notes."""

from __future__ import annotations

import pytest
from helpers.builders import cfg

from pd_sessions.core.errors import PlanError
from pd_sessions.core.plan.settings import lane_settings, model_settings


def test_model_settings_plain():
    m = model_settings(cfg(), model=None, decode_model=None, allow_unpinned=False)
    assert (m.model, m.decode_model, m.remote_args, m.warnings, m.notes) == ("m", None, (), (), ())


def test_model_settings_warnings_in_order():
    c = cfg(
        model="tiny-llama",
        trust_remote_code=True,
        revision=None,
        decode_weights_seed=7,
        extra_args=("--mamba-cache-mode", "align"),
    )
    m = model_settings(c, model="/gen", decode_model="/other", allow_unpinned=True)
    # a generated tiny model's remote code is ours: no "UNPINNED" warning
    assert m.model == "/gen" and m.decode_model == "/other" and m.remote_args == ("--trust-remote-code",)
    assert [w.split(" ", 1)[0] for w in m.warnings] == ["--mamba-cache-mode", "decode"]
    assert "decode instances load /other, not /gen" in m.warnings[1]
    hub = model_settings(
        cfg(trust_remote_code=True, extra_args=("--mamba-cache-mode", "align")),
        model=None,
        decode_model=None,
        allow_unpinned=True,
    )
    assert [w.split(" ", 1)[0] for w in hub.warnings] == ["UNPINNED", "--mamba-cache-mode"]


def test_model_settings_checks_remote_code_before_the_models_path():
    with pytest.raises(PlanError) as e:
        model_settings(
            cfg(model="tiny-llama", trust_remote_code=True, revision=None),
            model=None,
            decode_model=None,
            allow_unpinned=False,
        )
    assert e.value.field == "model"  # a generated model's code is ours: only its path is missing
    with pytest.raises(PlanError) as e:
        model_settings(cfg(trust_remote_code=True), model=None, decode_model=None, allow_unpinned=False)
    assert e.value.field == "revision"


def test_model_settings_note_the_hybrid_block_size():
    c = cfg(connector="nixl", hybrid=True, block_size=256)
    m = model_settings(c, model=None, decode_model=None, allow_unpinned=False)
    assert len(m.notes) == 1 and "--block-size 256 on both sides" in m.notes[0]
    with pytest.raises(PlanError) as e:
        model_settings(
            cfg(connector="nixl", hybrid=True), model=None, decode_model=None, allow_unpinned=False
        )
    assert e.value.field == "block_size"


@pytest.mark.parametrize(
    "kw,platform,dtype,block,warned",
    [
        ({}, "cuda", None, None, False),
        ({"dtype": "bfloat16", "block_size": 16}, "cuda", "bfloat16", 16, False),
        ({}, "cpu", "float32", 128, True),  # mooncake over rdma by default: tcp on cpu
        ({"dtype": "auto", "block_size": 64, "mooncake_protocol": "tcp"}, "cpu", "float32", 64, False),
        ({"connector": "nixl"}, "cpu", "float32", 128, False),
    ],
)
def test_lane_table(kw, platform, dtype, block, warned):
    lane = lane_settings(cfg(**kw), platform, {})
    assert (lane.dtype, lane.block_size) == (dtype, block)
    assert len(lane.warnings) == (1 if warned else 0)
    assert all("replaced by 'tcp' on the CPU lane" in w for w in lane.warnings)


def test_lane_passes_gpu_env_on_cuda_only():
    host = {"NCCL_NVLS_ENABLE": "0"}
    cuda = lane_settings(cfg(), "cuda", host)
    assert cuda.gpu_env == (("NCCL_NVLS_ENABLE", "0"),) and len(cuda.notes) == 1
    cpu = lane_settings(cfg(), "cpu", host)
    assert cpu.gpu_env == () and cpu.notes == ()


@pytest.mark.parametrize("kw,field", [({"dtype": "float16"}, "dtype"), ({"block_size": 48}, "block_size")])
def test_lane_refuses_the_cpu_traps(kw, field):
    with pytest.raises(PlanError) as e:
        lane_settings(cfg(**kw), "cpu", {})
    assert e.value.field == field
    lane_settings(cfg(**kw), "cuda", {})  # the GPU lane takes them as they are
