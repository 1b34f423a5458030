from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
USER = FIXTURES / "user_tests"
T = TypeVar("T")


def nox_no_venv(python: str | Path, *posargs: str, session: str = "mooncake_sweep") -> list[str]:
    """argv of `nox --no-venv -s SESSION -- --platform cpu POSARGS` run by ``python`` (default
    mooncake_sweep): the installed-environment mode on that interpreter."""
    return [
        str(python),
        "-m",
        "nox",
        "-f",
        str(ROOT / "noxfile.py"),
        "--no-venv",
        "-s",
        session,
        "--",
        "--platform",
        "cpu",
        *posargs,
    ]


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    what: str | Callable[[], str],
    *,
    proc: subprocess.Popen | None = None,
    tick: float = 0.02,
) -> T:
    """Call ``predicate`` every ``tick`` seconds until it returns something true, and return that.

    Fails with ``waited TIMEOUT s for WHAT`` once ``timeout`` seconds have passed, or at once
    when ``proc`` (a process the awaited thing depends on) has exited. ``what`` names what was
    awaited; a callable is called at the failure (to add, say, a log written meanwhile).
    """
    end = time.monotonic() + timeout
    while not (got := predicate()):
        rc = None if proc is None else proc.poll()
        if rc is not None or time.monotonic() >= end:
            said = what() if callable(what) else what
            if rc is not None:
                raise AssertionError(f"gave up waiting for {said}: pid {proc.pid} exited with status {rc}")
            raise AssertionError(f"waited {timeout:g} s for {said}")
        time.sleep(tick)
    return got


def wait_for_text(path: Path, text: str, timeout: float = 15.0) -> None:
    """Until ``text`` appears in the file at ``path`` (a process's log); fails at ``timeout``."""
    wait_until(lambda: path.exists() and text in path.read_text(), timeout, f"{text!r} to appear in {path}")


def heavy(module: str):
    """Import a heavy dependency (torch, vllm...). In the full environment that
    `nox -s tests` builds (PD_SESSIONS_FULL_ENV=1) a missing one is an error, never a skip;
    elsewhere (`nox -s unit`) the test is skipped with the reason printed."""
    if os.environ.get("PD_SESSIONS_FULL_ENV") == "1":
        return __import__(module)
    return pytest.importorskip(module, reason=f"{module} not installed (run `nox -s tests`)")


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture(scope="module")
def bystander():
    """Someone else's server: 'vllm' in its command line, not started by us (no spawn(), no run
    of ours); whatever the module's tests stop, it must survive them."""
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(3600)", "vllm serve --port 1"], start_new_session=True
    )
    yield p
    assert p.poll() is None, "the bystander was killed"
    p.kill()
    p.wait()


# --- end to end: running the harness on real vLLM ---------------------------------------------


def plan_ports(run_dir: Path) -> dict[str, int]:
    """name -> HTTP port, read from the plan the harness wrote before launching."""
    text = (run_dir / "plan.txt").read_text()
    return {
        m.group(1): int(m.group(2)) for m in re.finditer(r"^  (\S+): http://127\.0\.0\.1:(\d+)", text, re.M)
    }


def processes_using(ports: dict[str, int]) -> list[str]:
    """Processes still serving or started for any of ``ports`` (by argv or a listening socket)."""
    import psutil

    wanted = {str(p) for p in ports.values()}
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        argv = p.info["cmdline"] or []
        for i, a in enumerate(argv[:-1]):
            if a == "--port" and argv[i + 1] in wanted:
                found.append(f"pid {p.pid}: {' '.join(argv)[:120]}")
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.laddr and str(c.laddr.port) in wanted:
            found.append(f"pid {c.pid} listens on {c.laddr.port}")
    return found


