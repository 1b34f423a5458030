"""Helpers shared by several test modules (the fixtures, and the helpers of the real-vLLM runs,
are in conftest.py): values the harness computes with, throwaway processes, runs on the fake
stack (pd_sessions/data/fake_stack: vLLM and the router replaced by a throwaway
OpenAI-compatible server with a grandchild "engine core")."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import time
from pathlib import Path

import psutil
from conftest import FIXTURES, ROOT, Cli, wait_until

from pd_sessions.checks.completions import Completion
from pd_sessions.core.config import ClusterConfig
from pd_sessions.runtime.process import alive, session_family

# --- values -------------------------------------------------------------------------------------


def cfg(name: str = "c", **kw) -> ClusterConfig:
    """A config ``name`` of model "Qwen/Qwen3-0.6B" (a hub id, not a model the harness
    generates), with the fields ``kw`` set."""
    return ClusterConfig(**{"name": name, "model": "Qwen/Qwen3-0.6B", **kw})


def comp(ids=(1, 2, 3), text="abc", prompt_tokens=7, *, prompt_ids=None) -> Completion:
    """A /v1/completions answer that generated ``ids`` (None: the server returned no token ids)
    for a prompt of ``prompt_tokens`` tokens, or of the tokens ``prompt_ids`` when given."""
    return Completion(
        text=text,
        token_ids=tuple(ids) if ids is not None else None,
        prompt_tokens=len(prompt_ids) if prompt_ids is not None else prompt_tokens,
        completion_tokens=len(ids or ()),
        finish_reason="length",
        prompt_token_ids=tuple(prompt_ids) if prompt_ids is not None else None,
    )


class FakePorts:
    """Deterministic PortSource: sequential ports, blocks from 20000; can be told to repeat."""

    def __init__(self, repeat: int | None = None):
        self.next = 40000
        self.block = 20000
        self.repeat = repeat
        self.claimed: list[int] = []

    def take(self, label):
        if self.repeat is not None:
            return self.repeat
        self.next += 1
        return self.next

    def take_block(self, label, size):
        self.block += 100
        return self.block

    def claim(self, label, port):
        self.claimed.append(port)
        return port


def bench_doc(runs, **parts) -> dict:
    """A bench results.json document of ``runs`` (and the ``parts`` given) on a made-up machine."""
    from pd_sessions.bench import bench_results

    return {
        "started_at": "2026-11-29T00:00:00+00:00",
        "duration_s": 60.0,
        "machine": {
            "cpu_model": "cpu",
            "cores": 2,
            "memory_gib": 24,
            "platform": "linux",
            "python": "3.11",
            "load_before": "0",
            "load_after": "0",
        },
        "settings": {"platform": "cpu", "repeats": 3, "checks": ["smoke"]},
        "runs": runs,
        "clusters": bench_results.summarize_clusters(runs) if runs else {},
        **parts,
    }


# --- throwaway processes ------------------------------------------------------------------------

# A parent that starts a grandchild (same session) and a detached-from-tree orphan
# (double fork, still in our session), then sleeps.
FAMILY = textwrap.dedent("""
    import os, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if os.fork() == 0:
        if os.fork() == 0:
            time.sleep(600)
        os._exit(0)
    print("family" + " up", flush=True)  # the log echoes argv: build the marker
    time.sleep(600)
""")

IGNORES_TERM = textwrap.dedent("""
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring" + " SIGTERM", flush=True)
    time.sleep(600)
""")


def session_members(sid: int) -> list[int]:
    """PIDs of the session ``sid``'s processes that are not zombies."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (OSError, psutil.Error):
            pass
    return out


def wait_for_members(sid: int, n: int, timeout: float = 10.0) -> list[int]:
    """The session ``sid``'s processes once there are at least ``n`` (an orphan is forked by a
    child that may still be running)."""
    return wait_until(
        lambda: members if len(members := session_members(sid)) >= n else None,
        timeout,
        lambda: f"{n} processes in session {sid} (have {session_members(sid)})",
    )


