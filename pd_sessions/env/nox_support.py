"""The noxfile's helpers: where a session runs the harness, what it installs there, and the
sessions that do more than one line (noxfile.py keeps one short function per session).

Two places a session runs the harness (:class:`Target`):
- its own venv: the lane's requirements and this package are installed, then the connector
  variants the installed torch needs;
- the current interpreter as found (``nox --no-venv`` or ``--installed``): vLLM, torch and the
  router are taken as they are, only the connector variant torch needs is swapped in place, and
  a missing piece is an exit-2 error naming the command that installs it (``--no-install``
  changes nothing at all; ``--find-links DIR`` installs from that folder only).

A session's posargs are parsed by the package's own parsers and checked by the CLI's own
selection (:func:`pd_sessions.core.selection.select_run`) before anything is installed.

nox imports the noxfile with its own interpreter, before any session installs anything: this
module needs the standard library and ``packaging`` only (tests/test_bare_imports.py), and it
never imports nox. Its tests drive it with a fake session (tests/test_nox_support.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol

from pd_sessions.core import connectors as kv_connectors
from pd_sessions.core.cliargs import split_session_args, sweep_parser
from pd_sessions.core.config import load
from pd_sessions.core.errors import PdError
from pd_sessions.core.inventory import resolve_platform
from pd_sessions.core.preflight import preflight
from pd_sessions.core.selection import overrides, select_run
from pd_sessions.env import in_place, lane_install
from pd_sessions.env.envfacts import summary_lines
from pd_sessions.runtime import machine, parentwatch

ROOT = lane_install.ROOT
# What the test sessions install besides the package (and, for `tests`, the CPU lane).
TEST_REQUIREMENTS = ("test.txt", "buildkite.txt", "bench.txt")
# The tests session's multi-host tests (the simulated hosts, Ray nodes): not the unit session's.
MULTIHOST_REQUIREMENTS = ("ray.txt",)


class Session(Protocol):
    """The part of ``nox.Session`` these helpers use."""

    name: str
    posargs: list[str]

    @property
    def venv_backend(self) -> str: ...

    def log(self, *args: Any, **kwargs: Any) -> None: ...

    def install(self, *args: str, **kwargs: Any) -> None: ...

    def run(self, *args: str, **kwargs: Any) -> Any: ...

    def run_install(self, *args: str, **kwargs: Any) -> Any: ...


def fail(session: Session, message: str, status: int = 2) -> NoReturn:
    """Stop the session (and nox) with ``status``: 2 = bad input or a missing piece, nothing ran."""
    session.log(f"pd-sessions: error: {message}")
    raise SystemExit(status)


def requirements(*names: str) -> list[str]:
    """``-r requirements/NAME ...`` for an install."""
    return [arg for name in names for arg in ("-r", str(ROOT / "requirements" / name))]


class Target:
    """Where a session runs the harness: its own venv, or the current interpreter as found."""

    def __init__(self, session: Session, posargs: Sequence[str] | None = None):
        self.session = session
        self.opts, self.rest = split_session_args(session.posargs if posargs is None else posargs)
        self.installed = session.venv_backend == "none" or self.opts.installed
        self.no_install = self.opts.no_install or _nox_no_install(session)
        try:
            self.find_links = in_place.find_links_folder(self.opts.find_links, os.environ)
        except PdError as e:
            fail(session, str(e), e.exit_status)
        self.python = sys.executable if self.installed else "python"

    def run(self, *args: str, **kw: Any) -> None:
        """Run ``python ARGS`` on the target interpreter."""
        self.session.run(self.python, *args, external=self.installed, **kw)

    def facts(self) -> dict[str, Any]:
        """What the target interpreter has (written to a file: stderr noise cannot corrupt it)."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "facts.json"
            self.run("-m", "pd_sessions.env.envfacts", "--out", str(out), env=self.env, silent=True)
            return dict(json.loads(out.read_text()))

    @property
    def env(self) -> dict[str, str] | None:
        """On the installed interpreter, this checkout's pd_sessions comes first on the path
        (also when another copy is installed there); a venv has it installed editable."""
        if not self.installed:
            return None
        return {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def venv_install(self, *args: str, env: dict[str, str] | None = None) -> None:
        offline = in_place.offline_args(self.find_links)
        self.session.install(*offline, *args, env=env)


def _nox_no_install(session: Session) -> bool:
    """nox's own --no-install (-R) flag; nox keeps it on its runner's global config."""
    runner = getattr(session, "_runner", None)
    return bool(getattr(getattr(runner, "global_config", None), "no_install", False))


class VenvInstaller:
    """lane_install.Installer over a session venv, honouring --find-links."""

    def __init__(self, target: Target):
        self.target = target

    def install(self, *args: str, env: Any = None) -> None:
        self.target.venv_install(*args, env=env)

    def run_install(self, *args: str) -> object:
        return self.target.session.run_install(*args)


def check(
    session: Session, target: Target, sweep_name: str | None, parser: argparse.ArgumentParser
) -> tuple[str, argparse.Namespace]:
    """Parse and check the posargs exactly as the CLI will (its own selection, on this host's
    inventory), before anything is installed. Returns (platform, the CLI's args).

    sweep_name  -> what is checked
    None        -> the overrides and --platform (the imports sessions start no cluster)
    a sweep     -> everything `pd-sessions sweep` refuses before it starts (select_run)
    """
    args = parser.parse_args(target.rest)  # exits 2 (and prints usage) on a bad argument
    try:
        inv = machine.detect()
        if sweep_name is None:
            overrides(args)  # raises on a bad override, as the CLI would
            return resolve_platform(args.platform, inv), args
        return select_run(sweep_name, args, inv).platform, args
    except PdError as e:
        fail(session, str(e), e.exit_status)


def connectors(
    session: Session,
    target: Target,
    platform: str,
    names: Sequence[str],
    *,
    accuracy: bool = True,
    commands: Mapping[str, str] | None = None,
) -> None:
    """Make the target fit (venv: install the lane, and the Debian packages of ``commands``
    missing from PATH; installed: only connector swaps), then run the import canary in its own
    process. Stops the session on any failure."""
    try:
        if target.installed:
            installed_env(session, target, platform, names, accuracy=accuracy)
        else:
            _venv_env(session, target, platform, names, commands)
    except PdError as e:
        fail(session, str(e), e.exit_status)
    target.run("-m", "pd_sessions.env.import_canary", *names)


def _venv_env(
    session: Session,
    target: Target,
    platform: str,
    names: Sequence[str],
    commands: Mapping[str, str] | None = None,
) -> None:
    """The session venv: the lane's requirements and this package (with the Debian packages the
    lane and ``commands`` need), then the connector variants for the torch that brought."""
    env = lane_install.index_env(dict(os.environ))
    lane_install.install_lane(
        VenvInstaller(target),
        platform,
        say=session.log,
        environ=os.environ,
        commands=commands,
    )
    doc = target.facts()
    torch_platform, actions = lane_install.plan_connectors(doc, names)
    session.log(
        f"torch {(doc.get('torch') or {}).get('version')} is built for "
        f"{torch_platform.describe()}: {len(actions)} connector action(s)"
    )
    lane_install.apply_actions(VenvInstaller(target), actions, torch_platform, env=env, say=session.log)


def installed_env(
    session: Session, target: Target, platform: str, names: Sequence[str], *, accuracy: bool
) -> None:
    """The interpreter as found: report what is missing (exit 2), else make only the connector
    swaps (and install pd-sessions there if it lacks it); with --no-install, change nothing."""
    doc = target.facts()
    for line in summary_lines(doc):
        session.log(line)
    plan = in_place.plan_installed(
        doc, names, lane=platform, need_lm_eval=accuracy, no_install=target.no_install
    )
    if plan.missing:
        fail(
            session,
            f"the environment at {plan.python} lacks what this session needs "
            "(installed-environment mode never installs vLLM, torch, the router or a connector "
            "by itself):\n  " + "\n  ".join(map(str, plan.missing)),
        )
    steps = plan.describe()
    if target.no_install:
        session.log(
            "--no-install: changing nothing"
            + (f"; this run would: {'; '.join(steps)}" if steps else "; nothing to change")
        )
        return
    session.log(
        f"installed environment: {len(steps)} change(s) for torch built for "
        f"{plan.platform.describe()}" + (f": {'; '.join(steps)}" if steps else "")
    )
    if steps:
        _apply_installed(session, target, plan, doc)


def _apply_installed(
    session: Session, target: Target, plan: in_place.InstalledPlan, doc: dict[str, Any]
) -> None:
    inst = in_place.installer(doc, shutil.which("uv"))
    if inst is None:
        fail(
            session,
            f"{plan.python} has no pip and uv is not on PATH: cannot make {'; '.join(plan.describe())}",
            1,
        )
    for a in plan.actions:
        session.log(f"pd-sessions install: {a}")
        session.run(*in_place.action_argv(inst, a, find_links=target.find_links), external=True)
    if plan.install_harness:
        session.log(f"pd-sessions install: pd-sessions (editable, from {ROOT})")
        session.run(*in_place.harness_argv(inst, find_links=target.find_links), external=True)


# What a dry run says torch brings on each lane: the CPU lane's torch is CPU-only; a CUDA lane's
# torch (from the index) is built for CUDA 12.8 or 13.0, so a dry run shows both.
DRY_RUN_TORCH: dict[str, list[dict[str, Any]]] = {
    "cpu": [{"torch": {"cuda": None}}],
    "cuda": [{"torch": {"cuda": "12.8"}}, {"torch": {"cuda": "13.0"}}],
}


def dry_run_install(session: Session, target: Target, platform: str, names: Sequence[str]) -> None:
    """Say what a run would install (nothing on the installed environment); install nothing."""
    if target.installed:
        session.log("dry run on the installed environment: nothing is installed")
        return
    session.log(
        f"dry run: would install -r {lane_install.lane_requirements(platform).relative_to(ROOT)} "
        f"and this package, then the connector variants for the torch that brings:"
    )
    for doc in DRY_RUN_TORCH[platform]:
        plat, actions = lane_install.plan_connectors(doc, names)
        session.log(f"  {plat.describe()}: " + "; ".join(map(str, actions)))
    session.log(f"  then: python -m pd_sessions.env.import_canary {' '.join(names)}")


def named_sweep(session: Session) -> str:
    """The sweep named by the first posarg."""
    if not session.posargs or session.posargs[0].startswith("-"):
        fail(session, f"name the sweep first: nox -s {session.name} -- NAME_OR_TOML [options]")
    return session.posargs[0]


def sweep_connectors(session: Session, name: str) -> list[str]:
    """The connectors the configs of sweep ``name`` use (what its session installs)."""
    try:
        sweep = load(name)
    except PdError as e:
        fail(session, str(e), e.exit_status)
    return sorted({e.config.connector for plat in sweep.platforms for e in sweep.entries(plat)})


def sweep(
    session: Session,
    name: str,
    extra: tuple[str, ...] = (),
    posargs: list[str] | None = None,
    command: str = "sweep",
) -> None:
    """A sweep session (``command`` "serve": the serve session): check the posargs, install the
    connectors its configs use (only the package for a --dry-run), then run
    ``python -m pd_sessions COMMAND NAME ...``."""
    target = Target(session, posargs)
    parser = sweep_parser(prog=f"nox -s {session.name} --", positional=False, serve=command == "serve")
    if "-h" in target.rest or "--help" in target.rest:
        parser.print_help()
        return
    platform, args = check(session, target, name, parser)
    names = sweep_connectors(session, name)
    if args.dry_run:  # plans need only the package itself
        dry_run_install(session, target, platform, names)
        if not target.installed:
            target.venv_install("-e", str(ROOT))
    else:
        accuracy = "accuracy" not in getattr(args, "skip_check", ["accuracy"])
        connectors(session, target, platform, names, accuracy=accuracy)
    # On Ctrl-C (nox_run_options), SIGTERM and SIGHUP (nox_waits_for_the_harness), nox waits for
    # the teardown and the results instead of SIGKILLing the harness or exiting before it.
    with parentwatch.nox_waits_for_the_harness(session.log):
        target.run(
            "-m",
            "pd_sessions",
            command,
            name,
            *extra,
            *target.rest,
            env=target.env,
            **parentwatch.nox_run_options(target.rest),
        )


def soak(session: Session) -> None:
    """The soak session: ``--cycles N`` (default 3) taken from the posargs, the rest checked as a
    sweep session's; then ``python -m pd_sessions soak SWEEP --cycles N ...`` (run/soak_command.py),
    SWEEP the built-in sweep of the connector the soak runs over (connectors.SOAK)."""
    name = kv_connectors.SOAK.sweep
    rest = list(session.posargs)
    cycles = "3"
    if "--cycles" in rest:
        i = rest.index("--cycles")
        if i + 1 >= len(rest) or not rest[i + 1].isdigit() or int(rest[i + 1]) < 1:
            fail(session, "--cycles: give the number of restart cycles, 1 or more (e.g. --cycles 3)")
        cycles = rest[i + 1]
        del rest[i : i + 2]
    sweep(session, name, extra=("--cycles", cycles), posargs=rest, command="soak")


def imports(session: Session, names: Sequence[str]) -> None:
    """An imports session: install (or, with --dry-run, say what would be) and run the canary."""
    target = Target(session)
    platform, args = check(
        session, target, None, sweep_parser(prog=f"nox -s {session.name} --", positional=False)
    )
    if args.dry_run:
        dry_run_install(session, target, platform, names)
        return
    connectors(session, target, platform, names, accuracy=False)


# The unit session's tier: what runs in a venv of the package and TEST_REQUIREMENTS alone, in seconds,
# with no skip (PD_SESSIONS_UNIT_TIER=1: tests/conftest.py fails a skipped test). What needs more
# (vLLM, Ray, torch, a connector, root) or spawns processes, fake servers, namespaces, or waits out
# deadlines is marked procs (pyproject.toml), multihost or e2e, and runs in `nox -s tests`.
UNIT_TIER = "not e2e and not multihost and not procs"


def unit(session: Session) -> None:
    """The unit session: the package and the test requirements in its own venv, then pytest on
    the pure tier (UNIT_TIER); posargs go to pytest."""
    session.install("-e", str(ROOT), *requirements(*TEST_REQUIREMENTS))
    session.run("pytest", "-m", UNIT_TIER, *session.posargs, env={"PD_SESSIONS_UNIT_TIER": "1"})


def docs(session: Session, *, check: bool) -> None:
    """The docs site (mkdocs.yml): the reference pages generated from the code
    (tools/docs_reference.py; ``check``: only verify they are fresh, naming each stale page, as CI
    does, else rewrite them), then ``mkdocs build --strict``: a broken internal link or anchor fails."""
    session.install("-e", str(ROOT), *requirements("docs.txt"))
    session.run("python", str(ROOT / "tools" / "docs_reference.py"), *(["--check"] if check else []))
    env = {"NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor, on every build
    session.run("mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), env=env)


def tests(session: Session) -> None:
    """The tests session: the CPU lane with every connector, the test requirements, then pytest
    in the full environment (PD_SESSIONS_FULL_ENV=1: a missing heavy module fails, never skips)."""
    target = Target(session)
    every = [p.name for p in kv_connectors.packages()]
    # gcc: the canary's tests build real ELF files (installed with the lane's Debian packages)
    connectors(session, target, "cpu", every, commands=lane_install.TEST_COMMANDS)
    if not target.installed:
        target.venv_install(*requirements(*TEST_REQUIREMENTS, *MULTIHOST_REQUIREMENTS))
    target.run("-m", "pytest", *target.rest, env={**(target.env or {}), "PD_SESSIONS_FULL_ENV": "1"})


def recall(session: Session) -> None:
    """The recall session: install the CPU lane of both connectors and Ray (the wire faults'
    simulated hosts), then ``python -m pd_sessions recall ...`` (run/recall.py). Reading earlier
    results (``--results DIR...``) or asking for help installs only the package."""
    target = Target(session)
    reads_only = any(a in target.rest for a in ("--results", "-h", "--help"))
    if reads_only:
        if not target.installed:
            target.venv_install("-e", str(ROOT))
    else:
        platform = "cuda" if "cuda" in target.rest else "cpu"
        connectors(session, target, platform, [c.name for c in kv_connectors.RECALL], accuracy=False)
        if not target.installed and "--no-hosts" not in target.rest:
            target.venv_install(*requirements(*MULTIHOST_REQUIREMENTS))
    with parentwatch.nox_waits_for_the_harness(session.log):
        target.run(
            "-m", "pd_sessions", "recall", *target.rest, env=target.env,
            **parentwatch.nox_run_options(target.rest),
        )  # fmt: skip


def bench(session: Session, parser: argparse.ArgumentParser) -> None:
    """The bench session: its posargs parsed by the bench's own ``parser`` (pd_sessions.bench
    options) before anything is installed; the connectors of --sweep and of --check-sweeps
    (the checks part runs those too); then ``python -m pd_sessions bench``."""
    target = Target(session)
    args = parser.parse_args(target.rest)  # exits 2 on a bad option; --help prints and exits 0
    try:
        main = load(args.sweep)
        platform, _, _ = preflight(main, args.platform, machine.detect())
        sweeps = [main, *(load(n) for n in args.check_sweeps.split(",") if n)]
    except PdError as e:
        fail(session, str(e), e.exit_status)
    names = sorted({e.config.connector for s in sweeps for e in s.entries(platform)})
    connectors(session, target, platform, names, accuracy=args.with_accuracy)
    if not target.installed:
        target.venv_install(*requirements("bench.txt"))
    elif lacking := [m for m in ("matplotlib", "aiohttp") if m not in target.facts()["installed"]]:
        fail(
            session,
            f"the bench needs {', '.join(lacking)}: install them with "
            f"`{sys.executable} -m pip install -r {ROOT / 'requirements' / 'bench.txt'}`",
        )
    target.run("-m", "pd_sessions", "bench", *target.rest)