class Cli:
    """The CLI (or ``argv``) in a subprocess, with each output line timestamped as it arrives
    (``time.time()``: comparable with the times the fake servers print)."""

    def __init__(
        self,
        *args: str,
        argv: list[str] | None = None,
        cwd: Path = ROOT,
        env: dict[str, str] | None = None,
        new_session: bool = False,
    ):
        """``new_session``: the process leads a group of its own (signalled as one)."""
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            argv or [sys.executable, "-m", "pd_sessions", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=new_session,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            print(line, end="", flush=True)  # shown by pytest -s, or when a test fails

    def wait(self, timeout: float = 120) -> int:
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(10)
        return rc

    def first(self, needle: str) -> float:
        """When the first line with ``needle`` arrived."""
        return next(t for t, line in self.lines if needle in line)

    def wait_for(self, needle: str, timeout: float = 60) -> None:
        """Until a line with ``needle`` arrives; fails at ``timeout`` or when the process exits first."""
        wait_until(
            lambda: any(needle in line for _, line in self.lines),
            timeout,
            lambda: f"{needle!r} in the output:\n{self.text}",
            proc=self.proc,
        )

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def environment_facts(tmp_path: Path) -> dict:
    out = tmp_path / "facts.json"
    subprocess.run(
        [sys.executable, "-m", "pd_sessions.env.envfacts", "--out", str(out)], check=True, cwd=ROOT
    )
    return json.loads(out.read_text())


@dataclass
class SweepRun:
    """One finished sweep of one config ("1x1") that several tests assert on: each e2e test
    that only reads a sweep's results shares the run (and its cluster) with the others."""

    rc: int
    cli: Cli
    results: Path
    extra: dict[str, Any]  # what the run's fixture measured around it (e.g. installed packages)

    @property
    def run_dir(self) -> Path:
        return self.results / "1x1"

    @property
    def result(self) -> dict:
        return json.loads((self.run_dir / "result.json").read_text())

    @property
    def checks(self) -> dict[str, dict]:
        return {c["name"]: c for c in self.result["checks"]}

    @property
    def summary(self) -> dict:
        return json.loads((self.results / "summary.json").read_text())

    @property
    def text(self) -> str:
        return self.cli.text


def e2e_dir(tmp_path_factory, name: str) -> Path:
    """A new folder for one shared end-to-end run: below $PD_SESSIONS_E2E_RESULTS when set (CI
    uploads it: the runs' report.html, its browser screenshot and the logs), else a pytest tmp dir."""
    root = os.environ.get("PD_SESSIONS_E2E_RESULTS")
    if not root:
        return tmp_path_factory.mktemp(name)
    Path(root).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root)).resolve()


def tmp_leftovers() -> set[str]:
    """What vLLM leaves in the system's temporary folder when it runs with the harness's TMPDIR
    (its ZeroMQ IPC sockets, ``vllm_dist_*`` rendezvous files), and the cluster processes' own
    private folders (process.TMP_PREFIX): each cluster process has such a folder as its TMPDIR,
    removed once it is verified gone, so a run must add none of these."""
    from pd_sessions.runtime.process import TMP_PREFIX

    out = set()
    with os.scandir(tempfile.gettempdir()) as entries:
        for e in entries:
            with contextlib.suppress(OSError):
                if e.name.startswith(("vllm_dist_", TMP_PREFIX)) or stat.S_ISSOCK(e.stat().st_mode):
                    out.add(e.name)
    return out


def _sweep_once(results: Path, *, argv: list[str] | None = None, args: tuple[str, ...] = ()) -> SweepRun:
    """One shared run; ``extra["tmp_left"]``: what it left in the system's temporary folder."""
    before = tmp_leftovers()
    cli = Cli(*args, argv=argv)
    rc = cli.wait(timeout=1400)
    return SweepRun(rc=rc, cli=cli, results=results, extra={"tmp_left": sorted(tmp_leftovers() - before)})


# The fault scenarios each shared run adds after the default checks (test_e2e_faults asserts on
# them): over both connectors the four that keep their promise every time on this stack (drop,
# zero, swap, stall then abort); over NIXL also the two that kill a prefill (peer death, restart
# in place: about 30 s; PD_SESSIONS_E2E_KILLS=0 leaves them out). Over Mooncake those two break
# the promise upstream (a pull from a dead or restarted prefill hangs: `nox -s faults` shows it).
# Over NIXL the SIGKILLed prefill's worker used to stay in the kernel's exit path (exit_mmap,
# runnable) for over 30 s in about 1 run of 4 on this 2-core host; not seen in 13 runs since the
# worker runs in the engine core and stays on its instance's core (docs/failure-modes.md, row 34).
MOONCAKE_FAULTS = "fault_drop,fault_zero,fault_swap,fault_stall_abort"
E2E_KILLS = os.environ.get("PD_SESSIONS_E2E_KILLS", "1") != "0"
NIXL_FAULTS = "faults" if E2E_KILLS else MOONCAKE_FAULTS


