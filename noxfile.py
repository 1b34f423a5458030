"""nox sessions: thin wrappers; all logic lives in the pd_sessions package.

    nox -s mooncake_sweep [-- --platform cpu|cuda --only 1x1 --dry-run --results-dir DIR ...]
    nox -s mooncake_imports / nixl_imports [-- --dry-run]   # install + import canary only
    nox -s serve -- mooncake_sweep --only 1x1   # hold one cluster up (URLs, env, curl) until Ctrl-C
    nox -s tests        # unit + end-to-end (real vLLM on the CPU lane)
    nox -s unit         # unit tests only (no vLLM install)
    nox -s bench        # measures (not a test): overhead, readiness, teardown, router, each check's cost,
                        # nox's second-run start-up; writes bench/

Installed-environment mode: `nox --no-venv -s mooncake_sweep` (or the posarg `--installed`)
runs on the current interpreter: vLLM, torch and the router are taken as found, only the
connector variant torch needs is swapped in place, a missing piece is an exit-2 error naming
the command that installs it. `--no-install` changes nothing at all. `--find-links DIR` (or
$PD_SESSIONS_FIND_LINKS) installs from that folder only, never from an index.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))

from pd_sessions.core.cliargs import split_session_args, sweep_parser  # noqa: E402
from pd_sessions.core.config import load, make_overrides, select  # noqa: E402
from pd_sessions.core.errors import PdError, PlanError  # noqa: E402
from pd_sessions.core.inventory import resolve_platform  # noqa: E402
from pd_sessions.core.preflight import preflight, rdma_problem  # noqa: E402
from pd_sessions.env import install, installed  # noqa: E402
from pd_sessions.runtime import hosts, parentwatch  # noqa: E402

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["unit"]
PYTHON = "3.11"


def _fail(session: nox.Session, message: str, status: int = 2) -> None:
    """Stop the session (and nox) with ``status``: 2 = bad input or a missing piece, nothing ran."""
    session.log(f"pd-sessions: error: {message}")
    raise SystemExit(status)


class Target:
    """Where a session runs the harness: its own venv, or the current interpreter as found."""

    def __init__(self, session: nox.Session, posargs: list[str] | None = None):
        self.session = session
        self.opts, self.rest = split_session_args(session.posargs if posargs is None else posargs)
        self.installed = session.venv_backend == "none" or self.opts.installed
        self.no_install = self.opts.no_install or _nox_no_install(session)
        try:
            self.find_links = installed.find_links_folder(self.opts.find_links, os.environ)
        except PdError as e:
            _fail(session, str(e), e.exit_status)
        self.python = sys.executable if self.installed else "python"

    def run(self, *args: str, **kw) -> None:
        """Run ``python ARGS`` on the target interpreter."""
        self.session.run(self.python, *args, external=self.installed, **kw)

    def facts(self) -> dict:
        """What the target interpreter has (written to a file: stderr noise cannot corrupt it)."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "facts.json"
            self.run("-m", "pd_sessions.env.envfacts", "--out", str(out), env=self.env, silent=True)
            return json.loads(out.read_text())

    @property
    def env(self) -> dict[str, str] | None:
        """On the installed interpreter, this checkout's pd_sessions comes first on the path
        (also when another copy is installed there); a venv has it installed editable."""
        if not self.installed:
            return None
        return {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def venv_install(self, *args: str, env: dict | None = None) -> None:
        offline = installed.offline_args(self.find_links)
        self.session.install(*offline, *args, env=env)


def _nox_no_install(session: nox.Session) -> bool:
    """nox's own --no-install (-R) flag; nox keeps it on its runner's global config."""
    runner = getattr(session, "_runner", None)
    return bool(getattr(getattr(runner, "global_config", None), "no_install", False))


def _checked(session: nox.Session, target: Target, sweep_name: str | None, parser=None):
    """Parse and check the posargs exactly as the CLI will, before anything is installed.
    Returns (platform, the CLI's args)."""
    parser = parser or sweep_parser(prog=f"nox -s {session.name} --", positional=False)
    args = parser.parse_args(target.rest)  # exits 2 (and prints usage) on a bad argument
    try:
        over = make_overrides(
            sets=args.set_fields,
            model=args.model,
            revision=args.revision,
            extra_args=args.extra_arg,
            named={"mooncake_protocol": args.mooncake_protocol},
        )
        if sweep_name is None:
            return resolve_platform(args.platform, hosts.detect()), args
        sweep = load(sweep_name)
        inv = hosts.detect()
        platform, _, _ = preflight(
            sweep, args.platform, inv, dry_run=args.dry_run, share_gpus=args.share_gpus
        )
        only = tuple(o for item in args.only for o in item.split(",") if o)
        entries, _ = select(sweep.entries(platform), platform, only=only, include_opt_in=args.include_opt_in)
        rdma = rdma_problem([over.apply(e.config) for e in entries], platform, inv)
        if rdma and not args.dry_run:
            raise PlanError("mooncake_protocol", rdma)
    except PdError as e:
        _fail(session, str(e), e.exit_status)
    return platform, args


def _connectors(
    session: nox.Session,
    target: Target,
    platform: str,
    connectors: list[str],
    *,
    accuracy: bool = True,
    commands: dict[str, str] | None = None,
) -> None:
    """Make the target fit (venv: install the lane, and the Debian packages of ``commands``
    missing from PATH; installed: only connector swaps), then run the import canary in its own
    process. Stops the session on any failure."""
    try:
        if target.installed:
            _installed_env(session, target, platform, connectors, accuracy=accuracy)
        else:
            env = install.index_env(dict(os.environ))
            install.install_lane(
                _VenvInstaller(target), platform, say=session.log, environ=os.environ, commands=commands
            )
            doc = target.facts()
            torch_platform, actions = install.plan_connectors(doc, connectors)
            session.log(
                f"torch {(doc.get('torch') or {}).get('version')} is built for "
                f"{torch_platform.describe()}: {len(actions)} connector action(s)"
            )
            install.apply_actions(_VenvInstaller(target), actions, torch_platform, env=env, say=session.log)
    except PdError as e:
        _fail(session, str(e), e.exit_status)
    target.run("-m", "pd_sessions.env.canary", *connectors)


class _VenvInstaller:
    """install.Installer over a session venv, honouring --find-links."""

    def __init__(self, target: Target):
        self.target = target

    def install(self, *args: str, env=None) -> None:
        self.target.venv_install(*args, env=env)

    def run_install(self, *args: str) -> object:
        return self.target.session.run_install(*args)


def _installed_env(
    session: nox.Session, target: Target, platform: str, connectors: list[str], *, accuracy: bool
) -> None:
    from pd_sessions.env.envfacts import summary_lines

    doc = target.facts()
    for line in summary_lines(doc):
        session.log(line)
    plan = installed.plan_installed(
        doc, connectors, lane=platform, need_lm_eval=accuracy, no_install=target.no_install
    )
    if plan.missing:
        _fail(
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
    if not steps:
        return
    inst = installed.installer(doc, shutil.which("uv"))
    if inst is None:
        _fail(session, f"{plan.python} has no pip and uv is not on PATH: cannot make {'; '.join(steps)}", 1)
    for a in plan.actions:
        session.log(f"pd-sessions install: {a}")
        session.run(*installed.action_argv(inst, a, find_links=target.find_links), external=True)
    if plan.install_harness:
        session.log(f"pd-sessions install: pd-sessions (editable, from {ROOT})")
        session.run(*installed.harness_argv(inst, find_links=target.find_links), external=True)


def _dry_run_install(session: nox.Session, target: Target, platform: str, connectors: list[str]) -> None:
    if target.installed:
        session.log("dry run on the installed environment: nothing is installed")
        return
    session.log(
        f"dry run: would install -r {install.lane_requirements(platform).relative_to(ROOT)} "
        f"and this package, then the connector variants for the torch that brings:"
    )
    facts = {"cpu": {"torch": {"cuda": None}}, "cuda": None}[platform]
    cases = [facts] if facts is not None else [{"torch": {"cuda": "12.8"}}, {"torch": {"cuda": "13.0"}}]
    for doc in cases:
        plat, actions = install.plan_connectors(doc, connectors)
        session.log(f"  {plat.describe()}: " + "; ".join(map(str, actions)))
    session.log(f"  then: python -m pd_sessions.env.canary {' '.join(connectors)}")


def _sweep(
    session: nox.Session,
    name: str,
    connectors: list[str],
    extra: tuple[str, ...] = (),
    posargs: list[str] | None = None,
    command: str = "sweep",
) -> None:
    target = Target(session, posargs)
    parser = sweep_parser(prog=f"nox -s {session.name} --", positional=False, serve=command == "serve")
    if "-h" in target.rest or "--help" in target.rest:
        parser.print_help()
        return
    platform, args = _checked(session, target, name, parser)
    if args.dry_run:  # plans need only the package itself
        _dry_run_install(session, target, platform, connectors)
        if not target.installed:
            target.venv_install("-e", str(ROOT))
    else:
        _connectors(
            session,
            target,
            platform,
            connectors,
            accuracy="accuracy" not in getattr(args, "skip_check", ["accuracy"]),
        )
    # parentwatch.nox_run_options: on Ctrl-C, nox waits for the teardown instead of SIGKILLing it.
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


def _imports(session: nox.Session, connectors: list[str]) -> None:
    target = Target(session)
    platform, args = _checked(session, target, None)
    if args.dry_run:
        _dry_run_install(session, target, platform, connectors)
        return
    _connectors(session, target, platform, connectors, accuracy=False)


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "gpu", "ci"])
def mooncake_sweep(session: nox.Session) -> None:
    """Mooncake P/D sweep (TP 1x1, 2x2): install + canary, then real clusters, all checks.
    [-- --platform cpu|cuda --only NAME --dry-run --model ID --set F=V --extra-arg ARG
    --installed --no-install --find-links DIR; --help lists all]"""
    _sweep(session, "mooncake_sweep", ["mooncake"])


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "gpu", "ci"])
def nixl_sweep(session: nox.Session) -> None:
    """NIXL P/D sweep (TP 1x1, 2x2): install + canary, then real clusters, all checks.
    [-- same options as mooncake_sweep; --help lists all]"""
    _sweep(session, "nixl_sweep", ["nixl"])


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "gpu"])
def sweep(session: nox.Session) -> None:
    """Any sweep: a built-in name or your own TOML file, with the connectors its configs use.
    [-- NAME_OR_TOML, then the options of mooncake_sweep]"""
    name, connectors = _named_sweep(session, "sweep")
    _sweep(session, name, connectors, posargs=session.posargs[1:])


