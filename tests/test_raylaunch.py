"""The Ray launcher's pure parts (runtime/raylaunch.py), the link proof (checks/kv_link.py), and the
single-host path without Ray: Ray is an optional extra, and nothing a one-host run does needs it.
(The launcher on real Ray nodes: tests/test_e2e_hosts.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT

from pd_sessions.checks import kv_link
from pd_sessions.core import connectors
from pd_sessions.core.connectors.base import LogEvidence
from pd_sessions.runtime import raylaunch

# An interpreter in which `import ray` fails, as where the extra is not installed.
NO_RAY = (
    "import sys; sys.modules['ray'] = None; from pd_sessions.cli import main; sys.exit(main(sys.argv[1:]))"
)


def no_ray(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", NO_RAY, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.procs
def test_a_single_host_dry_run_needs_no_ray():
    p = no_ray("sweep", "mooncake_sweep", "--only", "1x1", "--platform", "cpu", "--dry-run")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "plan 1x1: 1xP(TP1) + 1xD(TP1), connector mooncake" in p.stdout
    assert "dry run: 1 plans, nothing was launched" in p.stdout + p.stderr


@pytest.mark.procs
def test_ray_without_the_extra_is_a_usage_error_naming_the_install():
    p = no_ray("sweep", "mooncake_sweep", "--only", "1x1", "--platform", "cpu", "--dry-run", "--ray", "auto")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--ray needs Ray" in p.stderr and "pip install 'pd-sessions[ray]'" in p.stderr


def test_a_spawned_process_gets_the_nodes_environment_without_rays_and_the_spec_wins():
    node = {"PATH": "/bin", "RAY_ADDRESS": "h:1", "RAY_JOB_ID": "1", "CUDA_VISIBLE_DEVICES": ""}
    env = raylaunch.node_env(
        {**node, "PYTHONPATH": "/x"},
        {"CUDA_VISIBLE_DEVICES": "3", "VLLM_HOST_IP": "198.18.0.2"},
        "/shipped",
    )  # fmt: skip
    assert env == {
        "PATH": "/bin",
        "PYTHONPATH": "/shipped:/x",
        "CUDA_VISIBLE_DEVICES": "3",
        "VLLM_HOST_IP": "198.18.0.2",
    }


def test_the_driver_joins_the_node_on_its_own_address_only_when_the_head_is_local():
    assert raylaunch.driver_address("127.0.0.1:6379") == {"_node_ip_address": "127.0.0.1"}
    assert raylaunch.driver_address("198.51.100.7:6379") == {}  # not this host's
    assert raylaunch.driver_address("auto") == {}


def test_nodes_are_named_by_their_pd_host_label_else_their_address():
    nodes = [
        {"NodeManagerAddress": "198.18.0.254", "Labels": {"ray.io/node-id": "a"}},
        {"NodeManagerAddress": "198.18.0.1", "Labels": {"pd-host": "host1"}},
        {"NodeManagerAddress": "10.0.0.5", "Labels": {}},
        {"NodeManagerAddress": "10.0.0.5"},
    ]
    assert raylaunch._names(nodes) == ["198.18.0.254", "host1", "10.0.0.5", "10.0.0.5#2"]
    assert raylaunch._labels(nodes[0]) == () and raylaunch._labels(nodes[1]) == (("pd-host", "host1"),)


# --- the link proof ------------------------------------------------------------------------------

BEFORE = {"host1": (1000, 2000), "host2": (5000, 700)}


def link(after, kv=262144.0, prefill=("host1",), decode=("host2",)):
    return kv_link.evaluate(
        BEFORE, after, prefill_hosts=prefill, decode_hosts=decode, kv_bytes=kv, source="NIXL reported"
    )


def test_the_link_proof_passes_when_both_ends_moved_at_least_the_kv_bytes_and_records_both():
    reason, d = link({"host1": (1500, 2000 + 270000), "host2": (5000 + 270113, 900)})
    assert reason is None
    assert (d["decode_hosts_rx"], d["prefill_hosts_tx"], d["kv_bytes"]) == (270113, 270000, 262144.0)
    assert "the KV crossed the link: decode hosts received 270113 bytes" in kv_link.said(d)


@pytest.mark.parametrize(
    "after,kw,needle",
    [
        ({"host1": (1000, 300000), "host2": (5000 + 3400, 700)}, {}, "decode hosts (host2) received 3400"),
        ({"host1": (1000, 2100), "host2": (400000, 700)}, {}, "prefill hosts (host1) sent 100 bytes"),
        ({"host1": (1, 1), "host2": (1, 1)}, {"kv": 0.0}, "reported no KV bytes"),
        ({"host1": (1, 1)}, {}, "no interface counters for host2"),
        (
            {"host1": (9e9, 9e9), "host2": (9e9, 9e9)},
            {"prefill": ("host1",), "decode": ("host1",)},
            "host1 serves prefill and decode: its KV never crosses a link",
        ),
    ],
)
def test_the_link_proof_fails_naming_what_did_not_cross(after, kw, needle):
    reason, _ = link(after, **kw)
    assert reason is not None and needle in reason


def test_mooncake_bytes_add_each_lines_transfers_times_their_average_never_over():
    log = (
        "INFO ... KV Transfer metrics: Num successful transfers=2, Avg xfer time (ms)=3.5, "
        "P90 xfer time (ms)=4.0, Avg MB per transfer=0.25, Throughput (MB/s)=71.4, "
        "Avg number of descriptors=2.0, Num failed transfers=0, Num failed recvs=0, Num KV expired reqs=0\n"
        "noise\n"
        "INFO ... KV Transfer metrics: Num successful transfers=1, Avg MB per transfer=0.125\n"
        "INFO ... KV Transfer metrics: Num successful transfers=0, Avg MB per transfer=0\n"
    )
    ev = connectors.MOONCAKE.evidence
    assert isinstance(ev, LogEvidence) and ev.mean_mib
    got = kv_link.logged_bytes(log, ev.success, ev.mean_mib)
    exact = (2 * 0.25 + 0.125) * 2**20
    assert exact - 3 * 0.0005 * 2**20 - 1 <= got < exact


@pytest.mark.procs
def test_ray_and_simulate_hosts_together_is_a_usage_error():
    p = no_ray("sweep", "mooncake_sweep", "--dry-run", "--ray", "auto", "--simulate-hosts", "2")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--ray and --simulate-hosts: give one" in p.stderr