@pytest.fixture(scope="session")
def mooncake_sweep(tmp_path_factory) -> SweepRun:
    """The built-in Mooncake sweep's 1x1, every default check and the fault scenarios of
    MOONCAKE_FAULTS (the connectors wrapped by the fault injector), through `nox --no-venv` on
    this (hand-prepared) environment as vLLM's CI runs it, with the user's passing test files
    (`--pytest`: an env-style file and a pd_cluster-fixture file) against its cluster, after the
    faults. Shared by test_e2e_cpu_lane (all checks pass, nothing installed, nothing
    left), test_e2e_user_commands (the user's files pass against the sweep's cluster) and
    test_e2e_faults (every scenario keeps its promise)."""
    heavy("vllm")
    heavy("mooncake.engine")
    heavy("openai")
    tmp = e2e_dir(tmp_path_factory, "mooncake_nox")
    results = tmp / "r"
    before = environment_facts(tmp)["installed"]
    run = _sweep_once(
        results,
        argv=nox_no_venv(
            sys.executable,
            "--only",
            "1x1",
            "--results-dir",
            str(results),
            "--check",
            MOONCAKE_FAULTS,
            "--pytest",
            str(USER / "pd_parity_env.py"),
            str(USER / "pd_parity_fixture.py"),
        ),
    )
    run.extra.update(installed_before=before, installed_after=environment_facts(tmp)["installed"])
    return run


@pytest.fixture(scope="session")
def nixl_sweep(tmp_path_factory) -> SweepRun:
    """The built-in NIXL sweep's 1x1, every default check, the perf check (opt-in on the CPU
    lane; CI runs it once, here) and the fault scenarios of NIXL_FAULTS, through the CLI, serving
    the remote-code tiny model (trust_remote_code: vLLM and lm_eval load its own classes) with
    margin-mode parity forced (auto would pick exact on the CPU lane; exact parity on a healthy
    pair is the Mooncake sweep's) and kv_load_failure_policy "recompute" (the Mooncake run keeps
    vLLM's default, "fail": the drop scenario sees both). Shared by test_e2e_cpu_lane (all checks
    pass, nothing left), test_e2e_nightly (remote code, margin parity passes on a healthy pair,
    NIXL evidence), test_e2e_perf (its figures) and test_e2e_faults."""
    heavy("vllm")
    heavy("nixl._api")
    results = e2e_dir(tmp_path_factory, "nixl") / "r"
    return _sweep_once(
        results,
        args=(
            "sweep",
            "nixl_sweep",
            "--only",
            "1x1",
            "--platform",
            "cpu",
            "--model",
            "tiny-llama-remote",
            "--set",
            "trust_remote_code=true",
            "--set",
            "parity_mode=margin",
            "--set",
            "kv_load_failure_policy=recompute",
            "--check",
            "perf",
            "--check",
            NIXL_FAULTS,
            "--results-dir",
            str(results),
        ),
    )


@pytest.fixture(scope="session")
def nixl_push_sweep(tmp_path_factory) -> SweepRun:
    """The NIXL push sweep's 1x1 (NixlPushConnector: the third connector, one module,
    pd_sessions/core/connectors/nixl_push.py) through the session the noxfile makes from its spec
    (`nox --no-venv -s nixl_push_sweep`): refused on the CPU lane before launch (seconds, nothing
    started; docs/cpu-lane.md says why)."""
    heavy("vllm")
    heavy("nixl._api")
    results = tmp_path_factory.mktemp("nixl_push") / "r"
    argv = nox_no_venv(
        sys.executable, "--only", "1x1", "--results-dir", str(results), session="nixl_push_sweep"
    )
    return _sweep_once(results, argv=argv)


