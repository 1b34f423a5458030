"""python -m pd_sessions.vllm_side.link_probe: the KV transport alone between two processes (real Mooncake
transfer engine over TCP, real NIXL agents writing as NixlPushConnector does; NIXL's READ runs in the
e2e perf check of the NIXL sweep)."""

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
    assert doc["transport"] == "Mooncake transfer engine (tcp), cpu to cpu, WRITE" and doc["op"] == "WRITE"
    assert doc["bytes"] == 1048576 and doc["descriptors"] == 4
    assert len(doc["seconds"]) == 5 and all(0 < s < 10 for s in doc["seconds"])
    assert "GB/s" in p.stdout
    # what was used, and the physical limit of the same bytes between two processes here
    assert doc["transports"] == ["tcp"] and "initialize accepted" in doc["transports_source"]
    assert doc["limit"]["name"] == "shared-memory copy between two processes"
    assert len(doc["limit"]["seconds"]) == 5 and all(s > 0 for s in doc["limit"]["seconds"])
    assert doc["nic"]["interface"] == "lo" and doc["nic"]["note"].startswith("loopback: ")
    assert "shared-memory copy between two processes: " in p.stdout


def test_nixl_writes_into_the_peers_buffer_and_reads_ucxs_write_tables(tmp_path):
    """--op WRITE (NixlPushConnector's operation): this process writes into the peer's registered
    buffer; UCX's own report of it is its 'remote memory write' tables (cma on this host, 2026-12-05)."""
    needs("nixl._api")
    p, doc = probe(
        tmp_path, "--transport", "nixl", "--op", "WRITE", "--bytes", "1048576", "--descriptors", "16",
        "--repeats", "3",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert doc["op"] == "WRITE" and doc["transport"] == "NIXL agents (UCX), DRAM to DRAM, WRITE"
    assert len(doc["seconds"]) == 3 and all(s > 0 for s in doc["seconds"])
    assert doc["transports_source"].startswith(
        "UCX_PROTO_INFO=y: the 'remote memory write' tables of probe.json"
    )
    assert doc["transports"] and all("/" in lane for lane in doc["transports"]), doc  # transport/device
    assert doc["limit"]["name"] == "shared-memory copy between two processes"
    assert "NIXL agents (UCX), DRAM to DRAM, WRITE: 1048576 bytes in 16 pieces" in p.stdout


def test_the_cpu_limit_copies_what_another_process_wrote_and_leaves_no_segment():
    before = {p.name for p in Path("/dev/shm").glob("psm_*")}
    seconds = link_probe.cpu_copy_limit(1 << 20, 3)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert {p.name for p in Path("/dev/shm").glob("psm_*")} <= before


def test_impossible_sizes_are_refused_before_anything_starts(tmp_path):
    p, doc = probe(tmp_path, "--transport", "nixl", "--bytes", "4", "--descriptors", "8")
    assert p.returncode == 2 and "1 <= --descriptors <= --bytes" in p.stderr and doc == {}