def _named_sweep(session: nox.Session, command: str) -> tuple[str, list[str]]:
    """(the sweep named by the first posarg, the connectors its configs use)."""
    if not session.posargs or session.posargs[0].startswith("-"):
        _fail(session, f"name the sweep first: nox -s {session.name} -- NAME_OR_TOML [options]")
    name = session.posargs[0]
    try:
        sweep = load(name)
    except PdError as e:
        _fail(session, str(e), e.exit_status)
    return name, sorted({e.config.connector for plat in sweep.platforms for e in sweep.entries(plat)})


@nox.session(python=PYTHON, reuse_venv=True, tags=["gpu", "nightly"])
def kimi_linear_nightly(session: nox.Session) -> None:
    """Kimi-Linear-48B-A3B over NIXL, prefill TP2 + decode DP2/EP on 4 GPUs (runs unpinned, said so).
    [-- same options as mooncake_sweep; --dry-run plans anywhere]"""
    _sweep(session, "kimi_linear_nightly", ["nixl"], extra=("--allow-unpinned-remote-code",))


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "gpu"])
def serve(session: nox.Session) -> None:
    """Hold one config up for your own tests until Ctrl-C: `nox -s serve -- SWEEP --only CONFIG`.
    [-- SWEEP --only CONFIG, then the options of mooncake_sweep except the checks']"""
    name, connectors = _named_sweep(session, "serve")
    _sweep(session, name, connectors, posargs=session.posargs[1:], command="serve")


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "gpu"])
def mooncake_imports(session: nox.Session) -> None:
    """Install the Mooncake environment (wheel variant per host) and run the import canary.
    [-- --dry-run --platform cpu|cuda --installed --no-install --find-links DIR]"""
    _imports(session, ["mooncake"])


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "gpu"])
def nixl_imports(session: nox.Session) -> None:
    """Install the NIXL environment (nixl + nixl-cuN per host) and run the import canary.
    [-- --dry-run --platform cpu|cuda --installed --no-install --find-links DIR]"""
    _imports(session, ["nixl"])


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "ci"])
def tests(session: nox.Session) -> None:
    """All tests, including the real CPU-lane end-to-end sweeps. [-- pytest arguments]"""
    target = Target(session)
    # gcc: the canary's tests build real ELF files (installed with the lane's Debian packages)
    _connectors(session, target, "cpu", ["mooncake", "nixl"], commands=dict(install.TEST_COMMANDS))
    if not target.installed:
        target.venv_install(
            "-r",
            str(ROOT / "requirements" / "test.txt"),
            "-r",
            str(ROOT / "requirements" / "buildkite.txt"),
            "-r",
            str(ROOT / "requirements" / "bench.txt"),
        )
    target.run("-m", "pytest", *target.rest, env={**(target.env or {}), "PD_SESSIONS_FULL_ENV": "1"})


