"""runtime/machine.py's one nvidia-smi query, through a fake ``nvidia-smi`` on PATH: detect() and
gpu_names() read it; a failing or missing nvidia-smi means no GPU and generic names."""

from __future__ import annotations

import os
import textwrap

import pytest

from pd_sessions.runtime import machine

FAKE = textwrap.dedent("""\
    #!/bin/sh
    case "$1" in
      --query-gpu=index) printf '0\\n1\\n' ;;
      --query-gpu=index,uuid,name) printf '0, GPU-aaa, NVIDIA H200\\n1, GPU-bbb, NVIDIA H100\\n' ;;
      *) exit 3 ;;
    esac
    exit ${FAKE_SMI_RC:-0}
""")


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return smi


@pytest.mark.procs
def test_detect_and_names_read_one_query(fake_smi, monkeypatch):
    assert machine.query_gpus("index") == ["0", "1"]
    inv = machine.detect({})
    assert inv.gpus == ("0", "1") and inv.gpu_source == "nvidia-smi"
    assert machine.detect({"CUDA_VISIBLE_DEVICES": "1"}).gpus == ("1",)
    assert machine.gpu_names(["1", "GPU-aaa", "7"]) == ["NVIDIA H100", "NVIDIA H200", "GPU 7"]


@pytest.mark.procs
def test_a_failing_nvidia_smi_is_no_gpu_and_generic_names(fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_RC", "9")
    assert machine.query_gpus("index") == []
    assert machine.detect({}).gpus == () and machine.detect({}).gpu_source == "none"
    assert machine.gpu_names(["0"]) == ["GPU 0"]


def test_no_nvidia_smi_is_no_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert machine.query_gpus("index") == [] and machine.detect({}).gpus == ()
