"""``pd-sessions serve SWEEP --only CONFIG``: one cluster, held up for a person or a test suite.

Start the config as a sweep would (same plan, same readiness), say how to reach it
(URLs, the user-command environment as ``export`` lines, a curl example; also
written to ``<run_dir>/cluster.env`` and ``cluster.json``), then watch every process
until the caller is interrupted (Ctrl-C, SIGTERM: the CLI turns them into exceptions)
or one dies (ProcessExited, naming it). Teardown always runs.
"""

from __future__ import annotations

import json
import shlex
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan import ClusterPlan
from pd_sessions.run.ray_hosts import hosts_for, phase_one
from pd_sessions.run.sweep_options import SweepOptions, make_plan
from pd_sessions.runtime import clusterenv
from pd_sessions.runtime.cluster import Cluster, running_cluster
from pd_sessions.runtime.launcher import LOCAL
from pd_sessions.runtime.ports import PortAllocator
from pd_sessions.runtime.raylaunch import RemotePorts

ENV_FILE = "cluster.env"


@contextmanager
def one_cluster(
    config: ClusterConfig, inv: Inventory, opts: SweepOptions, *, progress: Callable[[str], None]
) -> Iterator[Cluster]:
    """Plan ``config`` (plan.txt in its run dir), start it, yield it ready; always tear down.
    With ``opts.ray``, across the hosts of that Ray cluster (run/ray_hosts.py)."""
    run_dir = opts.results_dir / config.name
    ports = PortAllocator(config.host)
    remote: dict[str, RemotePorts] = {}
    try:
        with hosts_for(opts, progress) as hosts:
            layout = None
            if hosts is not None:
                layout, remote = phase_one(hosts, config, opts, create_model=True)
            plan = make_plan(config, inv, ports, opts, create_model=True, layout=layout, host_ports=remote)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "plan.txt").write_text(plan.render() + "\n")
            with running_cluster(
                plan,
                run_dir,
                ports=ports,
                deadline_s=opts.deadline_s,
                pd_path_budget_s=opts.pd_path_budget_s,
                grace_s=opts.grace_s,
                progress=progress,
                launcher=hosts.launcher(run_dir, remote) if hosts else LOCAL,
            ) as cluster:
                yield cluster
    finally:
        ports.release()
        for p in remote.values():
            p.release()


def banner(plan: ClusterPlan, env: Mapping[str, str], run_dir: Path) -> list[str]:
    """What a person needs to use the cluster: URLs, exports, a request to try."""
    c = plan.config
    lines = [
        f"{c.name} is up: {c.shape}, connector {c.connector}, model {plan.served_model_name}",
        f"  router     {plan.router.url}   (send requests here: the P/D entry point)",
    ]
    for s in plan.instances:
        place = f"GPUs {','.join(s.gpus)}" if s.gpus else f"cores {s.cpu_bind}" if s.cpu_bind else ""
        lines.append(f"  {s.name:<10} {s.url}   ({s.role}{', ' + place if place else ''})")
    lines += [
        f"  logs       {run_dir}",
        "",
        f"# the cluster's environment (also in {run_dir / ENV_FILE}: `. {run_dir / ENV_FILE}`)",
    ]
    lines += clusterenv.export_lines(env)
    body = json.dumps(
        {
            "model": plan.served_model_name,
            "prompt": "The capital of France is",
            "max_tokens": 16,
            "temperature": 0,
        }
    )
    lines += [
        "",
        "# try it:",
        f"curl -s {plan.router.url}/v1/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(body)}",
        "",
        "serving until Ctrl-C or SIGTERM (every process is watched: a death ends the session "
        "with an error naming it)",
    ]
    return lines


def serve(
    config: ClusterConfig,
    inv: Inventory,
    opts: SweepOptions,
    *,
    progress: Callable[[str], None],
    emit: Callable[[str], None],
) -> None:
    """Start ``config``, ``emit`` the banner lines, hold until interrupted or a process dies."""
    with one_cluster(config, inv, opts, progress=progress) as cluster:
        plan = cluster.plan
        env = clusterenv.cluster_env(plan, clusterenv.write_cluster_file(plan, cluster.run_dir))
        (cluster.run_dir / ENV_FILE).write_text("\n".join(clusterenv.export_lines(env)) + "\n")
        for line in banner(plan, env, cluster.run_dir):
            emit(line)
        # The watched call never returns: only a death (ProcessExited) or an interrupt ends it.
        cluster.guard(threading.Event().wait, when="while serving")