@nox.session(python=PYTHON, reuse_venv=True, tags=["ci"])
def buildkite(session: nox.Session) -> None:
    """Render .buildkite/ (pipeline + vLLM test_areas) from pd_sessions/ci_jobs.py."""
    session.install("-e", str(ROOT), "-r", str(ROOT / "requirements" / "buildkite.txt"))
    session.run("python", "-m", "pd_sessions", "buildkite")


@nox.session(python=PYTHON, reuse_venv=True, tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff (rules and formatting), mypy (strict on the pure core) and import-linter (the layers
    contract), as configured in pyproject.toml."""
    session.install("-e", str(ROOT), "-r", str(ROOT / "requirements" / "lint.txt"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
    session.run("lint-imports", env={"PYTHONPATH": str(ROOT / "tools")})


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu"])
def unit(session: nox.Session) -> None:
    """Unit tests only: no vLLM, seconds. [-- pytest arguments]"""
    session.install(
        "-e",
        str(ROOT),
        "-r",
        str(ROOT / "requirements" / "test.txt"),
        "-r",
        str(ROOT / "requirements" / "buildkite.txt"),
        "-r",
        str(ROOT / "requirements" / "bench.txt"),
    )
    session.run("pytest", "-m", "not e2e", *session.posargs)


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "gpu"])
def bench(session: nox.Session) -> None:
    """Benchmark, not a test: harness overhead, readiness latency, parallel start, teardown,
    vllm-router vs a Python proxy, the upstream bash flow vs pd_sessions. Writes bench/.
    [-- --repeats N --parts router,teardown,clusters,checks,startup --sweep NAME_OR_TOML --only CONFIG
    --check-sweeps A,B --startup-session NAME --out DIR]"""
    target = Target(session)
    args = list(target.rest)
    name = args[args.index("--sweep") + 1] if "--sweep" in args[:-1] else "mooncake_sweep"
    # the checks part runs these sweeps too (bench/cli.py CHECK_SWEEPS): their connectors as well
    check_sweeps = (
        args[args.index("--check-sweeps") + 1].split(",")
        if "--check-sweeps" in args[:-1]
        else ["mooncake_sweep", "nixl_sweep"]
    )
    try:
        sweep = load(name)
        platform, _, _ = preflight(sweep, None, hosts.detect())
        sweeps = [sweep, *(load(n) for n in check_sweeps if n)]
    except PdError as e:
        _fail(session, str(e), e.exit_status)
    _connectors(
        session,
        target,
        platform,
        sorted({e.config.connector for s in sweeps for e in s.entries(platform)}),
        accuracy="--with-accuracy" in args,
    )
    if target.installed:
        lacking = [m for m in ("matplotlib", "aiohttp") if m not in target.facts()["installed"]]
        if lacking:
            _fail(
                session,
                f"the bench needs {', '.join(lacking)}: install them with "
                f"`{sys.executable} -m pip install -r {ROOT / 'requirements' / 'bench.txt'}`",
            )
    else:
        target.venv_install("-r", str(ROOT / "requirements" / "bench.txt"))
    target.run("-m", "pd_sessions", "bench", *args)


@nox.session(python=PYTHON, reuse_venv=True, tags=["gpu"])
def wheelhouse(session: nox.Session) -> None:
    """Wheels for an offline host (no index there): `nox -s wheelhouse -- --python 3.12 --cuda 13 --out DIR
    [--exclude-installed FREEZE_FILE]`; sessions then install with PD_SESSIONS_FIND_LINKS=DIR."""
    session.install("pip", "uv", "packaging")
    session.run("python", "-m", "pd_sessions", "wheelhouse", *session.posargs, env={"PYTHONPATH": str(ROOT)})