def gone(pid: int) -> bool:
    """No process ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids, timeout: float, what: str = "") -> None:
    """Until every one of ``pids`` is gone; fails at ``timeout`` naming ``what`` and who is left."""
    wait_until(
        lambda: all(gone(p) for p in pids),
        timeout,
        lambda: f"{what or 'processes'} to be gone (left: {[p for p in pids if not gone(p)]})",
    )


def process_on_port(port: int, *, by_argv: bool = False) -> psutil.Process | None:
    """The process listening on ``port`` (vllm-router rewrites its title, so argv won't do); with
    ``by_argv``, else the one started with ``--port PORT`` (it may not listen yet)."""
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return psutil.Process(c.pid)
    if by_argv:
        for p in psutil.process_iter(["cmdline"]):
            argv = p.info["cmdline"] or []
            if "--port" in argv and argv[argv.index("--port") + 1] == str(port):
                return p
    return None


# --- runs on the fake stack ---------------------------------------------------------------------

FAKE = ROOT / "pd_sessions" / "data" / "fake_stack"  # shipped with the package (the packing bench)


def fake_stack_env(**extra: str) -> dict[str, str]:
    """This environment with the fake stack first on PYTHONPATH (then this checkout), and
    ``extra`` (e.g. FAKE_DECODE_BEHAVIOR) set."""
    return {**os.environ, "PYTHONPATH": f"{FAKE}{os.pathsep}{ROOT}", **extra}


def fake_sweep_toml(*, connector="mooncake", top="", extra="", configs=("1x1",)) -> str:
    """A sweep "fake" of the fake model: ``top`` lines before [defaults] (checks, check
    options), ``extra`` lines in it, one [[config]] per name in ``configs``."""
    lines = ['name = "fake"', top, "[defaults]", 'model = "fake-model"', f'connector = "{connector}"', extra]
    lines += [f'[[config]]\nname = "{name}"' for name in configs]
    return "\n".join(line for line in lines if line) + "\n"


TWO_CONFIGS = fake_sweep_toml(configs=("1x1", "1x1b"))


class FakeSweep(Cli):
    """`pd-sessions sweep` of a one-config fake sweep (1x1) on the fake stack, with the accuracy
    check skipped and 2 s of grace; ``t0``: when it started (``time.time()``)."""

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
            "--skip-check",
            "accuracy",
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
    conftest.plan_ports has the HTTP port of each process by name."""
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
                *(("--skip-check", "accuracy") if fake and session == "sweep" else ()),
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


# --- the simulated hosts ---------------------------------------------------------------------


def simhosts_leftovers(run_id: str, pids=()) -> list[str]:
    """What simulated-hosts run ``run_id`` left on this machine: its namespaces, its links
    (bridge, veths), its short link, its state file, and any of ``pids`` (its Ray processes)
    or their session members still alive; and the guard route (``unreachable 198.18.0.0/15``)
    when no run's bridge is left to hold it."""
    from pd_sessions.core import simhost_plan as core
    from pd_sessions.runtime import netns

    spaces = os.listdir(netns.NETNS_DIR) if netns.NETNS_DIR.exists() else []
    left = [f"namespace {n}" for n in spaces if n.startswith(f"{core.PREFIX}-{run_id}-")]
    etc = os.listdir(netns.ETC_NETNS) if netns.ETC_NETNS.exists() else []
    left += [f"folder {netns.ETC_NETNS / n}" for n in etc if n.startswith(f"{core.PREFIX}-{run_id}-")]
    left += [f"link {n}" for n in os.listdir(netns.SYSFS_NET) if n.startswith(f"{core.PREFIX}{run_id}")]
    for path in (Path(f"/tmp/{core.PREFIX}-{run_id}"), Path(core.STATE_DIR) / f"{run_id}.json"):
        if os.path.lexists(path):
            left.append(f"file {path}")
    for sid in pids:
        left += [f"process {pid} of session {sid}" for pid in session_members(sid)]
    if netns.exists(netns.ROUTE, netns.GUARD_ROUTE):  # there, and no run's bridge holds it
        left.append(f"route unreachable {netns.GUARD_ROUTE}")
    return left


def move_btime(monkeypatch, by: float) -> None:
    """Move what ``/proc/stat``'s ``btime`` says by ``by`` seconds, as the kernel does when it
    recomputes it (whole seconds, wall clock minus CLOCK_BOOTTIME) after a slew of the clock
    across a second's boundary (issue 38): psutil's ``create_time()`` moves with it."""
    from psutil import _pslinux

    real = _pslinux.boot_time
    monkeypatch.setattr(_pslinux, "boot_time", lambda: real() + by)


def old_rule_same(pid: int, recorded_create_time: float) -> bool:
    """The identity rule before issue 38 (psutil create_time within 0.01 s)."""
    import psutil

    return abs(psutil.Process(pid).create_time() - recorded_create_time) < 0.01
