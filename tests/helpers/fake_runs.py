"""Runs on the fake stack (pd_sessions/data/fake_stack: vLLM and the router replaced by a throwaway
OpenAI-compatible server with a grandchild "engine core"): a sweep, through the CLI or nox."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import psutil

from helpers import FIXTURES, ROOT
from helpers.cli_runs import Cli
from helpers.waiting import wait_until
from pd_sessions.runtime.process import alive, session_family

FAKE = ROOT / "pd_sessions" / "data" / "fake_stack"  # shipped with the package (the packing bench)


def fake_stack_env(**extra: str) -> dict[str, str]:
    """This environment with the fake stack first on PYTHONPATH (then this checkout), and
    ``extra`` (e.g. FAKE_DECODE_BEHAVIOR) set."""
    return {**os.environ, "PYTHONPATH": f"{FAKE}{os.pathsep}{ROOT}", **extra}


# The checks a fake-stack run leaves out: lm_eval (accuracy) and the KV digest (a CPU-lane default
# whose observer lives in vLLM's connector: the fake server has neither, so the check would fail).
SKIPPED = ("--skip-check", "accuracy", "--skip-check", "kv_digest")


def fake_sweep_toml(*, connector="mooncake", top="", extra="", configs=("1x1",)) -> str:
    """A sweep "fake" of the fake model: ``top`` lines before [defaults] (checks, check
    options), ``extra`` lines in it, one [[config]] per name in ``configs``."""
    lines = ['name = "fake"', top, "[defaults]", 'model = "fake-model"', f'connector = "{connector}"', extra]
    lines += [f'[[config]]\nname = "{name}"' for name in configs]
    return "\n".join(line for line in lines if line) + "\n"


TWO_CONFIGS = fake_sweep_toml(configs=("1x1", "1x1b"))


class FakeSweep(Cli):
    """`pd-sessions sweep` of a one-config fake sweep (1x1) on the fake stack, with the accuracy
    and kv_digest checks skipped (SKIPPED) and 2 s of grace; ``t0``: when it started (``time.time()``)."""

    def __init__(self, tmp_path: Path, *, connector="mooncake", extra="", env=None, args=(), top=""):
        toml = tmp_path / "sweep.toml"
        toml.write_text(fake_sweep_toml(connector=connector, extra=extra, top=top))
        self.results = tmp_path / "results"
        self.run_dir = self.results / "1x1"
        super().__init__(
            "sweep",
            str(toml),
            "--platform",
            "cpu",
            *SKIPPED,
            "--results-dir",
            str(self.results),
            "--grace",
            "2",
            *args,
            env=fake_stack_env(**(env or {})),
        )
        self.t0 = time.time()


def every_plan_port(run_dir: Path) -> list[int]:
    """Every port on the "ports:" line of the run's plan.txt (HTTP, bootstrap, side channels);
    cli_runs.plan_ports has the HTTP port of each process by name."""
    text = (run_dir / "plan.txt").read_text()
    return [int(p) for p in re.findall(r"=(\d+)", text.split("ports:")[1])]


def assert_nothing_left(run_dir: Path) -> None:
    """No process of the run is alive and no port of its plan is listened on (TIME_WAIT
    leftovers of finished connections are fine: servers bind with SO_REUSEADDR)."""
    ports = set(every_plan_port(run_dir))
    listening = [
        c
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports
    ]
    assert listening == []
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info["cmdline"] or []
        for i, a in enumerate(argv[:-1]):
            assert not (a == "--port" and argv[i + 1].isdigit() and int(argv[i + 1]) in ports), argv
        assert not any(str(run_dir) in a for a in argv), argv


# --- a sweep through nox (test_stops, test_e2e_stops) -------------------------------------------

GRACE = 2.0
FAKE_ENV = FIXTURES / "fake_env"  # a CPU-only torch and the Mooncake connector, for nox's checks


class NoxRun(Cli):
    """The project's noxfile running the sweep (two configs) on this interpreter
    (``nox --no-venv``, changing nothing in it: ``--no-install``), in its own process group,
    output timestamped; ``session="serve"``: its serve session instead (name the config in
    ``args``: ``("--only", "1x1")``)."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
        grace: float = GRACE,
        sweep: str | None = None,
        fake: bool = True,
        session: str = "sweep",
    ):
        """``sweep``: a built-in sweep (default: TWO_CONFIGS); ``fake``: the fake stack
        instead of real vLLM (and no accuracy check)."""
        if sweep is None:
            (tmp_path / "sweep.toml").write_text(TWO_CONFIGS)
            sweep = str(tmp_path / "sweep.toml")
        self.results = tmp_path / "results"
        path = [FAKE_ENV, FAKE, ROOT] if fake else [ROOT]
        e = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path)), **(env or {})}
        super().__init__(
            argv=[
                sys.executable,
                "-m",
                "nox",
                "-f",
                str(ROOT / "noxfile.py"),
                "--no-venv",  # this interpreter, as found
                "-s",
                session,
                "--",
                sweep,
                "--no-install",  # change nothing in it
                "--platform",
                "cpu",
                *(SKIPPED if fake and session == "sweep" else ()),
                "--results-dir",
                str(self.results),
                "--grace",
                str(grace),
                *args,
            ],
            cwd=tmp_path,
            env=e,
            new_session=True,
        )

    def started(self) -> tuple[psutil.Process, list[psutil.Process]]:
        """Once both instances run their "engine core": the harness and everything under nox."""
        self.wait_for("started 2 instances")
        nox = psutil.Process(self.proc.pid)
        harness = next(c for c in nox.children() if "pd_sessions" in " ".join(c.cmdline()))

        def ready() -> list[psutil.Process] | None:
            procs = session_family(nox)
            engine_cores = [
                p
                for p in procs
                if p.ppid() not in (nox.pid, harness.pid) and "time.sleep(3600)" in " ".join(p.cmdline())
            ]
            reaper = any("pd_sessions.runtime.reaper" in " ".join(p.cmdline()) for p in procs)
            return procs if len(engine_cores) >= 2 and reaper else None

        procs = wait_until(
            ready,
            30,
            lambda: f"2 engine cores and the reaper under nox (have {session_family(nox)})",
            tick=0.05,
        )
        return harness, procs

    def wait(self, timeout: float = 60) -> int:
        """nox's exit status; the output reader is left to the test (the harness may outlive nox)."""
        return self.proc.wait(timeout)

    def all_gone_within(self, procs: list[psutil.Process], since: float, limit: float) -> float:
        """Seconds from ``since`` until every process in ``procs`` is gone; fails past ``limit``."""
        wait_until(
            lambda: not any(alive(p) for p in procs),
            since + limit - time.monotonic(),
            lambda: (
                f"every process to be gone {limit:.1f} s after the stop; still alive: "
                f"{[p for p in procs if alive(p)]}\n{self.text}"
            ),
        )
        return time.monotonic() - since

    def summary(self) -> dict:
        return json.loads((self.results / "summary.json").read_text())
