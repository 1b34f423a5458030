"""nox sessions: thin wrappers; all logic lives in the pd_sessions package (pd_sessions/env/nox_support.py).

    nox -s mooncake_sweep [-- --platform cpu|cuda --only 1x1 --dry-run --results-dir DIR ...]
                        # one <connector>_sweep per connector (pd_sessions/core/connectors/)
    nox -s mooncake_imports / nixl_imports [-- --dry-run]   # install + import canary only
    nox -s serve -- mooncake_sweep --only 1x1   # hold one cluster up (URLs, env, curl) until Ctrl-C
    nox -s soak -- --cycles N   # the prefill and the decode restarted in place N times: leaks per cycle
    nox -s faults       # injected faults over both connectors (drop, stall, zero, swap, peer death, restart)
    nox -s recall       # every catalogued bug class injected and the recall table (docs/bug-catalogue.md)
    nox -s tests        # everything: unit, procs (processes, fake servers, Ray...) and end-to-end (real vLLM)
    nox -s unit         # the pure tier: no vLLM, no process spawned, no skip (under a minute on 2 cores)
    nox -s docs         # regenerate docs/reference/ from the code, build the docs site strictly
    nox -s bench        # measures (not a test): overhead, readiness, teardown, router, each check's cost,
                        # nox's second-run start-up; writes bench/

Installed-environment mode: `nox --no-venv -s mooncake_sweep` (or the posarg `--installed`)
runs on the current interpreter: vLLM, torch and the router are taken as found, only the
connector variant torch needs is swapped in place, a missing piece is an exit-2 error naming
the command that installs it. `--no-install` changes nothing at all. `--find-links DIR` (or
$PD_SESSIONS_FIND_LINKS) installs from that folder only, never from an index.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))

from pd_sessions.bench.bench_args import bench_parser  # noqa: E402
from pd_sessions.core import connectors  # noqa: E402
from pd_sessions.env import nox_support  # noqa: E402

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["unit"]
PYTHON = "3.11"


def _connector_sessions() -> None:
    """One sweep session per connector (``nox -s <connector>_sweep``: its spec's ``sweep``) and one
    imports session per connector package (``nox -s <package>_imports``), from the registry in
    pd_sessions/core/connectors/: adding a connector adds its sessions."""
    for spec in connectors.ALL:

        def run_sweep(session: nox.Session, name: str = spec.sweep) -> None:
            nox_support.sweep(session, name)

        run_sweep.__doc__ = (
            f"{spec.title} P/D sweep ({spec.vllm_class}; TP 1x1 on the CPU lane, more on GPUs): "
            "install + canary, then real clusters, all checks.\n    [-- --platform cpu|cuda --only NAME "
            "--dry-run --model ID --set F=V --extra-arg ARG --installed --no-install --find-links DIR; "
            "--help lists all]"
        )
        nox.session(run_sweep, name=spec.sweep, python=PYTHON, reuse_venv=True, tags=["cpu", "gpu", "ci"])
    for package in connectors.packages():

        def run_imports(session: nox.Session, name: str = package.name) -> None:
            nox_support.imports(session, [name])

        run_imports.__doc__ = (
            f"Install the {package.title} environment (wheel variant per host) and run the import canary."
            "\n    [-- --dry-run --platform cpu|cuda --installed --no-install --find-links DIR]"
        )
        nox.session(
            run_imports, name=f"{package.name}_imports", python=PYTHON, reuse_venv=True, tags=["cpu", "gpu"]
        )


_connector_sessions()


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "gpu"])
def faults(session: nox.Session) -> None:
    """Injected faults over Mooncake and NIXL, one cluster each: KV loads dropped, stalled, zeroed,
    swapped; a prefill killed mid-pull and restarted in place. [-- same options as mooncake_sweep]"""
    nox_support.sweep(session, "faults")


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu"])
def recall(session: nox.Session) -> None:
    """The recall table: every bug class of pd_sessions/configs/bug_catalogue.toml injected on the
    CPU lane over Mooncake and NIXL (faults, the faulty decode, the wire faults across two
    simulated hosts), caught or not; exit 1 below 100 %. [-- --no-hosts --out DIR; --results DIR...
    builds the table from earlier runs and runs nothing]"""
    nox_support.recall(session)


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "gpu"])
def soak(session: nox.Session) -> None:
    """Leaks across restarts over NIXL: the prefill and the decode restarted in place N times,
    parity and the KV digest after each, growth per cycle of fds, threads, RSS and KV blocks bounded
    (docs/soak.md). [-- --cycles N (default 3), then the options of nixl_sweep]"""
    nox_support.soak(session)


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "gpu"])
def sweep(session: nox.Session) -> None:
    """Any sweep: a built-in name or your own TOML file, with the connectors its configs use.
    [-- NAME_OR_TOML, then the options of a connector's sweep session]"""
    name = nox_support.named_sweep(session)
    nox_support.sweep(session, name, posargs=session.posargs[1:])


@nox.session(python=PYTHON, reuse_venv=True, tags=["gpu", "nightly"])
def kimi_linear_nightly(session: nox.Session) -> None:
    """Kimi-Linear-48B-A3B over NIXL, prefill TP2 + decode DP2/EP on 4 GPUs (runs unpinned, said so).
    [-- the options of a connector's sweep session; --dry-run plans anywhere]"""
    nox_support.sweep(session, "kimi_linear_nightly", extra=("--allow-unpinned-remote-code",))


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "gpu"])
def serve(session: nox.Session) -> None:
    """Hold one config up for your own tests until Ctrl-C: `nox -s serve -- SWEEP --only CONFIG`.
    [-- SWEEP --only CONFIG, then the options of a sweep session except the checks']"""
    name = nox_support.named_sweep(session)
    nox_support.sweep(session, name, posargs=session.posargs[1:], command="serve")


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "ci"])
def tests(session: nox.Session) -> None:
    """All tests, including the real CPU-lane end-to-end sweeps. [-- pytest arguments]"""
    nox_support.tests(session)


