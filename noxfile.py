"""nox sessions: thin wrappers; all logic lives in the pd_sessions package.

    nox -s mooncake_sweep [-- --platform cpu|cuda --only 1x1 --dry-run --results-dir DIR]
    nox -s mooncake_imports / nixl_imports [-- --dry-run]   # install + import canary only
    nox -s serve -- mooncake_sweep --only 1x1   # hold one cluster up (URLs, env, curl) until Ctrl-C
    nox -s tests        # unit + end-to-end (real vLLM on the CPU lane)
    nox -s unit         # unit tests only (no vLLM install)
    nox -s bench        # measures (not a test): overhead, readiness, teardown, router; writes bench/
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))

from pd_sessions import hosts, install  # noqa: E402
from pd_sessions.config import builtin_sweep  # noqa: E402
from pd_sessions.errors import PdError  # noqa: E402
from pd_sessions.preflight import preflight  # noqa: E402

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["unit"]
PYTHON = "3.11"


def _platform(session: nox.Session, sweep: str | None = None) -> str:
    """The platform the posargs ask for (or the host's), checked before any install;
    for a sweep, also whether this host can run it at all."""
    args = list(session.posargs)
    requested = None
    if "--platform" in args and args.index("--platform") + 1 < len(args):
        requested = args[args.index("--platform") + 1]
    try:
        if sweep is None:
            return hosts.resolve_platform(requested, hosts.detect())
        platform, _, _ = preflight(builtin_sweep(sweep), requested, hosts.detect(),
                                   dry_run="--dry-run" in args)
        return platform
    except PdError as e:
        session.error(str(e))


def _connectors(session: nox.Session, platform: str, connectors: list[str]) -> None:
    """Install the lane, then the connector variants the venv's torch needs, then run
    the import canary (its own process). Stops the session on any failure."""
    try:
        install.install_lane(session, platform, say=session.log)
        doc = json.loads(session.run("python", "-m", "pd_sessions.install", "facts", silent=True))
        torch_platform, actions = install.plan_connectors(doc, connectors)
        session.log(f"torch {doc.get('torch')} is built for {torch_platform.describe()}: "
                    f"{len(actions)} connector action(s)")
        install.apply_actions(session, actions, torch_platform,
                              env=install.index_env(dict(os.environ)), say=session.log)
    except PdError as e:
        session.error(str(e))
    session.run("python", "-m", "pd_sessions.canary", *connectors)


def _dry_run_install(session: nox.Session, platform: str, connectors: list[str]) -> None:
    session.log(f"dry run: would install -r {install.lane_requirements(platform).relative_to(ROOT)} "
                f"and this package, then the connector variants for the torch that brings:")
    facts = {"cpu": {"cuda": None}, "cuda": None}[platform]
    cases = [facts] if facts is not None else [{"cuda": "12.8"}, {"cuda": "13.0"}]
    for doc in cases:
        plat, actions = install.plan_connectors(doc, connectors)
        session.log(f"  {plat.describe()}: " + "; ".join(map(str, actions)))
    session.log(f"  then: python -m pd_sessions.canary {' '.join(connectors)}")


def _sweep(session: nox.Session, name: str, connectors: list[str], extra: tuple[str, ...] = ()) -> None:
    platform = _platform(session, name)
    if "--dry-run" in session.posargs:  # plans need only the package itself
        _dry_run_install(session, platform, connectors)
        session.install("-e", str(ROOT))
    else:
        _connectors(session, platform, connectors)
    session.run("python", "-m", "pd_sessions", "sweep", name, *extra, *session.posargs)


def _imports(session: nox.Session, connectors: list[str]) -> None:
    platform = _platform(session)
    if "--dry-run" in session.posargs:
        _dry_run_install(session, platform, connectors)
        return
    _connectors(session, platform, connectors)


@nox.session(python=PYTHON)
def mooncake_sweep(session: nox.Session) -> None:
    """Mooncake P/D sweep (TP 1x1, 2x2): install + canary, then real clusters, all checks."""
    _sweep(session, "mooncake_sweep", ["mooncake"])


@nox.session(python=PYTHON)
def nixl_sweep(session: nox.Session) -> None:
    """NIXL P/D sweep (TP 1x1, 2x2): install + canary, then real clusters, all checks."""
    _sweep(session, "nixl_sweep", ["nixl"])


@nox.session(python=PYTHON)
def kimi_linear_nightly(session: nox.Session) -> None:
    """Kimi-Linear-48B-A3B over NIXL, prefill TP2 + decode DP2/EP on 4 GPUs (runs unpinned, said so)."""
    _sweep(session, "kimi_linear_nightly", ["nixl"], extra=("--allow-unpinned-remote-code",))


@nox.session(python=PYTHON)
def serve(session: nox.Session) -> None:
    """Hold one config up for your own tests: `nox -s serve -- mooncake_sweep --only 1x1` (Ctrl-C stops)."""
    if not session.posargs:
        session.error("usage: nox -s serve -- SWEEP --only CONFIG [sweep options]")
    platform = _platform(session, session.posargs[0])
    entries = builtin_sweep(session.posargs[0]).entries(platform)
    _connectors(session, platform, sorted({e.config.connector for e in entries}))
    session.run("python", "-m", "pd_sessions", "serve", *session.posargs)


@nox.session(python=PYTHON)
def mooncake_imports(session: nox.Session) -> None:
    """Install the Mooncake environment (wheel variant per host) and run the import canary."""
    _imports(session, ["mooncake"])


@nox.session(python=PYTHON)
def nixl_imports(session: nox.Session) -> None:
    """Install the NIXL environment (nixl + nixl-cuN per host) and run the import canary."""
    _imports(session, ["nixl"])


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """All tests, including the real CPU-lane end-to-end sweeps."""
    _connectors(session, "cpu", ["mooncake", "nixl"])
    session.install("-r", str(ROOT / "requirements" / "test.txt"),
                    "-r", str(ROOT / "requirements" / "buildkite.txt"),
                    "-r", str(ROOT / "requirements" / "bench.txt"))
    session.run("pytest", *session.posargs, env={"PD_SESSIONS_FULL_ENV": "1"})


@nox.session(python=PYTHON)
def buildkite(session: nox.Session) -> None:
    """Render .buildkite/ (pipeline + vLLM test_areas) from pd_sessions/ci_jobs.py."""
    session.install("-e", str(ROOT), "-r", str(ROOT / "requirements" / "buildkite.txt"))
    session.run("python", "-m", "pd_sessions.ci_jobs")


@nox.session(python=PYTHON)
def unit(session: nox.Session) -> None:
    """Unit tests only: no vLLM, seconds."""
    session.install("-e", str(ROOT), "-r", str(ROOT / "requirements" / "test.txt"),
                    "-r", str(ROOT / "requirements" / "buildkite.txt"),
                    "-r", str(ROOT / "requirements" / "bench.txt"))
    session.run("pytest", "-m", "not e2e", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmark, not a test: harness overhead, readiness latency, parallel start, teardown,
    vllm-router vs a Python proxy, the upstream bash flow vs pd_sessions. Writes bench/."""
    args = list(session.posargs)
    name = args[args.index("--sweep") + 1] if "--sweep" in args[:-1] else "mooncake_sweep"
    platform = _platform(session, name)
    _connectors(session, platform, sorted({e.config.connector
                                           for e in builtin_sweep(name).entries(platform)}))
    session.install("-r", str(ROOT / "requirements" / "bench.txt"))
    session.run("python", "-m", "pd_sessions.bench", *args)
