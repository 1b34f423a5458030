"""python -m pd_sessions.vllm_side.link_probe: the KV transport alone between two processes (real Mooncake
transfer engine over TCP here; the NIXL side runs in the e2e perf check of the NIXL sweep)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.needs import needs

from pd_sessions.vllm_side import link_probe

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
    # what was used, and the physical limit of the same bytes between two processes here
    assert doc["transports"] == ["tcp"] and "initialize accepted" in doc["transports_source"]
    assert doc["limit"]["name"] == "shared-memory copy between two processes"
    assert len(doc["limit"]["seconds"]) == 5 and all(s > 0 for s in doc["limit"]["seconds"])
    assert doc["nic"]["interface"] == "lo" and doc["nic"]["note"].startswith("loopback: ")
    assert "shared-memory copy between two processes: " in p.stdout


def test_the_cpu_limit_copies_what_another_process_wrote_and_leaves_no_segment():
    before = {p.name for p in Path("/dev/shm").glob("psm_*")}
    seconds = link_probe.cpu_copy_limit(1 << 20, 3)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert {p.name for p in Path("/dev/shm").glob("psm_*")} <= before


def test_impossible_sizes_are_refused_before_anything_starts(tmp_path):
    p, doc = probe(tmp_path, "--transport", "nixl", "--bytes", "4", "--descriptors", "8")
    assert p.returncode == 2 and "1 <= --descriptors <= --bytes" in p.stderr and doc == {}
