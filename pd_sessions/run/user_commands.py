"""The user's own commands (``--exec``, ``--pytest``) run against a live cluster.

One module for the sweep (after the built-in checks) and ``serve`` (the same
environment, printed). Pure parts: parsing and validating the commands, the
cluster's environment and its JSON description, the verdict. The edge:
:func:`run_commands` spawns each command in its own session (output to
``run_dir/exec-N.log``), waits with the cluster's liveness guard on, stops its
process group at the timeout, and records check ``exec[N]``.

The environment a command sees (upstream vLLM's P/D test files read these names)::

    PREFILL_HOST, PREFILL_PORT     the first prefill instance
    DECODE_HOST, DECODE_PORT       the first decode instance
    PROXY_HOST, PROXY_PORT         the router (upstream's "proxy")
    PREFILL_PORTS, DECODE_PORTS    every instance, comma-separated (also *_HOSTS)
    TEST_MODEL                     the served model name (what requests send as "model")
    BLOCK_SIZE                     the KV block size, when the plan sets one
    PD_SESSIONS_CLUSTER            a JSON file: URLs, roles, devices, connector, kv configs
    PD_SESSIONS_JUNITXML           where the command may write JUnit XML (merged into ours)
"""

from __future__ import annotations

import os
import shlex
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_sessions.core.cliargs import EXEC_TIMEOUT_S
from pd_sessions.core.errors import GuardTimeout, ProcessExited, UsageError
from pd_sessions.core.results import FAIL, PASS, CheckResult, Figure, Table, pick, reporting
from pd_sessions.runtime import process
from pd_sessions.runtime.clusterenv import cluster_env, write_cluster_file

JUNIT_PLACEHOLDER = "{junitxml}"
DEFAULT_TIMEOUT_S = EXEC_TIMEOUT_S
TAIL_LINES = 30


@dataclass(frozen=True)
class UserCommand:
    """One command to run with the cluster up."""

    index: int  # N in check name exec[N], in command-line order from 0
    argv: tuple[str, ...]  # may hold {junitxml}, replaced by the JUnit path at run time
    given: str  # as the user wrote it, for messages

    @property
    def name(self) -> str:
        return f"exec[{self.index}]"

    @property
    def log_name(self) -> str:
        return f"exec-{self.index}.log"

    @property
    def junit_name(self) -> str:
        return f"exec-{self.index}.junit.xml"


def parse_exec(text: str, index: int, *, which: Callable[[str], str | None] = shutil.which) -> UserCommand:
    """``--exec TEXT`` -> a command: split like a shell would (shlex), but no shell runs it.

    TEXT                           -> result
    empty / only spaces            -> UsageError "empty command"
    unbalanced quotes              -> UsageError naming shlex's complaint
    first word not found / not an executable file -> UsageError naming it
    otherwise                      -> UserCommand(argv = the words)
    """
    try:
        argv = tuple(shlex.split(text))
    except ValueError as e:
        raise UsageError(f"--exec {text!r}: cannot split it into words ({e})") from None
    if not argv:
        raise UsageError(
            f"--exec {text!r}: empty command; give a program and its arguments, "
            "e.g. --exec 'python -m pytest tests/my_test.py'"
        )
    exe = argv[0]
    if os.sep in exe:
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise UsageError(f"--exec {text!r}: {exe} is not an executable file")
    elif which(exe) is None:
        raise UsageError(
            f"--exec {text!r}: executable {exe!r} not found on PATH "
            "(commands run without a shell: no aliases, builtins or pipes; "
            "wrap them as `bash -c '...'` if you need one)"
        )
    return UserCommand(index=index, argv=argv, given=text)


