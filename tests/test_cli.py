"""The CLI as a user runs it (subprocess); nothing here starts vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT
from pd_sessions.hosts import detect


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "pd_sessions", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_dry_run_prints_every_plan_and_launches_nothing():
    r = cli("sweep", "mooncake_sweep", "--dry-run")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    names = ("1x1", "2x2", "1x2", "2x1", "2p1d", "1p2d")
    assert all(f"plan {n}:" in out for n in names)
    # 2 instances in each of the four TP configs, 3 in each xPyD config; one router each
    assert out.count("vllm.entrypoints.openai.api_server") == 4 * 2 + 2 * 3
    assert out.count("vllm_router.launch_router") == len(names)
    assert "nothing was launched" in out and "--kv-connector mooncake" in out


def test_dry_run_only():
    r = cli("sweep", "mooncake_sweep", "--dry-run", "--only", "1x1")
    assert r.returncode == 0 and "plan 1x1" in r.stdout and "plan 2x2" not in r.stdout


@pytest.mark.parametrize("args,needle", [
    (("sweep", "mooncake_sweep", "--bogus"), "unrecognized arguments: --bogus"),
    (("sweep", "mooncake_sweep", "--only", "3x3"), "--only: no config named '3x3'"),
    (("sweep", "mooncake_swep"), 'did you mean "mooncake_sweep"'),
    (("sweep", "mooncake_sweep", "--platform", "tpu"), "invalid choice: 'tpu'"),
])
def test_bad_arguments_exit_2_naming_the_field(args, needle):
    r = cli(*args)
    assert r.returncode == 2
    assert needle in r.stderr


@pytest.mark.skipif(bool(detect().gpus), reason="this host has GPUs")
def test_cuda_without_gpus_is_refused():
    r = cli("sweep", "mooncake_sweep", "--platform", "cuda", "--dry-run")
    assert r.returncode == 2 and "no GPU is visible" in r.stderr


def test_bad_config_file_exit_2(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('name="bad"\n[defaults]\nmodel="m"\n[[config]]\nname="x"\nprefill_tp=0\n')
    r = cli("sweep", str(p), "--dry-run")
    assert r.returncode == 2 and "prefill_tp: got 0" in r.stderr and str(p) in r.stderr


def test_kimi_dry_run_prints_the_nightly_plan_anywhere():
    r = cli("sweep", "kimi_linear_nightly", "--dry-run", "--allow-unpinned-remote-code")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "prefill-0: http://127.0.0.1:" in out and "(GPUs 0,1," in out
    assert "decode-0: http://127.0.0.1:" in out and "(GPUs 2,3," in out
    assert "1xD(TP1,DP2+EP)" in out and "--enable-expert-parallel" in out and "--data-parallel-size 2" in out
    assert "revision UNPINNED" in out and "VLLM_SSM_CONV_STATE_LAYOUT=DS" in out
    assert "--mamba-cache-mode align" in out and "--max-model-len 32768" in out and "--trust-remote-code" in out
    assert "--gpu-memory-utilization 0.9" in out and "--kv-connector nixl" in out
    assert "ports: all" in out and "distinct" in out


def test_kimi_unpinned_needs_the_explicit_flag():
    r = cli("sweep", "kimi_linear_nightly", "--dry-run")
    assert r.returncode == 2 and "--allow-unpinned-remote-code" in r.stderr


@pytest.mark.skipif(len(detect().gpus) >= 4, reason="this host has 4 GPUs")
def test_kimi_without_4_gpus_exits_before_starting():
    r = cli("sweep", "kimi_linear_nightly", "--allow-unpinned-remote-code")
    assert r.returncode == 2
    assert "kimi_linear_nightly needs 4 GPUs" in r.stderr and "nothing was started" in r.stderr
