"""``pd-sessions serve``: start one config, print how to reach it, and hold it up until Ctrl-C or
SIGTERM (exit 0 then; 1 when a server died)."""

from __future__ import annotations

import argparse

from pd_sessions.commands import launch
from pd_sessions.commands.sweep import plan_text
from pd_sessions.core.errors import UsageError
from pd_sessions.env.envfacts import facts
from pd_sessions.run import serve
from pd_sessions.run.ray_hosts import hosts_for
from pd_sessions.runtime.console import Stopped, say


def run(args: argparse.Namespace) -> int:
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
        with hosts_for(opts, say) as hosts:
            print(plan_text(config, sel.inv, opts, hosts))
        say("dry run: nothing was launched")
        return 0
    say(
        f"serve {sel.sweep.name} {config.name} ({config.shape}, {config.connector}) on {sel.platform}; "
        f"logs in {opts.results_dir / config.name}"
    )
    try:
        serve.serve(config, sel.inv, opts, progress=say, emit=lambda line: print(line, flush=True))
    except (Stopped, KeyboardInterrupt) as e:
        say(f"{e if isinstance(e, Stopped) else 'interrupted (SIGINT)'}: torn down, nothing left running")
    return 0