@nox.session(python=PYTHON, reuse_venv=True, tags=["ci"])
def buildkite(session: nox.Session) -> None:
    """Render .buildkite/ (pipeline + vLLM test_areas) from pd_sessions/report/buildkite_pipelines.py."""
    session.install("-e", str(ROOT), *nox_support.requirements("buildkite.txt"))
    session.run("python", "-m", "pd_sessions", "buildkite")


@nox.session(python=PYTHON, reuse_venv=True, tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff (rules and formatting), mypy (strict on the pure core) and import-linter (the layers
    contract), as configured in pyproject.toml; then the docs: the reference pages fresh and the
    site built strictly (as `nox -s docs`, which rewrites the pages instead)."""
    session.install("-e", str(ROOT), *nox_support.requirements("lint.txt"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
    session.run("lint-imports", env={"PYTHONPATH": str(ROOT / "tools")})
    nox_support.docs(session, check=True)


@nox.session(python=PYTHON, reuse_venv=True, tags=["ci"])
def docs(session: nox.Session) -> None:
    """The docs site: regenerate docs/reference/ from the code (tools/docs_reference.py), then
    `mkdocs build --strict` into site/ (a broken internal link or anchor fails)."""
    nox_support.docs(session, check=False)


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu"])
def unit(session: nox.Session) -> None:
    """The pure tier: no vLLM, no process spawned, no skip, under a minute. [-- pytest arguments]"""
    nox_support.unit(session)


@nox.session(python=PYTHON, reuse_venv=True, tags=["cpu", "gpu"])
def bench(session: nox.Session) -> None:
    """Benchmark, not a test: harness overhead, readiness latency, parallel start, teardown,
    vllm-router vs a Python proxy, the upstream bash flow vs pd_sessions. Writes bench/.
    [-- --repeats N --parts router,teardown,clusters,checks,startup,report --sweep NAME_OR_TOML --only CONFIG
    --check-sweeps A,B --startup-session NAME --out DIR]"""
    nox_support.bench(session, bench_parser(prog="nox -s bench --"))


@nox.session(python=PYTHON, reuse_venv=True, tags=["gpu"])
def wheelhouse(session: nox.Session) -> None:
    """Wheels for an offline host (no index there): `nox -s wheelhouse -- --python 3.12 --cuda 13 --out DIR
    [--exclude-installed FREEZE_FILE]`; sessions then install with PD_SESSIONS_FIND_LINKS=DIR."""
    session.install("pip", "uv", "packaging")
    session.run("python", "-m", "pd_sessions", "wheelhouse", *session.posargs, env={"PYTHONPATH": str(ROOT)})
