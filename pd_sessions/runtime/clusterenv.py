"""What a user command (and ``serve``, and the pytest fixture) is told about a running cluster:
the environment upstream's P/D test files read, and a JSON description of the cluster.

    PREFILL_HOST, PREFILL_PORT     the first prefill instance
    DECODE_HOST, DECODE_PORT       the first decode instance
    PROXY_HOST, PROXY_PORT         the router (upstream's "proxy")
    PREFILL_PORTS, DECODE_PORTS    every instance, comma-separated (also *_HOSTS)
    TEST_MODEL                     the served model name (what requests send as "model")
    BLOCK_SIZE                     the KV block size, when the plan sets one
    PD_SESSIONS_CLUSTER            a JSON file: URLs, roles, devices, connector, kv configs
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pd_sessions.core.plan import ClusterPlan, ProcessSpec

CLUSTER_FILE = "cluster.json"


ENV_NAMES = (
    "PREFILL_HOST",
    "PREFILL_PORT",
    "DECODE_HOST",
    "DECODE_PORT",
    "PROXY_HOST",
    "PROXY_PORT",
    "PREFILL_HOSTS",
    "PREFILL_PORTS",
    "DECODE_HOSTS",
    "DECODE_PORTS",
    "TEST_MODEL",
    "BLOCK_SIZE",
    "PD_SESSIONS_CLUSTER",
)


def _flag(argv: Sequence[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def kv_config(spec: ProcessSpec) -> dict[str, Any] | None:
    """The instance's --kv-transfer-config, parsed (None when it starts without one)."""
    raw = _flag(spec.argv, "--kv-transfer-config")
    return json.loads(raw) if raw is not None else None


def block_size(plan: ClusterPlan) -> int | None:
    """--block-size the instances get (None: vLLM chooses, e.g. on GPUs without a config value)."""
    raw = _flag(plan.prefill[0].argv, "--block-size")
    return int(raw) if raw is not None else None


def describe(plan: ClusterPlan, run_dir: Path | None = None) -> dict[str, Any]:
    """The cluster as JSON-ready data: written to PD_SESSIONS_CLUSTER."""

    def proc(s: ProcessSpec) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": s.name,
            "role": s.role,
            "url": s.url,
            "host": s.host,
            "port": s.port,
            "gpus": list(s.gpus),
            "cpu_bind": s.cpu_bind,
            "log": s.log_name,
        }
        if s.role != "router":
            d["kv_transfer_config"] = kv_config(s)
            d["bootstrap_port"] = s.bootstrap_port
            d["metrics_url"] = f"{s.url}/metrics"
        return d

    c = plan.config
    return {
        "config": c.name,
        "shape": c.shape,
        "platform": plan.platform,
        "connector": c.connector,
        "model": plan.model,
        "served_model_name": plan.served_model_name,
        "block_size": block_size(plan),
        "router": proc(plan.router),
        "prefill": [proc(s) for s in plan.prefill],
        "decode": [proc(s) for s in plan.decode],
        "run_dir": str(run_dir) if run_dir else None,
    }


def cluster_env(plan: ClusterPlan, cluster_file: Path | None = None) -> dict[str, str]:
    """The variables every user command gets (see the module docstring).

    name               value
    PREFILL_HOST/PORT  prefill-0's host and HTTP port
    DECODE_HOST/PORT   decode-0's
    PROXY_HOST/PORT    the router's
    *_PORTS, *_HOSTS   all instances of the role, comma-separated, in plan order
    TEST_MODEL         plan.served_model_name
    BLOCK_SIZE         only when the plan passes --block-size (else vLLM picks it)
    PD_SESSIONS_CLUSTER  only when a cluster file is given
    """
    p0, d0, r = plan.prefill[0], plan.decode[0], plan.router
    env = {
        "PREFILL_HOST": p0.host,
        "PREFILL_PORT": str(p0.port),
        "DECODE_HOST": d0.host,
        "DECODE_PORT": str(d0.port),
        "PROXY_HOST": r.host,
        "PROXY_PORT": str(r.port),
        "PREFILL_HOSTS": ",".join(s.host for s in plan.prefill),
        "PREFILL_PORTS": ",".join(str(s.port) for s in plan.prefill),
        "DECODE_HOSTS": ",".join(s.host for s in plan.decode),
        "DECODE_PORTS": ",".join(str(s.port) for s in plan.decode),
        "TEST_MODEL": plan.served_model_name,
    }
    bs = block_size(plan)
    if bs is not None:
        env["BLOCK_SIZE"] = str(bs)
    if cluster_file is not None:
        env["PD_SESSIONS_CLUSTER"] = str(cluster_file)
    return env


def write_cluster_file(plan: ClusterPlan, run_dir: Path) -> Path:
    path = run_dir / CLUSTER_FILE
    path.write_text(json.dumps(describe(plan, run_dir), indent=2) + "\n")
    return path


def export_lines(env: Mapping[str, str]) -> list[str]:
    """``export NAME=value`` lines a POSIX shell can paste or source."""
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
