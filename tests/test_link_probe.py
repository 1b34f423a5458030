"""python -m pd_sessions.vllm_side.link_probe: the KV transport alone between two processes (real Mooncake
transfer engine over TCP here; the NIXL side runs in the e2e perf check of the NIXL sweep)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.needs import needs

pytestmark = pytest.mark.procs


def probe(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "probe.json"
    p = subprocess.run(
        [sys.executable, "-m", "pd_sessions.vllm_side.link_probe", *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p, (json.loads(out.read_text()) if out.exists() else {})


def test_mooncake_moves_the_bytes_between_two_processes_and_times_each_transfer(tmp_path):
    needs("mooncake.engine")
    p, doc = probe(
        tmp_path, "--transport", "mooncake", "--bytes", "1048576", "--descriptors", "4", "--repeats", "5"
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert doc["transport"] == "Mooncake transfer engine (tcp), cpu to cpu"
    assert doc["bytes"] == 1048576 and doc["descriptors"] == 4
    assert len(doc["seconds"]) == 5 and all(0 < s < 10 for s in doc["seconds"])
    assert "GB/s" in p.stdout


def test_impossible_sizes_are_refused_before_anything_starts(tmp_path):
    p, doc = probe(tmp_path, "--transport", "nixl", "--bytes", "4", "--descriptors", "8")
    assert p.returncode == 2 and "1 <= --descriptors <= --bytes" in p.stderr and doc == {}
