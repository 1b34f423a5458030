"""``pd-sessions serve SWEEP --only CONFIG``: one cluster, held up for a person or a test suite.

Start the config as a sweep would (same plan, same readiness, inside the same lifeline:
run/lifeline.py's start_config, so that nothing outlives a stopped or killed serve), say how to reach it
(URLs, the user-command environment as ``export`` lines, a curl example; also
written to ``<run_dir>/cluster.env`` and ``cluster.json``), then watch every process
until the caller is interrupted (Ctrl-C, SIGTERM: the CLI turns them into exceptions)
or one dies (ProcessExited, naming it). Teardown always runs. Exit 0 when stopped by Ctrl-C or
SIGTERM (its normal end), 1 when a server died.
"""

from __future__ import annotations

import argparse
import json
import shlex
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import UsageError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan import ClusterPlan
from pd_sessions.env.envfacts import facts
from pd_sessions.run import launch
from pd_sessions.run.dry_run import plan_text, planning_hosts
from pd_sessions.run.lifeline import start_config
from pd_sessions.run.sweep_options import SweepOptions
from pd_sessions.runtime import clusterenv
from pd_sessions.runtime.console import Stopped, say

ENV_FILE = "cluster.env"


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
    with start_config(config, inv, opts, progress=progress) as cluster:
        plan = cluster.plan
        env = clusterenv.cluster_env(plan, clusterenv.write_cluster_file(plan, cluster.run_dir))
        (cluster.run_dir / ENV_FILE).write_text("\n".join(clusterenv.export_lines(env)) + "\n")
        for line in banner(plan, env, cluster.run_dir):
            emit(line)
        # The watched call never returns: only a death (ProcessExited) or an interrupt ends it.
        cluster.guard(threading.Event().wait, when="while serving")


def run(args: argparse.Namespace) -> int:
    """``pd-sessions serve``: start one config, print how to reach it, hold it up until Ctrl-C or
    SIGTERM (exit 0 then; 1 when a server died)."""
    sel = launch.checked(args)
    if len(sel.only) != 1 or len(sel.configs) != 1:
        names = ", ".join(e.config.name for e in sel.sweep.entries(sel.platform))
        raise UsageError(f"serve starts one config: name it with --only (known in {sel.sweep.name}: {names})")
    (config,) = sel.configs
    env = facts(import_torch=False, full=False)
    warnings = launch.refuse_before_launch(sel, env, dry_run=args.dry_run)
    opts = launch.run_options(args, sel, results_name=f"serve-{sel.sweep.name}")
    for line in launch.setup_lines(sel, env, warnings):
        say(line)
    if args.dry_run:
        with planning_hosts(opts, sel.inv, say) as hosts:
            print(plan_text(config, sel.inv, opts, hosts))
        say("dry run: nothing was launched")
        return 0
    say(
        f"serve {sel.sweep.name} {config.name} ({config.shape}, {config.connector}) on {sel.platform}; "
        f"logs in {opts.results_dir / config.name}"
    )
    try:
        serve(config, sel.inv, opts, progress=say, emit=lambda line: print(line, flush=True))
    except (Stopped, KeyboardInterrupt) as e:
        say(f"{e if isinstance(e, Stopped) else 'interrupted (SIGINT)'}: torn down, nothing left running")
    return 0
