"""The link probe's transport and physical limit, and the perf check's finding (issue 42, part 2):
UCX's own report of the lanes it chose (its UCX_PROTO_INFO tables, recorded from this host's probe),
the advice, the finding when the transport alone is under 10 % of the limit, and how the perf
check reports it: in the message, the figures and result.json's details, never as a verdict."""

from __future__ import annotations

import json
import os

import pytest
from helpers import FIXTURES

from pd_sessions.checks import perf_figures as pf
from pd_sessions.core import ucx
from pd_sessions.core.errors import PerfError
from pd_sessions.vllm_side import link_probe

PERF = FIXTURES / "perf"
# Recorded 2026-12-05 on the 2-core CPU host: `python -m pd_sessions.vllm_side.link_probe --transport
# nixl --bytes 1048576 --descriptors 64 --repeats 10` (UCX 1.23.0 of nixl-cu12 1.5.1, UCX's
# defaults), its output and the initiator's UCX log (UCX_PROTO_INFO=y, written by the probe).
CPU_LOG = (PERF / "ucx-proto-info-cpu-nixl-probe.log").read_text()
CPU_DOC = json.loads((PERF / "link-probe-cpu-nixl.json").read_text())


def table(owner: str, title: str, config: str) -> str:
    """A UCX_PROTO_INFO table as UCX 1.23 prints it (the layout of the recorded CPU log)."""
    prefix = "[1796471023.537901] [gpu:4242 :0]   "
    rows = [
        "+--------+-------------+-------------------------------------------+",
        f"| {owner} |",
        f"| {title} |",
        "+--------+-------------+-------------------------------------------+",
        "| Range  | Description |                  Config                   |",
        "+--------+-------------+-------------------------------------------+",
        f"| 0..inf | zero-copy   | {config} |",
        "+--------+-------------+-------------------------------------------+",
    ]
    return "\n".join(prefix + r for r in rows) + "\n"


CUDA_READ = "remote memory read by ucp_get*(multi) into cuda memory from cuda"


# ---------------------------------------------------------------- what UCX chose


def test_the_recorded_cpu_probe_read_over_cma():
    assert ucx.lanes(CPU_LOG, "read", "cpu") == ("cma/memory",)
    assert ucx.lanes(CPU_LOG, "read", "cuda") == ()  # no table for VRAM in a DRAM probe
    assert ucx.advice(("cma/memory",), "cpu") is None
    assert CPU_DOC["transports"] == ["cma/memory"]
    assert CPU_DOC["transports_source"].startswith("UCX_PROTO_INFO=y: the 'remote memory read' tables")


def test_self_endpoints_and_other_operations_are_left_out():
    log = (
        table("pd-probe-1 self cfg#0", CUDA_READ, "cuda_copy/cuda")
        + table("pd-probe-1 intra-node cfg#1", "active message by ucp_am_send* from host memory", "tcp/lo")
        + table("pd-probe-1 intra-node cfg#1", CUDA_READ, "50% on tcp/eth0 and 50% on tcp/lo")
    )
    assert ucx.lanes(log, "read", "cuda") == ("tcp/eth0", "tcp/lo")
    assert ucx.lanes(log, "write", "cuda") == ()
    assert ucx.lanes("no table here\n", "read", "cpu") == ()


def test_the_recorded_h200_tables_name_the_lanes_of_the_vram_read():
    """UCX 1.23 on an H200 (2026-12-05) titles the table "... into cuda/GPU0 from cuda/dev[1]", not
    "into cuda memory from cuda": the probe then said "no 'remote memory read' table" although
    its log had one. With UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y the read was cuda_ipc; with UCX's
    defaults it was emulated over tcp/lo (the diagnosis's log)."""
    got = (PERF / "ucx-proto-info-h200-nixl-probe-get-zcopy.log").read_text()
    assert ucx.lanes(got, "read", "cuda") == ("cuda_ipc/cuda",)
    assert ucx.lanes(got, "read", "cpu") == ()
    assert ucx.advice(ucx.lanes(got, "read", "cuda"), "cuda") is None
    defaults = (PERF / "ucx-proto-info-h200-nixl-probe-defaults-read.log").read_text()
    assert ucx.lanes(defaults, "read", "cuda") == ("tcp/lo",)
    assert ucx.advice(("tcp/lo",), "cuda", None).startswith("it used tcp, not cuda_ipc;")


def test_the_advice_names_what_was_used_and_the_setting_to_try():
    gpu = ucx.advice(("tcp/lo",), "cuda")
    assert gpu and gpu.startswith("it used tcp, not cuda_ipc;") and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in gpu
    assert ucx.advice(("cuda_ipc/cuda",), "cuda") is None
    cpu = ucx.advice(("tcp/lo",), "cpu")
    assert cpu and "not shared memory (cma, posix); set UCX_TLS=sm,tcp" in cpu
    # the planner's UCX_TLS=tcp across hosts is named as the reason, not "fixed"
    across = ucx.advice(("tcp/eth0",), "cpu", "tcp")
    assert across and "UCX_TLS=tcp leaves it out" in across and "set UCX_TLS" not in across


# ---------------------------------------------------------------- the finding


