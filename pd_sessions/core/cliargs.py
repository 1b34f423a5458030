"""The sweep's command-line options, in one place (standard library only).

The CLI (``pd-sessions sweep``) and the noxfile both parse with these parsers, so a
session's posargs are checked exactly as the CLI checks them, before anything is
installed. Options that only the nox sessions understand (how to install) are parsed
first and not passed on.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from pd_sessions.core import check_registry as check_registry
from pd_sessions.core import connectors

# The sweep positional's help (the CLI's `sweep` and `serve` say it too).
SWEEP_HELP = f"a built-in sweep name (e.g. {connectors.DEFAULT.sweep}) or a .toml path"


def positive_seconds(text: str) -> float:
    """argparse type for --deadline/--grace: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; give a number of seconds above 0") from None
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(
            f"got {text}; give a number of seconds above 0 (leave it out for the default)"
        )
    return value


def host_count(text: str) -> int:
    """argparse type for --simulate-hosts: 2 hosts or more (0, the default, is one real host)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; give a number of hosts, 2 or more") from None
    if value == 1:
        raise argparse.ArgumentTypeError(
            "got 1: prefill and decode would share that one host, and nothing would cross a link; "
            "give 2 or more (or leave --simulate-hosts out to run on this host)"
        )
    if value < 0:
        raise argparse.ArgumentTypeError(f"got {value}; give a number of hosts, 2 or more")
    return value


# --exec-timeout's default (pd_sessions.run.user_commands uses it too).
EXEC_TIMEOUT_S = 3600.0


def add_common_options(s: argparse.ArgumentParser) -> None:
    """Options of both ``sweep`` and ``serve``: what to start, where, and the overrides."""
    s.add_argument(
        "--platform",
        choices=["cpu", "cuda"],
        default=None,
        help="force a platform; default: cuda when a GPU is visible, else cpu",
    )
    s.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this config (repeatable, or comma-separated)",
    )
    s.add_argument(
        "--include-opt-in",
        action="store_true",
        help="also run configs that are opt-in on this platform (e.g. 2x2 on CPU)",
    )
    s.add_argument("--dry-run", action="store_true", help="print every plan; launch nothing")
    add_run_options(s)
    add_host_options(s)
    add_override_options(s)
    s.add_argument("-v", "--verbose", action="store_true", help="log at debug level")


def add_run_options(s: argparse.ArgumentParser) -> None:
    """How each config runs: where its results go, its deadlines and grace, what it may do, the
    connectors' own options."""
    s.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="where results and logs go (default: results/<sweep>-<time>)",
    )
    s.add_argument(
        "--deadline",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="readiness deadline per config (default 1200)",
    )
    s.add_argument(
        "--pd-path-budget",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="once every instance is healthy, how long a P/D path may keep failing before the "
        "config fails (default 60)",
    )
    s.add_argument(
        "--grace",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="SIGTERM grace before SIGKILL at teardown (default 10)",
    )
    s.add_argument(
        "--allow-unpinned-remote-code",
        action="store_true",
        help="allow trust_remote_code without a pinned revision (said in the results)",
    )
    s.add_argument(
        "--share-gpus",
        action="store_true",
        help="let instances share GPUs when the host has fewer than the config needs "
        "(each gets explicit KV-cache bytes); prints a warning",
    )
    for option in connectors.options():  # each connector's own fields (its spec's options)
        s.add_argument(
            option.flag,
            dest=option.field,
            choices=list(option.choices) or None,
            default=os.environ.get(option.env) if option.env else None,
            help=option.help,
        )


def add_override_options(s: argparse.ArgumentParser) -> None:
    """``--model``, ``--revision``, ``--set``, ``--extra-arg``: the config's fields, for this run."""
    o = s.add_argument_group("per-run overrides (recorded in plan.txt, result.json and the summary)")
    o.add_argument(
        "--model",
        default=None,
        metavar="ID_OR_PATH",
        help="serve this model in every config: a hub id, a local path, or tiny-llama / "
        "tiny-mixtral (replaces upstream's TEST_MODEL)",
    )
    o.add_argument("--revision", default=None, help="hub revision of --model (a commit or tag)")
    o.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        dest="set_fields",
        help="set any config field, parsed and checked like the TOML (repeatable), e.g. "
        "--set gpu_memory_utilization=0.8 --set block_size=16; also the sweep's checks "
        "(--set 'checks=[\"smoke\"]') and a check's option (--set 'check_options.wire_loss.rates=[2]')",
    )
    o.add_argument(
        "--extra-arg",
        action="append",
        default=[],
        metavar="ARG",
        dest="extra_arg",
        help="one more argv element for every vLLM instance (repeatable; "
        "--extra-arg=--enforce-eager for values that start with '-')",
    )


def add_host_options(s: argparse.ArgumentParser) -> None:
    """Across hosts: where the instances run, and the loopback refusal's way out."""
    h = s.add_argument_group("across hosts (prefill and decode on different Ray nodes)")
    h.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run each config across the nodes of this Ray cluster (HEAD:PORT, or 'auto'), started "
        "with `ray start --head` / `ray start --address HEAD:PORT --labels KEY=VALUE`; prefill_hosts "
        "/ decode_hosts select nodes by label (default: the nodes other than this one's, the first "
        "half prefill); needs pip install 'pd-sessions[ray]'",
    )
    h.add_argument(
        "--simulate-hosts",
        type=host_count,
        default=0,
        metavar="N",
        help="rehearse a multi-host run on this machine: N network namespaces on a bridge, each a "
        "host with its own address (198.18.0.0/15), loopback, share of the cores and Ray node; "
        "prefill on host1, decode on host2 (needs root and pip install 'pd-sessions[ray]')",
    )
    h.add_argument(
        "--allow-loopback-advertise",
        action="store_true",
        help="across hosts, plan an instance that would advertise a loopback address to the other "
        "hosts (refused otherwise): to see that bug fail",
    )


