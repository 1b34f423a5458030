"""The link probe's transport and physical limit, and the perf check's finding (issue 42, part 2):
UCX's own report of the lanes it chose (its UCX_PROTO_INFO tables, recorded from this host's probe),
the advice, the finding when the transport alone is under 10 % of the limit, and how the perf
check reports it: in the message, the figures and result.json's details, never as a verdict."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import FIXTURES
from helpers.builders import arg

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
# The same probe with `--op WRITE` (as NixlPushConnector moves the KV), same host and UCX, 2026-12-05.
CPU_WRITE_LOG = (PERF / "ucx-proto-info-cpu-nixl-probe-write.log").read_text()
CPU_WRITE_DOC = json.loads((PERF / "link-probe-cpu-nixl-write.json").read_text())


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
# a WRITE's title names its memories the other way round (UCX's proto_debug.c, ucp_proto_select_param_str
# and ucp_proto_select_info_str: "into X from Y" for get, "from X to Y" for put), as the H200 log's
# host writes show: "remote memory write by ucp_put* from host memory to cuda/dev[1]"
CUDA_WRITE = "remote memory write by ucp_put*(multi) from cuda/GPU0 to cuda/dev[1]"


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


def test_the_recorded_cpu_write_probe_wrote_over_cma_and_its_read_tables_are_not_its_lanes():
    assert ucx.lanes(CPU_WRITE_LOG, "write", "cpu") == ("cma/memory",)
    assert ucx.lanes(CPU_WRITE_LOG, "read", "cpu") == ()  # it did not read: no read table
    assert CPU_WRITE_DOC["op"] == "WRITE" and CPU_WRITE_DOC["transports"] == ["cma/memory"]
    assert CPU_WRITE_DOC["transport"] == "NIXL agents (UCX), DRAM to DRAM, WRITE"
    assert CPU_WRITE_DOC["transports_source"].startswith("UCX_PROTO_INFO=y: the 'remote memory write' tables")


def test_a_vram_write_table_names_its_lanes_and_a_host_write_into_vram_is_not_one():
    log = (
        table("pd-probe-1 self cfg#0", CUDA_WRITE, "cuda_copy/cuda")
        + table("pd-probe-1 intra-node cfg#1", CUDA_READ, "tcp/lo")
        + table("pd-probe-1 intra-node cfg#1", CUDA_WRITE, "cuda_ipc/cuda")
    )
    assert ucx.lanes(log, "write", "cuda") == ("cuda_ipc/cuda",)
    assert ucx.lanes(log, "read", "cuda") == ("tcp/lo",)
    # the H200 logs' writes are all from host memory (into host or cuda): none is a VRAM to VRAM write
    for name in (
        "ucx-proto-info-h200-nixl-probe-get-zcopy.log",
        "ucx-proto-info-h200-nixl-probe-defaults-read.log",
    ):
        assert ucx.lanes((PERF / name).read_text(), "write", "cuda") == ()


def test_the_write_advice_names_no_get_setting():
    write = ucx.advice(("tcp/lo",), "cuda", None, "write")
    assert write and write.startswith("it used tcp, not cuda_ipc;") and "writes (put)" in write
    assert "UCX_TLS=cuda_ipc,cuda_copy,tcp" in write and "set UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in write
    assert "(UCX_TLS=tcp here)" in (ucx.advice(("tcp/lo",), "cuda", "tcp", "write") or "")
    assert ucx.advice(("cuda_ipc/cuda",), "cuda", None, "write") is None
    # shared memory on the CPU lane serves both directions: the same advice
    assert ucx.advice(("tcp/lo",), "cpu", None, "write") == ucx.advice(("tcp/lo",), "cpu")


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
    assert link.op == "" and pf.link_probe_from(CPU_WRITE_DOC).op == "WRITE"
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
    # a WRITE reads the write tables of the same log (this process's: the peer's is left out)
    write = link_probe.Args("nixl", "cpu", 2**20, 64, 10, op="WRITE")
    (tmp_path / f"probe.json.ucx.{os.getpid()}.log").write_text(CPU_WRITE_LOG)
    used, source, advice = link_probe.transports_used(write, prefix)
    assert used == ("cma/memory",) and advice is None and "the 'remote memory write' tables" in source
    (tmp_path / f"probe.json.ucx.{os.getpid()}.log").write_text(
        table("p intra-node cfg#1", CUDA_READ, "tcp/lo")
    )
    used, source, advice = link_probe.transports_used(write, prefix)
    assert used == () and source.startswith("unknown: no 'remote memory write' table in UCX's log")
    mooncake = link_probe.Args("mooncake", "cuda", 2**20, 4, 10, protocol="tcp", op="WRITE")
    used, source, advice = link_probe.transports_used(mooncake, None)
    assert used == ("tcp",) and "initialize accepted" in source and advice and "stages GPU memory" in advice


def test_the_op_defaults_to_each_transports_own_and_mooncake_cannot_read(tmp_path):
    out = ["--bytes", "8", "--out", str(tmp_path / "o.json")]
    assert link_probe.parse(["--transport", "nixl", *out])[0].op == "READ"  # as before --op
    assert link_probe.parse(["--transport", "nixl", "--op", "WRITE", *out])[0].op == "WRITE"
    assert link_probe.parse(["--transport", "mooncake", *out])[0].op == "WRITE"
    with pytest.raises(SystemExit):
        link_probe.parse(["--transport", "mooncake", "--op", "READ", *out])
    with pytest.raises(SystemExit):
        link_probe.parse(["--transport", "nixl", "--op", "PUT", *out])
    assert link_probe.transport_name(link_probe.Args("nixl", "cuda", 8, 1, 1, op="WRITE")) == (
        "NIXL agents (UCX), VRAM to VRAM, WRITE"
    )


# ---------------------------------------------------------------- the perf check's probe command


def probe_argv(connector: str, platform: str = "cuda") -> tuple[list[str], dict[str, str], object]:
    from helpers.builders import cfg, plan

    from pd_sessions.checks import perf

    p = plan(cfg(connector=connector), platform=platform)
    argv, env = perf.probe_command(p, 2**20, 64, Path("/r/link-probe.json"), {"BASE": "1"})
    return argv, env, p


def test_a_pull_probe_reads_on_decode0s_gpu_from_prefill0s():
    argv, env, p = probe_argv("nixl")
    assert (arg(argv, "--transport"), arg(argv, "--op")) == ("nixl", "READ")
    assert (p.prefill[0].gpus, p.decode[0].gpus) == (("0",), ("1",))
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and arg(argv, "--device") == "cuda"
    assert (arg(argv, "--gpu"), arg(argv, "--peer-gpu")) == ("1", "0")  # the decode reads
    assert env["VLLM_PORT"] == p.decode[0].env_dict()["VLLM_PORT"] and env["BASE"] == "1"


def test_a_push_probe_writes_from_prefill0s_gpu_into_decode0s():
    argv, env, p = probe_argv("nixl_push")
    assert (arg(argv, "--transport"), arg(argv, "--op")) == ("nixl", "WRITE")
    assert (arg(argv, "--gpu"), arg(argv, "--peer-gpu")) == ("0", "1")  # the prefill writes
    assert env["VLLM_PORT"] == p.prefill[0].env_dict()["VLLM_PORT"]
    mooncake, _, _ = probe_argv("mooncake")
    assert (arg(mooncake, "--op"), arg(mooncake, "--gpu"), arg(mooncake, "--peer-gpu")) == ("WRITE", "0", "1")


def test_on_the_cpu_lane_only_the_op_changes():
    pull, _, _ = probe_argv("nixl", "cpu")
    push, _, _ = probe_argv("nixl_push", "cpu")
    assert "--device" not in push and "--gpu" not in push and arg(push, "--op") == "WRITE"
    # the same command but the op (and the instances' own kv-transfer-config, which names the class)
    config = "--kv-transfer-config"
    assert [a for a in push if a not in ("WRITE", arg(push, config))] == [
        a for a in pull if a not in ("READ", arg(pull, config))
    ]
    assert link_probe.parse(push[3:])[0].op == "WRITE"  # what the probe makes of it