def probe(gb_s: float, limit_gb_s: float | None, lanes=(), advice=None, size=32 * 2**20) -> pf.LinkProbe:
    limit = (
        None
        if limit_gb_s is None
        else pf.LinkLimit("device-to-device copy on GPU 0", size, (size / limit_gb_s / 1e9,))
    )
    return pf.LinkProbe(
        "NIXL agents (UCX), VRAM to VRAM", size, 2048, (size / gb_s / 1e9,), lanes, "UCX", advice, limit
    )


def test_the_recorded_cpu_probe_is_a_finding_with_the_lane_it_used():
    # 0.97 GB/s (median of the 10) over cma against a 44.7 GB/s copy of the same MiB: under 10 %;
    # cma is the lane meant for it, so there is no setting to advise: the finding says what was used
    link = pf.link_probe_from(CPU_DOC)
    assert link.transports == ("cma/memory",) and link.advice is None and link.limit is not None
    assert link.limit.name == "shared-memory copy between two processes"
    assert link.gb_s == pytest.approx(0.969, rel=0.01) and link.limit.gb_s == pytest.approx(44.7, rel=0.01)
    finding = pf.link_finding(link)
    assert finding == (
        "NIXL agents (UCX), DRAM to DRAM moved 0.969 GB/s, 2.2 % of the shared-memory copy between two "
        "processes (44.7 GB/s, under 10 %): it used cma/memory"
    )


def test_a_gpu_transport_over_tcp_is_a_finding_naming_tcp_and_the_setting():
    # the H200 of 2026-12-01: NIXL's UCX moved 0.46 GB/s between two processes on one GPU, not over
    # CUDA IPC. The device copy was not measured then: 2,000 GB/s stands for "an H200's copy" here.
    lanes = ("tcp/lo",)
    link = probe(0.46, 2000.0, lanes, ucx.advice(lanes, "cuda"))
    finding = pf.link_finding(link)
    assert finding and finding.startswith(
        "NIXL agents (UCX), VRAM to VRAM moved 0.46 GB/s, 0.023 % of the device-to-device copy on GPU 0 "
        "(2e+03 GB/s, under 10 %): it used tcp, not cuda_ipc;"
    )
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in finding


def test_cuda_ipc_above_ten_percent_is_no_finding_and_the_bound_is_strict():
    lanes = ("cuda_ipc/cuda",)
    assert pf.link_finding(probe(300.0, 2000.0, lanes, ucx.advice(lanes, "cuda"))) is None  # 15 %
    assert pf.link_finding(probe(201.0, 2000.0, lanes)) is None  # just above 10 %
    assert pf.link_finding(probe(199.0, 2000.0, lanes)) is not None
    assert pf.link_finding(probe(0.46, None)) is None  # no limit measured: nothing to compare with
    unknown = pf.link_finding(probe(0.46, 2000.0))
    assert unknown and unknown.endswith("its lanes are unknown (UCX)")


def test_the_probes_document_round_trips_and_an_older_one_still_reads():
    old = {k: CPU_DOC[k] for k in ("transport", "bytes", "descriptors", "seconds")}
    link = pf.link_probe_from(old)
    assert link.transports == () and link.limit is None and link.transports_source == "not reported"
    with pytest.raises(PerfError, match="link probe output lacks 'seconds'"):
        pf.link_probe_from({**CPU_DOC, "limit": {"name": "x"}})


# ---------------------------------------------------------------- the probe's own parts (no process)


def test_the_line_rate_comes_from_sysfs_and_a_veth_is_unknown(tmp_path):
    (tmp_path / "eth0").mkdir()
    (tmp_path / "eth0" / "speed").write_text("25000\n")
    (tmp_path / "veth1").mkdir()
    (tmp_path / "veth1" / "speed").write_text("-1\n")
    assert link_probe.line_rate("eth0", tmp_path)["gb_s"] == 3.125
    veth = link_probe.line_rate("veth1", tmp_path)
    assert veth["gb_s"] is None and veth["note"].startswith("unknown: veth1 reports no line rate")
    assert link_probe.line_rate("gone", tmp_path)["gb_s"] is None
    assert link_probe.nic("127.0.0.1")["note"] == "loopback: the probe's path crosses no NIC"
    assert link_probe.nic("192.0.2.1")["note"] == "unknown: no interface here has 192.0.2.1"  # TEST-NET-1


def test_the_probe_reads_ucxs_tables_from_its_own_log_and_says_when_it_cannot(tmp_path):
    args = link_probe.Args("nixl", "cpu", 2**20, 64, 10)
    prefix = tmp_path / "probe.json.ucx"
    (tmp_path / f"probe.json.ucx.{os.getpid()}.log").write_text(CPU_LOG)
    (tmp_path / "probe.json.ucx.1.log").write_text(table("peer intra-node cfg#0", CUDA_READ, "tcp/lo"))
    used, source, advice = link_probe.transports_used(args, prefix)
    assert used == ("cma/memory",) and advice is None and f"probe.json.ucx.{os.getpid()}.log" in source
    assert link_probe.transports_used(args, None)[1].startswith("unknown: UCX_PROTO_INFO or UCX_LOG_FILE")
    mooncake = link_probe.Args("mooncake", "cuda", 2**20, 4, 10, protocol="tcp")
    used, source, advice = link_probe.transports_used(mooncake, None)
    assert used == ("tcp",) and "initialize accepted" in source and advice and "stages GPU memory" in advice
