"""The bench's second-run start-up part (pd_sessions/bench/startup.py): the nox command line,
the milestones read from nox's output, the summary, and one measured run against a fake
"nox" (a throwaway script that prints what nox and the sweep print and starts a server in
a session of its own, as the harness does): it is stopped at the spawn line and verified gone.
The real measurement (nox building vLLM's venv) is the bench's, not a test's."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.procs import gone
from helpers.waiting import wait_until, within

from pd_sessions.bench import bench_results, startup

FAKE_NOX = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    stubborn = sys.argv[1] == "stubborn"
    print("nox > Running session mooncake_sweep", flush=True)
    print("nox > \\x1b[1mCreating virtual environment (uv) using python3.11 in /tmp/x\\x1b[0m", flush=True)
    time.sleep(0.2)
    print("nox > python -m pd_sessions.env.import_canary mooncake", flush=True)
    print("nox > python -m pd_sessions sweep mooncake_sweep --only 1x1", flush=True)
    code = "import signal, subprocess, sys, time\\n"
    if stubborn:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    code += "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\\ntime.sleep(60)\\n"
    server = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    with open(sys.argv[2], "w") as f:
        f.write(str(server.pid))
    time.sleep(0.3)  # the server's own child has started
    print("[pd-sessions     0.5s] 1x1: started 2 instances and the router; waiting up to 1200 s", flush=True)

    def stop(signum, frame):
        os.killpg(server.pid, signal.SIGTERM)  # the sweep's teardown (a stubborn server survives it)
        sys.exit(1)

    signal.signal(signal.SIGTERM, stop)
    time.sleep(60)
""")


def test_nox_argv_decision_table(tmp_path):
    nox, f = ["python", "-m", "nox"], Path("noxfile.py")
    rebuild = startup.nox_argv(nox, "mooncake_sweep", tmp_path, "rebuild", ["--only", "1x1"], f)
    assert rebuild == [
        *nox,
        *("-f", "noxfile.py", "-s", "mooncake_sweep", "--envdir", str(tmp_path)),
        "--reuse-venv=never",
        *("--", "--only", "1x1"),
    ]
    reuse = startup.nox_argv(nox, "mooncake_sweep", tmp_path, "reuse", ["--only", "1x1"], f)
    assert "--reuse-venv=never" not in reuse and reuse[-3:] == ["--", "--only", "1x1"]
    with pytest.raises(ValueError, match="allowed: rebuild, reuse"):
        startup.nox_argv(nox, "s", tmp_path, "fresh", [], f)


def test_milestones_first_line_of_each_ansi_ignored():
    lines = [
        (0.1, "nox > Running session mooncake_sweep"),
        (0.2, "nox > \x1b[32mRe-using existing virtual environment at /tmp/x/mooncake_sweep.\x1b[0m"),
        (5.0, "nox > python -m pd_sessions.env.import_canary mooncake"),
        (6.0, "nox > python -m pd_sessions sweep mooncake_sweep --only 1x1 --platform cpu"),
        (6.5, "[pd-sessions     0.0s] configs: 1x1"),
        (6.6, "[pd-sessions     0.1s] 1x1: started 2 instances and the router; waiting up to 1200 s"),
        (9.0, "[pd-sessions     2.5s] 1x2: started 3 instances and the router; waiting up to 1200 s"),
    ]
    assert startup.milestones(lines) == {
        "session": 0.1,
        "venv_reused": 0.2,
        "canary": 5.0,
        "cli": 6.0,
        "spawned": 6.6,  # the first spawn, not the second config's
    }
    assert startup.milestones([(1.0, "nox > Session mooncake_sweep failed.")]) == {}
    # nox 2026 says "Reusing"
    reused = (0.3, "nox > Reusing existing virtual environment at /tmp/x/mooncake_sweep.")
    assert startup.milestones([reused]) == {"venv_reused": 0.3}


def _run(mode: str, spawned: float | None, repeat: int = 0) -> dict:
    ms = {"session": 0.5, "venv_created" if mode == "rebuild" else "venv_reused": 1.0}
    if spawned is not None:
        ms["spawned"] = spawned
    return {"mode": mode, "repeat": repeat, "ok": spawned is not None, "milestones_s": ms, "error": None}


def test_summarize_saved_and_ratio_failed_runs_left_out():
    runs = [_run("rebuild", 60.0), _run("reuse", 20.0), _run("rebuild", 80.0, 1), _run("reuse", 10.0, 1)]
    runs += [_run("reuse", None, 2)]
    s = startup.summarize(runs)
    assert s["rebuild"]["to_spawn_s"]["median"] == 70.0 and s["reuse"]["to_spawn_s"]["median"] == 15.0
    assert s["reuse"]["runs"] == 3 and s["reuse"]["ok"] == 2
    assert s["saved_s"] == 55.0 and s["ratio"] == pytest.approx(4.67)
    assert "venv_created" in s["rebuild"]["milestones_s"] and "venv_reused" in s["reuse"]["milestones_s"]
    assert startup.summarize([])["saved_s"] is None


def test_startup_markdown():
    runs = [_run("rebuild", 60.0), _run("reuse", 20.0), _run("reuse", None, 1)]
    runs[-1]["error"] = "no instance spawned within 900 s"
    su = {"command": "nox -s mooncake_sweep", "what": "from nox to the spawn", "runs": runs}
    su.update(startup.summarize(runs))
    md = "\n".join(bench_results.startup_markdown(su))
    assert "| rebuilt (--reuse-venv=never): before | 1/1 |" in md and "**60.00** |" in md
    assert "| reused: now | 1/2 |" in md and "saves 40 s per call" in md and "= **3**" in md
    assert "FAILED reuse #1: no instance spawned within 900 s" in md
    assert bench_results.startup_markdown(None) == []


@pytest.mark.procs
@pytest.mark.parametrize("kind", ["healthy", "stubborn"])
def test_measure_once_stops_at_the_spawn_and_verifies_everything_gone(tmp_path, kind):
    script = tmp_path / "fake_nox.py"
    script.write_text(FAKE_NOX)
    pidfile = tmp_path / "server.pid"
    t0 = time.monotonic()
    rec = startup.measure_once(
        [sys.executable, str(script), kind, str(pidfile)],
        env=os.environ,
        log=tmp_path / "run.log",
        timeout_s=30,
        stop_slack_s=10.0 if kind == "healthy" else 2.0,
    )
    server = int(pidfile.read_text())
    ms = rec["milestones_s"]
    assert list(ms) == ["session", "venv_created", "canary", "cli", "spawned"]
    assert ms["spawned"] >= ms["canary"] + 0.2 > 0.2
    assert rec["processes_seen"] >= 3  # the fake nox, its server and the server's child
    assert "1x1: started 2 instances" in (tmp_path / "run.log").read_text()
    if kind == "healthy":
        assert rec["ok"] and rec["error"] is None and rec["left"] == []
        within(rec["stopped_in_s"], 5.0, "the stop of a healthy run (it may take 10 s)")
    else:  # the server ignored SIGTERM: reported, then killed (it is ours)
        assert not rec["ok"] and "outlived the stop" in rec["error"]
        assert any(line.startswith(f"{server} ") for line in rec["left"])
    wait_until(lambda: gone(server), 5, f"the server (pid {server}) to be gone", tick=0.05)
    within(time.monotonic() - t0, 25.0, "the measurement (its timeout: 30 s)")