@pytest.fixture(scope="session")
def preemption_sweep(tmp_path_factory) -> SweepRun:
    """The built-in preemption sweep's 1x1 (Mooncake): a decode with 8 KV blocks of 32 tokens
    under a burst that needs about 24, checks smoke and preemption (issue 27)."""
    heavy("vllm")
    heavy("mooncake.engine")
    results = e2e_dir(tmp_path_factory, "preemption") / "r"
    return _sweep_once(
        results, args=("sweep", "preemption", "--platform", "cpu", "--results-dir", str(results))
    )


# Fault injection, one cluster for four must-fail facts: the decode instance is started WITHOUT
# --kv-transfer-config (so it silently recomputes every prompt) and serves a tiny model with
# other weights (seed 1); margin-mode parity is forced (on the CPU lane prefill and decode share
# one layout, so auto would pick exact). What fails, each check for its own reason:
# kv_transfer (no KV received), parity (the decode's tokens are another model's), accuracy
# (lm_eval through the router = the seed-1 model vs prefill-0 direct), and the user's failing
# --exec (its message must reach our JUnit). Smoke still passes: the router answers.
FAULTY_SWEEP = """name = "faulty"
checks = ["smoke", "parity", "kv_transfer", "accuracy"]
[defaults]
model = "tiny-llama"
connector = "mooncake"
parity_mode = "margin"
decode_weights_seed = 1
decode_kv_transfer = false
[[config]]
name = "1x1"
"""


@pytest.fixture(scope="session")
def faulty_sweep(tmp_path_factory) -> SweepRun:
    """FAULTY_SWEEP run once with a failing user command (`--exec` with {junitxml}); shared by
    test_e2e_cpu_lane (silent recompute, accuracy vs another seed), test_e2e_nightly (margin
    parity) and test_e2e_user_commands (a failing user command)."""
    heavy("vllm")
    heavy("mooncake.engine")
    heavy("openai")
    tmp = e2e_dir(tmp_path_factory, "faulty")
    toml = tmp / "faulty.toml"
    toml.write_text(FAULTY_SWEEP)
    failing = f"{sys.executable} -m pytest {USER / 'pd_fails_on_purpose.py'} --junitxml {{junitxml}}"
    results = tmp / "r"
    return _sweep_once(
        results,
        args=("sweep", str(toml), "--platform", "cpu", "--results-dir", str(results), "--exec", failing),
    )


# --- simulated hosts (runtime/simhosts.py): network namespaces with Ray nodes ----------------


def simhosts_available() -> None:
    """Skip (with the reason) where the simulated hosts cannot run, except in the full
    environment (`nox -s tests`, as root on CI), where a missing piece fails instead."""
    heavy("ray")
    from pd_sessions.core import simhost_plan as core
    from pd_sessions.runtime.simhosts import facts

    lacking = core.missing(facts())
    if lacking and os.environ.get("PD_SESSIONS_FULL_ENV") != "1":
        pytest.skip(str(core.refusal(lacking)))


@pytest.fixture(scope="session")
def simulated_hosts_2(tmp_path_factory):
    """Two simulated hosts (``--simulate-hosts 2``: host1 and host2, each a network namespace
    with its own address, loopback, core share and Ray node; the Ray head on the bridge),
    shared by every test that asks for it. Yields runtime.simhosts.SimulatedHosts. A test may
    connect this process to it as the driver (``ray.init(**sim.ray_init_kwargs())``, once);
    the fixture disconnects before it removes the hosts, then asserts nothing of them is left."""
    simhosts_available()
    from helpers import simhosts_leftovers

    from pd_sessions.runtime.simhosts import simulated_hosts

    with simulated_hosts(2, tmp_path_factory.mktemp("simhosts"), say=print) as sim:
        pids = [r.pid for r in sim.processes]
        yield sim
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    assert simhosts_leftovers(sim.run_id, pids) == []


# --- across hosts (issue 26): real vLLM on the simulated hosts, through --ray ----------------


# The faults on the wire between the hosts (issue 29: checks/faults/wire_*.py), run by the
# rehearsal runs on the same clusters after the default checks (tests/test_e2e_wire_faults.py).
WIRE = ("--check", "wire")
# wire_loss's rates per rehearsal run. Over Mooncake only 2 % in CI: at 20 % a KV pull sometimes
# stalls until Mooncake's TCP transfer gives up (30 s, "Mooncake transfer engine returned -1"; 1 of
# 4 runs on 2026-12-02), which is not a 60 s-bounded answer to count on (docs/failure-modes.md,
# row 50). Over NIXL both of the check's rates.
WIRE_LOSS_RATES = {"hosts_mooncake": (2,), "hosts_nixl": (2, 20)}

