"""The facts an interpreter reports about itself: where vLLM comes from, editable or not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from pd_sessions.env.envfacts import describe_module, summary_lines


def _fake_dist(site: Path, module: str, dist: str, version: str, editable_src: Path | None) -> None:
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text("")
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(module + "\n")
    if editable_src:
        (info / "direct_url.json").write_text(
            json.dumps({"url": f"file://{editable_src}", "dir_info": {"editable": True}})
        )


@pytest.mark.procs
def test_an_editable_vllm_is_named_with_its_checkout(tmp_path):
    site = tmp_path / "site"
    _fake_dist(site, "vllm", "vllm", "0.99.0.dev1", editable_src=tmp_path / "src" / "vllm")
    out = tmp_path / "facts.json"
    subprocess.run(
        [sys.executable, "-m", "pd_sessions.env.envfacts", "--out", str(out)],
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": f"{site}:{ROOT}", "PATH": "/usr/bin:/bin"},
    )
    doc = json.loads(out.read_text())
    vllm = doc["modules"]["vllm"]
    assert vllm == {
        "location": str(site / "vllm"),
        "dist": "vllm",
        "version": "0.99.0.dev1",
        "editable": str(tmp_path / "src" / "vllm"),
    }
    assert doc["installed"]["vllm"] == "0.99.0.dev1" and doc["python"]["executable"] == sys.executable
    line = describe_module("vllm", vllm)
    assert line == (
        f"vllm 0.99.0.dev1 (vllm, editable checkout {tmp_path / 'src' / 'vllm'}) from {site / 'vllm'}"
    )


def test_summary_names_missing_vllm_and_router_and_torch_build():
    doc = {
        "python": {"executable": "/py", "version": "3.12.3"},
        "torch": {
            "version": "2.11.0+cu130",
            "cuda": "13.0",
            "hip": None,
            "location": "/t",
            "build_known": True,
        },
        "modules": {"nixl": None, "vllm_router": None, "vllm": None, "mooncake": None},
    }
    assert summary_lines(doc) == [
        "environment: Python 3.12.3 at /py",
        "  torch 2.11.0+cu130, CUDA 13.0 from /t",
        "  vllm: not installed",
        "  vllm_router: not installed",
    ]