def add_sweep_options(s: argparse.ArgumentParser) -> None:
    """Every option of ``pd-sessions sweep`` except the sweep itself: the common ones, the
    checks', and the user's own commands."""
    add_common_options(s)
    add_check_options(s)
    s.add_argument_group("packing").add_argument(
        "--max-parallel",
        type=int,
        default=None,
        metavar="N",
        help="run up to N configs at once, packed by GPUs (cores on the CPU lane) so that no two "
        "share one (--dry-run shows the waves); default: as many as fit; 1: one after another",
    )
    add_user_command_options(s)
    s.add_argument_group("results").add_argument(
        "--upload-artifacts",
        action="store_true",
        help="as the sweep ends, upload the results directory (report.html, logs, JUnit) with "
        "`buildkite-agent artifact upload` when it is on PATH: for Buildkite steps without "
        "artifact_paths (vLLM's test_areas)",
    )


def add_check_options(s: argparse.ArgumentParser) -> None:
    """Which checks run, and how accuracy is judged."""
    c = s.add_argument_group("checks")
    c.add_argument(
        "--accuracy",
        choices=["enforce", "warn"],
        default="enforce",
        help="warn: exploratory run; an accuracy miss or missing baseline is reported, "
        "not failed (said in the summary)",
    )
    c.add_argument(
        "--accuracy-rule",
        choices=["tolerance", "wilson"],
        default="tolerance",
        help="accuracy against its baseline: the measured value within the baseline's rtol "
        "(tolerance), or the Wilson lower bound of the measured rate at least baseline x (1 - rtol)",
    )
    c.add_argument(
        "--accuracy-limit",
        type=int,
        default=None,
        metavar="N",
        help="lm_eval sample limit (refused unless it matches the baseline's)",
    )
    c.add_argument(
        "--allow-sample-mismatch",
        action="store_true",
        help="judge accuracy although its sample count differs from the baseline's (refused otherwise)",
    )
    c.add_argument(
        "--record-baseline", action="store_true", help="measure accuracy and write it as the model's baseline"
    )
    c.add_argument(
        "--check",
        action="append",
        default=[],
        metavar="NAME",
        help="also run this check besides the sweep's own (repeatable, or comma-separated), e.g. "
        "an opt-in one; 'faults' adds every fault scenario ("
        + ", ".join(check_registry.FAULTS)
        + "); 'wire' every fault on the wire between hosts ("
        + ", ".join(check_registry.WIRE)
        + ", across hosts only); names are checked like the TOML's",
    )
    c.add_argument(
        "--strict",
        action="store_true",
        help="every check that could not run (NOT RUN: e.g. no netem in the kernel, no perf "
        "baseline) fails its config; without it only the sweep's required ones do (TOML "
        "required_checks; default: every check the sweep itself runs but perf)",
    )
    c.add_argument(
        "--skip-check",
        action="append",
        default=[],
        choices=list(check_registry.NAMES),
        help="do not run this check (printed in the banner, recorded in the results)",
    )


def add_user_command_options(s: argparse.ArgumentParser) -> None:
    """``--exec``, ``--pytest`` and their timeout: the user's own commands against each cluster."""
    u = s.add_argument_group("your own commands against each live cluster")
    u.add_argument(
        "--exec",
        dest="user_commands",
        action="append",
        metavar="CMD",
        help="after the checks, run CMD (split like a shell, run without one) with the "
        "cluster up and its address in the environment (PREFILL_PORT, PROXY_PORT, "
        "PD_SESSIONS_CLUSTER...); its exit status is check exec[N]; {junitxml} in "
        "CMD becomes a path whose JUnit is merged into ours (repeatable)",
    )
    u.add_argument(
        "--pytest",
        dest="user_commands",
        action="append",
        nargs="+",
        metavar="PATH",
        help="shorthand for --exec 'python -m pytest PATH... --junitxml={junitxml}' with "
        "this environment's python (repeatable)",
    )
    u.add_argument(
        "--exec-timeout",
        type=positive_seconds,
        default=EXEC_TIMEOUT_S,
        metavar="SECONDS",
        help="stop a command (its process group) that runs longer and fail its check (default %(default)g)",
    )


def sweep_parser(
    prog: str = "pd-sessions sweep", *, positional: bool = True, serve: bool = False
) -> argparse.ArgumentParser:
    """The parser of ``sweep`` (or, with ``serve``, of ``serve``); ``positional=False`` for a
    nox session, whose sweep is given by the session."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "start one config and hold it up" if serve else "run (or --dry-run) a sweep of P/D clusters"
        ),
    )
    if positional:
        p.add_argument("sweep", help=SWEEP_HELP)
    (add_common_options if serve else add_sweep_options)(p)
    return p


# ------------------------------------------------------------------ nox sessions only


def session_parser() -> argparse.ArgumentParser:
    """Options that say how a nox session installs; everything else goes to the CLI."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--installed",
        action="store_true",
        help="run on the current interpreter and install nothing that is there already "
        "(what `nox --no-venv` does)",
    )
    p.add_argument(
        "--no-install",
        action="store_true",
        help="change nothing in the environment; report what is missing or mismatched",
    )
    p.add_argument(
        "--find-links",
        default=None,
        metavar="DIR",
        help="install only from this folder, never from an index (default: $PD_SESSIONS_FIND_LINKS)",
    )
    return p


def split_session_args(posargs: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(install options, the rest for the CLI). The rest keeps its order."""
    opts, rest = session_parser().parse_known_args(list(posargs))
    return opts, rest
