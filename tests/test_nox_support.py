"""The noxfile's helpers (pd_sessions.env.nox_support), driven by a fake nox session that records
what a session would install, run and log; nothing is installed or started here."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import ROOT
from packaging.requirements import Requirement

from pd_sessions import cli
from pd_sessions.bench.bench_args import bench_parser
from pd_sessions.core.errors import PlanError
from pd_sessions.core.inventory import Inventory
from pd_sessions.env import in_place, nox_support
from pd_sessions.run import launch
from pd_sessions.runtime import machine, parentwatch

CPU_HOST = Inventory(gpus=(), cpus=(0, 1), gpu_source="test")
RDMA_HOST = Inventory(gpus=("0", "1"), cpus=(0, 1), gpu_source="test", rdma_devices=("mlx5_0",))
HERE = {"location": "/x", "dist": "d", "version": "1", "editable": None}


def facts(*, cuda: str | None = None, missing: tuple[str, ...] = (), more: dict | None = None) -> dict:
    """An envfacts document: everything a CPU-lane run needs, less ``missing`` modules."""
    harness = {Requirement(r).name: "1" for r in in_place.harness_requirements()}
    return {
        "python": {"executable": "/env/bin/python", "version": "3.11.9"},
        "torch": {"version": "2.13.0", "cuda": cuda, "hip": None, "location": "/t", "build_known": True},
        "modules": {
            m: (None if m in missing else HERE)
            for m in ("vllm", "vllm_router", "mooncake", "nixl", "lm_eval", "pd_sessions")
        },
        "installed": {
            "pip": "24",
            **harness,
            "mooncake-transfer-engine-non-cuda": "0.3.13",
            "nixl": "1.5.1",
            "nixl-cu12": "1.5.1",
            **(more or {}),
        },
    }


class FakeSession:
    """What nox_support uses of nox.Session; `run` of envfacts writes ``doc`` as its --out."""

    def __init__(self, posargs=(), *, name="mooncake_sweep", venv_backend="uv", doc=None, no_install=False):
        self.name = name
        self.posargs = list(posargs)
        self.venv_backend = venv_backend
        self.doc = doc if doc is not None else facts()
        self.calls: list[tuple[str, tuple, dict]] = []
        self._runner = SimpleNamespace(global_config=SimpleNamespace(no_install=no_install))

    def log(self, *args: Any, **kw: Any) -> None:
        self.calls.append(("log", args, kw))

    def install(self, *args: str, **kw: Any) -> None:
        self.calls.append(("install", args, kw))

    def run_install(self, *args: str, **kw: Any) -> None:
        self.calls.append(("run_install", args, kw))

    def run(self, *args: str, **kw: Any) -> None:
        self.calls.append(("run", args, kw))
        if "pd_sessions.env.envfacts" in args:
            Path(args[args.index("--out") + 1]).write_text(json.dumps(self.doc))

    def of(self, kind: str) -> list[tuple[tuple, dict]]:
        return [(a, kw) for k, a, kw in self.calls if k == kind]

    @property
    def logged(self) -> str:
        return "\n".join(" ".join(map(str, a)) for a, _ in self.of("log"))

    def ran(self, *needle: str) -> list[tuple[tuple, dict]]:
        """The runs whose argv holds ``needle`` as consecutive items."""
        n = len(needle)
        return [(a, kw) for a, kw in self.of("run") if any(a[i : i + n] == needle for i in range(len(a)))]


@pytest.fixture(autouse=True)
def cpu_host(monkeypatch):
    """A CPU-only host, whatever this machine has (a test may set another)."""
    monkeypatch.setattr(machine, "detect", lambda: CPU_HOST)


def stopped(call, *args, **kw) -> int:
    with pytest.raises(SystemExit) as e:
        call(*args, **kw)
    return e.value.code


# ------------------------------------------------------------------ Target


def test_target_is_the_venv_or_the_installed_interpreter():
    venv = nox_support.Target(FakeSession(["--only", "1x1"]))
    assert not venv.installed and venv.python == "python" and venv.env is None
    assert venv.rest == ["--only", "1x1"]
    for session in (FakeSession(venv_backend="none"), FakeSession(["--installed"])):
        target = nox_support.Target(session)
        assert target.installed and target.python == sys.executable
        assert target.env is not None and target.env["PYTHONPATH"].split(":")[0] == str(ROOT)
    # the install options are the session's, in any place; the rest keeps its order
    t = nox_support.Target(FakeSession(["--only", "a", "--no-install", "--dry-run"]))
    assert t.no_install and t.rest == ["--only", "a", "--dry-run"]
    assert nox_support.Target(FakeSession(no_install=True)).no_install  # nox's own -R


def test_a_bad_find_links_folder_stops_the_session_with_2(tmp_path):
    session = FakeSession(["--find-links", str(tmp_path)])
    assert stopped(nox_support.Target, session) == 2
    assert f"--find-links {tmp_path}: not a folder of wheels" in session.logged
    (tmp_path / "a-1-py3-none-any.whl").write_bytes(b"")
    target = nox_support.Target(FakeSession(["--find-links", str(tmp_path)]))
    target.venv_install("x")
    assert target.session.of("install") == [
        (("--no-index", "--find-links", str(tmp_path), "x"), {"env": None})
    ]


# ------------------------------------------------------------------ one validation (the CLI's)

DEVICE = ["--only", "1x1", "--platform", "cuda", "--set", "mooncake_protocol=rdma"]


def test_the_device_name_reaches_the_overrides_on_both_paths(monkeypatch):
    """nox's check used to build the overrides without mooncake_device_name: a device that this
    host lacks was refused by the CLI only, after nox had installed everything."""
    monkeypatch.setattr(machine, "detect", lambda: RDMA_HOST)
    posargs = [*DEVICE, "--mooncake-device-name", "mlx5_9"]
    with pytest.raises(PlanError) as e:
        launch.checked(cli._parser().parse_args(["sweep", "mooncake_sweep", *posargs]))
    assert e.value.field == "mooncake_device_name" and "mooncake_device_name names mlx5_9" in str(e.value)
    session = FakeSession(posargs)
    assert stopped(nox_support.sweep, session, "mooncake_sweep") == 2
    assert f"pd-sessions: error: {e.value}" in session.logged
    assert session.of("install") == [] and session.of("run") == []  # refused before anything
    # the device this host has: both accept, with the same overrides
    posargs = [*DEVICE, "--mooncake-device-name", "mlx5_0", "--dry-run"]
    sel = launch.checked(cli._parser().parse_args(["sweep", "mooncake_sweep", *posargs]))
    assert "mooncake_device_name = 'mlx5_0'" in sel.over.describe()
    session = FakeSession(posargs)
    nox_support.sweep(session, "mooncake_sweep")
    (argv, _), *_ = session.ran("pd_sessions", "sweep")
    assert argv[-3:] == ("--mooncake-device-name", "mlx5_0", "--dry-run")  # handed on as given


def test_bad_posargs_stop_the_session_before_any_install():
    session = FakeSession(["--set", "blok_size=16"])
    assert stopped(nox_support.sweep, session, "mooncake_sweep") == 2
    assert 'did you mean "block_size"' in session.logged
    assert session.of("install") == [] and session.of("run") == []
    session = FakeSession(["--set", "blok_size=16"], name="mooncake_imports")
    assert stopped(nox_support.imports, session, ["mooncake"]) == 2  # also without a sweep
    assert 'did you mean "block_size"' in session.logged
    session = FakeSession(["--only", "3x3"])
    assert stopped(nox_support.sweep, session, "mooncake_sweep") == 2
    assert "--only: no config named '3x3'" in session.logged and session.of("install") == []


# ------------------------------------------------------------------ the sweep sessions


def test_help_prints_the_sessions_options_and_does_nothing(capsys):
    session = FakeSession(["--help"])
    nox_support.sweep(session, "mooncake_sweep")
    out = capsys.readouterr().out
    assert out.startswith("usage: nox -s mooncake_sweep --") and "--skip-check" in out
    assert session.calls == []
    nox_support.sweep(FakeSession(["-h"], name="serve"), "s", command="serve")
    out = capsys.readouterr().out
    assert "start one config and hold it up" in out and "--skip-check" not in out


def test_a_dry_run_in_a_venv_installs_only_the_package_then_plans():
    session = FakeSession(["--dry-run", "--only", "1x1", "--grace", "3"])
    nox_support.sweep(session, "mooncake_sweep")
    assert "dry run: would install -r requirements/cpu.txt and this package" in session.logged
    assert "  CPU: install mooncake-transfer-engine-non-cuda" in session.logged
    assert "  then: python -m pd_sessions.env.import_canary mooncake" in session.logged
    assert session.of("install") == [(("-e", str(ROOT)), {"env": None})]
    ((argv, kw),) = session.of("run")
    assert argv == (
        *("python", "-m", "pd_sessions", "sweep", "mooncake_sweep"),
        *("--dry-run", "--only", "1x1", "--grace", "3"),
    )
    assert kw == {"external": False, "env": None, "interrupt_timeout": 3.0 + 5.0 + 5.0}


class SignalledSession(FakeSession):
    """A session during whose run of the harness nox gets ``sig``; then the harness ends with
    ``harness_status``: non-zero, nox's popen re-raises the KeyboardInterrupt once it has waited;
    0 (``serve`` stopped), it returns."""

    def __init__(self, posargs, sig: int, harness_status: int, **kw: Any):
        super().__init__(posargs, **kw)
        self.sig, self.harness_status = sig, harness_status

    def run(self, *args: str, **kw: Any) -> None:
        super().run(*args, **kw)
        if "pd_sessions" in args:
            try:
                signal.raise_signal(self.sig)
            except KeyboardInterrupt:  # what nox's popen does after its wait
                if self.harness_status != 0:
                    raise


@pytest.fixture
def nox_handlers(monkeypatch):
    """nox's handlers as they are without the helpers: SIGTERM/SIGHUP end it at once (here an
    AssertionError, not this test process's death); put back after the test. No child of this
    test process is signalled."""

    def dies(signum, frame):
        raise AssertionError(f"nox died of {signal.Signals(signum).name} while the harness ran")

    monkeypatch.setattr(parentwatch, "child_pids", lambda pid=None: [])
    saved = {s: signal.signal(s, dies) for s in parentwatch.NOX_STOP_SIGNALS}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.mark.parametrize(
    "posargs,kw,sig,harness_status",
    [
        (["--dry-run"], {}, signal.SIGTERM, 143),  # a venv
        (["--no-install", "--skip-check", "accuracy"], {"venv_backend": "none"}, signal.SIGHUP, 129),
        (["--only", "1x1", "--dry-run"], {"name": "serve"}, signal.SIGTERM, 0),  # serve's normal end
    ],
    ids=["venv-SIGTERM", "installed-SIGHUP", "serve-SIGTERM"],
)
@pytest.mark.usefixtures("nox_handlers")
def test_a_stop_signal_while_the_harness_runs_ends_the_session_with_its_status(
    posargs, kw, sig, harness_status
):
    command = "serve" if kw.get("name") == "serve" else "sweep"
    session = SignalledSession(posargs, sig, harness_status, **kw)
    assert stopped(nox_support.sweep, session, "mooncake_sweep", command=command) == 128 + sig
    assert session.ran("-m", "pd_sessions", command)
    assert f"nox got {signal.Signals(sig).name} (no child left) and waited" in session.logged
    assert f"nox exits {128 + sig}" in session.logged


def test_a_dry_run_on_cuda_shows_the_connectors_for_cuda_12_and_13():
    session = FakeSession()
    nox_support.dry_run_install(session, nox_support.Target(session), "cuda", ["mooncake", "nixl"])
    log = session.logged
    assert "dry run: would install -r requirements/cuda.txt" in log
    assert "  CUDA 12: install mooncake-transfer-engine>=" in log and "install nixl-cu12==" in log
    assert "  CUDA 13: install mooncake-transfer-engine-cuda13>=" in log and "install nixl-cu13==" in log
    session = FakeSession(venv_backend="none")
    nox_support.dry_run_install(session, nox_support.Target(session), "cuda", ["mooncake"])
    assert session.logged == "dry run on the installed environment: nothing is installed"


def test_the_installed_environment_lacking_a_piece_is_an_exit_2_naming_it():
    session = FakeSession(venv_backend="none", doc=facts(missing=("vllm_router",)))
    assert stopped(nox_support.sweep, session, "mooncake_sweep") == 2
    assert "lacks what this session needs" in session.logged
    assert "the router: vllm-router==" in session.logged and "vLLM:" not in session.logged
    assert session.ran("pd_sessions.env.import_canary") == [] and session.ran("pd_sessions", "sweep") == []


def test_the_installed_environment_with_no_install_changes_nothing_then_runs():
    session = FakeSession(["--no-install", "--skip-check", "accuracy"], venv_backend="none")
    nox_support.sweep(session, "mooncake_sweep")
    assert "environment: Python 3.11.9 at /env/bin/python" in session.logged
    assert "--no-install: changing nothing; nothing to change" in session.logged
    assert session.of("install") == []
    envfacts, canary, run = (a for a, _ in session.of("run"))
    assert envfacts[:3] == (sys.executable, "-m", "pd_sessions.env.envfacts")
    assert canary == (sys.executable, "-m", "pd_sessions.env.import_canary", "mooncake")
    assert run == (sys.executable, "-m", "pd_sessions", "sweep", "mooncake_sweep", "--skip-check", "accuracy")
    assert all(kw["external"] for _, kw in session.of("run"))


def test_the_installed_environment_swaps_the_connector_torch_needs():
    doc = facts(cuda="12.8", more={"uv": "0.5"})
    session = FakeSession(["--platform", "cpu"], venv_backend="none", doc=doc)
    nox_support.connectors(session, nox_support.Target(session), "cpu", ["mooncake"])
    assert "installed environment: 2 change(s) for torch built for CUDA 12" in session.logged
    pip = ("/env/bin/python", "-m", "pip")
    assert [a for a, _ in session.of("run")][1:] == [
        (*pip, "uninstall", "-y", "mooncake-transfer-engine-non-cuda"),
        (*pip, "install", "mooncake-transfer-engine==0.3.13"),
        (sys.executable, "-m", "pd_sessions.env.import_canary", "mooncake"),
    ]


def test_a_venv_gets_the_lane_then_the_connector_variants_for_its_torch():
    session = FakeSession(doc=facts(cuda="13.0"))
    nox_support.connectors(session, nox_support.Target(session), "cuda", ["nixl"])
    installs = [a for a, _ in session.of("install")]
    assert installs[:2] == [("-r", str(ROOT / "requirements" / "cuda.txt")), ("-e", str(ROOT))]
    assert ("--no-deps", "nixl-cu13==1.5.1") in installs
    assert "torch 2.13.0 is built for CUDA 13: " in session.logged
    assert session.ran("python", "-m", "pd_sessions.env.import_canary", "nixl")


def test_the_generic_sessions_take_the_sweep_first(tmp_path):
    session = FakeSession([], name="sweep")
    assert stopped(nox_support.named_sweep, session) == 2
    assert "name the sweep first: nox -s sweep -- NAME_OR_TOML [options]" in session.logged
    assert stopped(nox_support.named_sweep, FakeSession(["--only", "1x1"], name="sweep")) == 2
    toml = tmp_path / "mine.toml"
    toml.write_text('name = "mine"\n[defaults]\nmodel = "m"\nconnector = "nixl"\n[[config]]\nname = "1x1"\n')
    assert nox_support.named_sweep(FakeSession([str(toml), "--dry-run"])) == str(toml)
    assert nox_support.sweep_connectors(FakeSession(), str(toml)) == ["nixl"]
    assert nox_support.sweep_connectors(FakeSession(), "mooncake_sweep") == ["mooncake"]
    assert nox_support.sweep_connectors(FakeSession(), "nixl_push_sweep") == ["nixl_push"]
    session = FakeSession()
    assert stopped(nox_support.sweep_connectors, session, "no_such_sweep") == 2
    assert "no sweep named 'no_such_sweep'" in session.logged


def test_the_imports_sessions_dry_run_installs_nothing_and_runs_no_canary():
    session = FakeSession(["--dry-run"], name="nixl_imports")
    nox_support.imports(session, ["nixl"])
    assert "then: python -m pd_sessions.env.import_canary nixl" in session.logged
    assert session.of("install") == [] and session.of("run") == []


# ------------------------------------------------------------------ tests and bench


def test_the_unit_session_runs_the_pure_tier_where_a_skip_fails():
    session = FakeSession(["-x", "tests/test_cli.py"], name="unit")
    nox_support.unit(session)
    ((args, _),) = session.of("install")
    assert args[:2] == ("-e", str(ROOT)) and "test.txt" in args[3] and "ray.txt" not in str(args)
    ((argv, kw),) = session.of("run")
    assert argv == ("pytest", "-m", "not e2e and not multihost and not procs", "-x", "tests/test_cli.py")
    assert kw["env"] == {"PD_SESSIONS_UNIT_TIER": "1"}


def test_the_tests_session_runs_pytest_in_the_full_environment(monkeypatch):
    seen = []
    monkeypatch.setattr(nox_support, "connectors", lambda s, t, p, names, **kw: seen.append((p, names)))
    session = FakeSession(["-x", "tests/test_cli.py"], name="tests")
    nox_support.tests(session)
    assert seen == [("cpu", ["mooncake", "nixl"])]
    ((args, _),) = session.of("install")
    assert [a for a in args if a != "-r"] == [
        str(ROOT / "requirements" / n) for n in ("test.txt", "buildkite.txt", "bench.txt", "ray.txt")
    ]
    ((argv, kw),) = session.of("run")
    assert argv == ("python", "-m", "pytest", "-x", "tests/test_cli.py")
    assert kw["env"] == {"PD_SESSIONS_FULL_ENV": "1"}


def test_the_bench_session_parses_its_options_with_the_bench_parser(tmp_path, monkeypatch):
    toml = tmp_path / "mine.toml"
    toml.write_text('name = "mine"\n[defaults]\nmodel = "m"\nconnector = "nixl"\n[[config]]\nname = "1x1"\n')
    posargs = [f"--sweep={toml}", "--check-sweeps=", "--repeats", "1", "--no-install"]
    session = FakeSession(
        posargs, name="bench", venv_backend="none", doc=facts(more={"matplotlib": "3", "aiohttp": "3"})
    )
    nox_support.bench(session, bench_parser(prog="nox -s bench --"))
    assert session.ran(
        sys.executable, "-m", "pd_sessions.env.import_canary", "nixl"
    )  # --sweep=X: its connector only
    assert session.ran("pd_sessions", "bench", f"--sweep={toml}", "--check-sweeps=", "--repeats", "1")
    # the default: mooncake_sweep, and the check sweeps' connectors too
    session = FakeSession([], name="bench")
    seen = []
    monkeypatch.setattr(nox_support, "connectors", lambda s, t, p, names, **kw: seen.append((names, kw)))
    nox_support.bench(session, bench_parser(prog="nox -s bench --"))
    assert seen == [(["mooncake", "nixl"], {"accuracy": False})]
    assert session.of("install") == [(("-r", str(ROOT / "requirements" / "bench.txt")), {"env": None})]


def test_the_bench_session_refuses_a_bad_option_before_installing(capsys):
    session = FakeSession(["--sweep=mooncake_swep"], name="bench")
    assert stopped(nox_support.bench, session, bench_parser(prog="nox -s bench --")) == 2
    assert 'did you mean "mooncake_sweep"' in session.logged and session.calls[1:] == []
    session = FakeSession(["--bogus"], name="bench")
    assert stopped(nox_support.bench, session, bench_parser(prog="nox -s bench --")) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err and session.calls == []


def test_the_installed_bench_needs_its_plotting_and_proxy_packages():
    session = FakeSession(
        ["--no-install"], name="bench", venv_backend="none", doc=facts(more={"aiohttp": "3"})
    )
    assert stopped(nox_support.bench, session, bench_parser()) == 2
    assert "the bench needs matplotlib: install them with" in session.logged
    assert session.ran("pd_sessions", "bench") == []


# ------------------------------------------------------------------ the recall session


def test_the_recall_session_reading_earlier_results_installs_only_the_package(tmp_path):
    session = FakeSession(["--results", str(tmp_path)], name="recall")
    nox_support.recall(session)
    assert session.of("install") == [(("-e", str(ROOT)), {"env": None})]
    (argv, _), *_ = session.ran("pd_sessions", "recall")
    assert argv[-2:] == ("--results", str(tmp_path))


def test_the_recall_session_installs_both_connectors_and_ray_then_runs_every_injection():
    session = FakeSession([], name="recall")
    nox_support.recall(session)
    installed = " ".join(" ".join(a) for a, _ in session.of("install"))
    assert "ray.txt" in installed
    assert session.ran("pd_sessions.env.import_canary", "mooncake", "nixl")
    assert session.ran("-m", "pd_sessions", "recall")
    session = FakeSession(["--no-hosts"], name="recall")
    nox_support.recall(session)
    assert "ray.txt" not in " ".join(" ".join(a) for a, _ in session.of("install"))