def pytest_command(paths: Sequence[str], index: int, *, python: str, have_pytest: bool) -> UserCommand:
    """``--pytest PATH...`` -> ``python -m pytest PATH... --junitxml={junitxml}``.

    ``python`` is the session's own interpreter (the environment vLLM, openai and
    lm_eval are installed in). A path may carry a node id (``file.py::test_x``);
    the file part must exist.
    """
    if not paths:
        raise UsageError("--pytest: give at least one test file or directory")
    if not have_pytest:
        raise UsageError(
            f"--pytest: pytest is not installed for {python}; install it there "
            "(`pip install pytest openai`) or use --exec with another interpreter"
        )
    for p in paths:
        if not Path(p.split("::")[0]).exists():
            raise UsageError(
                f"--pytest {p}: no such file or directory (relative paths are read from {os.getcwd()})"
            )
    # -p: the pd_cluster fixture (attached to this cluster) even where pd-sessions runs from a
    # checkout rather than an installed distribution (installed, the entry point loads it once).
    argv = (
        python,
        "-m",
        "pytest",
        "-p",
        "pd_sessions.pytest_plugin",
        "-v",
        "-rA",
        *paths,
        f"--junitxml={JUNIT_PLACEHOLDER}",
    )
    return UserCommand(index=index, argv=argv, given="--pytest " + shlex.join(paths))


def from_cli(
    items: Sequence[str | Sequence[str]] | None,
    *,
    python: str,
    dry_run: bool,
    have_pytest: bool,
    which: Callable[[str], str | None] = shutil.which,
) -> tuple[UserCommand, ...]:
    """The commands of ``--exec`` (a string each) and ``--pytest`` (a list of paths each),
    in command-line order. With ``--dry-run`` (nothing is launched) any is a UsageError."""
    items = list(items or [])
    if items and dry_run:
        raise UsageError(
            "--exec/--pytest need a running cluster and --dry-run launches none; drop one of them"
        )
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(parse_exec(item, i, which=which))
        else:
            out.append(pytest_command(list(item), i, python=python, have_pytest=have_pytest))
    return tuple(out)


# --- what a command is told about the cluster (pure) ---------------------------------------


# --- the verdict (pure) --------------------------------------------------------------------


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the command as given, its exit status and its JUnit's counts."""
    junit = details.get("junit") or {}
    return [
        *pick(details, ("given", ""), ("returncode", "")),
        *pick(junit, ("tests", ""), ("failures", ""), ("errors", ""), ("skipped", "")),
    ]


@reporting(numbers)
def evaluate(
    cmd: UserCommand,
    *,
    returncode: int | None,
    seconds: float,
    timed_out: bool,
    timeout_s: float,
    log_path: Path,
    log_tail: str,
    junit: Mapping[str, Any] | None,
    dead: str | None = None,
) -> CheckResult:
    """exec[N]'s verdict.

        what happened                          -> verdict, message starts with
        a cluster process died meanwhile       -> fail, "<process> died while it ran: ..."
        ran past the timeout (group stopped)   -> fail, "did not finish within T s"
        exit status 0                          -> pass, "exit status 0"
        exit status != 0                       -> fail, "exit status S" (+ the first failing
                                                  test and its message, from its JUnit)
    ``junit`` is the summary of the JUnit file it wrote (:func:`junit_summary`), if any.
    """
    details: dict[str, Any] = {
        "argv": list(cmd.argv),
        "given": cmd.given,
        "returncode": returncode,
        "log": str(log_path),
        "timed_out": timed_out,
    }
    counts = ""
    if junit:
        details["junit"] = dict(junit)
        counts = (
            f" ({junit['tests']} tests: {junit['failures']} failed, {junit['errors']} errors, "
            f"{junit['skipped']} skipped)"
        )
    if dead is not None:
        return CheckResult(cmd.name, FAIL, f"{dead}; {cmd.given} was stopped", details, seconds)
    if timed_out:
        return CheckResult(
            cmd.name,
            FAIL,
            f"{cmd.given} did not finish within {timeout_s:g} s "
            f"(--exec-timeout); its process group was stopped; log {log_path}",
            details,
            seconds,
        )
    if returncode == 0:
        return CheckResult(
            cmd.name, PASS, f"{cmd.given}: exit status 0 after {seconds:.1f} s{counts}", details, seconds
        )
    first = ""
    if junit and junit.get("first_failure"):
        first = f"; first failure: {junit['first_failure']}"
    tail = log_tail.strip().splitlines()[-1:] if not first else []
    return CheckResult(
        cmd.name,
        FAIL,
        f"{cmd.given}: exit status {returncode}{counts}{first}"
        + (f"; last line: {tail[0][:200]}" if tail else "")
        + f"; log {log_path}",
        details,
        seconds,
    )


