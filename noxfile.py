"""nox sessions: thin wrappers; all logic lives in the pd_sessions package.

    nox -s mooncake_sweep [-- --platform cpu|cuda --only 1x1 --dry-run --results-dir DIR]
    nox -s tests        # unit + end-to-end (real vLLM on the CPU lane)
    nox -s unit         # unit tests only (no vLLM install)
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))

from pd_sessions import hosts, install  # noqa: E402
from pd_sessions.errors import PdError  # noqa: E402

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["unit"]
PYTHON = "3.11"


def _platform(session: nox.Session) -> str:
    """The platform the posargs ask for (or the host's), checked before any install."""
    args = list(session.posargs)
    requested = None
    if "--platform" in args and args.index("--platform") + 1 < len(args):
        requested = args[args.index("--platform") + 1]
    try:
        return hosts.resolve_platform(requested, hosts.detect())
    except PdError as e:
        session.error(str(e))


def _sweep(session: nox.Session, name: str) -> None:
    if "--dry-run" in session.posargs:  # plans need only the package itself
        session.install("-e", str(ROOT))
    else:
        try:
            install.install_lane(session, _platform(session), say=session.log)
        except PdError as e:
            session.error(str(e))
    session.run("python", "-m", "pd_sessions", "sweep", name, *session.posargs)


@nox.session(python=PYTHON)
def mooncake_sweep(session: nox.Session) -> None:
    """Mooncake P/D sweep (TP 1x1, 2x2): real clusters, all checks, results dir."""
    _sweep(session, "mooncake_sweep")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """All tests, including the real CPU-lane end-to-end sweeps."""
    try:
        install.install_lane(session, "cpu", say=session.log)
    except PdError as e:
        session.error(str(e))
    session.install("-r", str(ROOT / "requirements" / "test.txt"))
    session.run("pytest", *session.posargs, env={"PD_SESSIONS_FULL_ENV": "1"})


@nox.session(python=PYTHON)
def unit(session: nox.Session) -> None:
    """Unit tests only: no vLLM, seconds."""
    session.install("-e", str(ROOT), "-r", str(ROOT / "requirements" / "test.txt"))
    session.run("pytest", "-m", "not e2e", *session.posargs)