# Every rehearsal's P/D path budget (--pd-path-budget): the passing ones warm their pair in
# 0.1-0.4 s, so they prove the bound is ample for a correct cross-host setup, and the loopback
# can-fail runs fail within it instead of the default 60 s.
REHEARSAL_PD_PATH_BUDGET_S = 10


def start_rehearsal(tmp_path_factory, sim, sweep: str, *args: str) -> tuple[Path, Cli]:
    """Start ``pd-sessions sweep SWEEP --only 1x1 --ray <the simulated hosts' head>`` (prefill on
    host1, decode on host2), with ``args``: (its results folder, its running Cli)."""
    heavy("vllm")
    results = tmp_path_factory.mktemp(f"hosts_{sweep}") / "r"
    base = ("sweep", sweep, "--only", "1x1", "--platform", "cpu", "--ray", sim.ray_address)
    budget = ("--pd-path-budget", str(REHEARSAL_PD_PATH_BUDGET_S))
    return results, Cli(*base, *budget, "--results-dir", str(results), *args)


def rehearsal(tmp_path_factory, sim, sweep: str, *args: str) -> SweepRun:
    """:func:`start_rehearsal`, waited for; ``extra["tmp_left"]`` as in :func:`_sweep_once`."""
    before = tmp_leftovers()
    results, cli = start_rehearsal(tmp_path_factory, sim, sweep, *args)
    rc = cli.wait(timeout=1400)
    return SweepRun(rc=rc, cli=cli, results=results, extra={"tmp_left": sorted(tmp_leftovers() - before)})


# The bug users hit across hosts, one variable per connector, forced to loopback (issue 26, item 5).
LOOPBACK_CASES = {"nixl_sweep": "VLLM_NIXL_SIDE_CHANNEL_HOST", "mooncake_sweep": "VLLM_HOST_IP"}


@pytest.fixture(scope="session")
def loopback_runs(simulated_hosts_2, tmp_path_factory) -> dict[str, SweepRun]:
    """Both loopback can-fail rehearsals (LOOPBACK_CASES, with --allow-loopback-advertise), run at
    the same time on the shared hosts: each spends most of its wall waiting (for its instances'
    start, then for a P/D path that cannot work), so together they take little more than one.
    sweep -> its finished run."""
    heavy("nixl._api")
    heavy("mooncake.engine")
    started = {
        sweep: start_rehearsal(
            tmp_path_factory,
            simulated_hosts_2,
            sweep,
            "--set",
            f'extra_env={{{var}="127.0.0.1"}}',
            "--allow-loopback-advertise",
            "--skip-check",
            "accuracy",
        )
        for sweep, var in LOOPBACK_CASES.items()
    }
    return {
        sweep: SweepRun(rc=cli.wait(timeout=1400), cli=cli, results=results, extra={})
        for sweep, (results, cli) in started.items()
    }


@pytest.fixture(scope="session")
def hosts_mooncake(simulated_hosts_2, tmp_path_factory) -> SweepRun:
    """The Mooncake sweep's 1x1 across the two simulated hosts, every default check, then the
    wire faults (WIRE)."""
    heavy("mooncake.engine")
    rates = ", ".join(map(str, WIRE_LOSS_RATES["hosts_mooncake"]))
    loss = ("--set", f"check_options.wire_loss.rates=[{rates}]")
    return rehearsal(tmp_path_factory, simulated_hosts_2, "mooncake_sweep", *WIRE, *loss)


@pytest.fixture(scope="session")
def hosts_nixl(simulated_hosts_2, tmp_path_factory) -> SweepRun:
    """The NIXL sweep's 1x1 across the two simulated hosts, every default check, then the wire
    faults (WIRE)."""
    heavy("nixl._api")
    return rehearsal(tmp_path_factory, simulated_hosts_2, "nixl_sweep", *WIRE)