def junit_summary(path: Path) -> dict[str, Any] | None:
    """Counts and the first failure (``classname::name: message``) of a JUnit file; None if absent
    or unreadable (the exit status still decides)."""
    import xml.etree.ElementTree as ET

    if not path.is_file():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    cases = list(root.iter("testcase"))
    out: dict[str, Any] = {
        "path": str(path),
        "tests": len(cases),
        "failures": 0,
        "errors": 0,
        "skipped": 0,
        "first_failure": None,
    }
    for c in cases:
        for kind, key in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
            el = c.find(kind)
            if el is None:
                continue
            out[key] += 1
            if kind != "skipped" and out["first_failure"] is None:
                msg = (el.get("message") or el.text or "").strip()
                first = msg.splitlines()[0][:300] if msg else "(no message)"
                out["first_failure"] = f"{c.get('classname', '')}::{c.get('name', '')}: {first}"
    return out


# --- the edge ------------------------------------------------------------------------------


def _argv(cmd: UserCommand, junit: Path) -> list[str]:
    return [a.replace(JUNIT_PLACEHOLDER, str(junit)) for a in cmd.argv]


def run_commands(
    cluster: Any,
    commands: Sequence[UserCommand],
    results: list[CheckResult],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    grace_s: float = 10.0,
    progress: Callable[[str], None] | None = None,
    base_env: Mapping[str, str] | None = None,
) -> None:
    """Run ``commands`` one after another against the live ``cluster`` (a cluster.Cluster),
    appending check ``exec[N]`` for each to ``results``.

    A cluster process that dies while one runs: that command is stopped, its check fails
    naming the process, and the ProcessExited is raised again (the cluster is gone, so the
    commands after it do not run; the caller's teardown follows).
    """
    say = progress or (lambda msg: None)
    plan = cluster.plan
    run_dir = Path(cluster.run_dir)
    env = {
        **(os.environ if base_env is None else base_env),
        **cluster_env(plan, write_cluster_file(plan, run_dir)),
    }
    for cmd in commands:
        junit = run_dir / cmd.junit_name
        junit.unlink(missing_ok=True)
        log_path = run_dir / cmd.log_name
        argv = _argv(cmd, junit)
        say(f"{plan.config.name}: {cmd.name}: running {shlex.join(argv)} (output: {log_path})")
        started, t0 = time.time(), time.monotonic()
        running = process.spawn(
            cmd.name, argv, env={**env, "PD_SESSIONS_JUNITXML": str(junit)}, log_path=log_path
        )
        timed_out, dead, returncode = False, None, None
        try:
            try:
                returncode = cluster.guard(
                    running.popen.wait,
                    when=f"while {cmd.name} ran",
                    timeout=timeout_s,
                    heartbeat=lambda cmd=cmd, t0=t0: say(
                        f"{plan.config.name}: {cmd.name} running for "
                        f"{time.monotonic() - t0:.0f} s (timeout {timeout_s:g} s)"
                    ),
                )
            except GuardTimeout:
                timed_out = True
            except ProcessExited as e:
                dead = str(e).splitlines()[0]
                raise
        finally:
            # Also after a clean exit: whatever it left running in its session goes too.
            process.stop([running], grace_s=grace_s)
            if timed_out or dead is not None or returncode is not None:  # not when interrupted
                tail = running.log_tail(TAIL_LINES)
                r = evaluate(
                    cmd,
                    returncode=returncode,
                    seconds=time.monotonic() - t0,
                    timed_out=timed_out,
                    timeout_s=timeout_s,
                    log_path=log_path,
                    log_tail=tail,
                    junit=junit_summary(junit),
                    dead=dead,
                )
                r.started_at = started
                results.append(r)
                if not r.passed:
                    say(
                        f"{plan.config.name}: {cmd.name} FAILED; "
                        f"last {TAIL_LINES} lines of {log_path}:\n{tail}"
                    )
