"""Second-run start-up through nox (edge): from invoking ``nox -s SESSION`` to the first
instance spawned, with the session venv rebuilt (``--reuse-venv=never``: what every call
cost before the sessions had ``reuse_venv=True``) and reused (the noxfile's default now).

Each run is real nox on this checkout's noxfile, with a scratch ``--envdir`` in a temporary
folder (no shared venv is touched; uv's cache makes a rebuild a matter of seconds to a
minute) and a scratch ``--results-dir``. nox and the harness run in a process group of
their own; once the CLI says it started the instances, the group gets SIGTERM (the sweep's
own stop path tears the cluster down) and the run is verified gone: nox, the harness,
every server and everything in their sessions. Rebuild and reuse alternate, each reuse
right after a rebuild of the same venv, so both see the same uv cache and the same files.

Pure: the nox command line, which output line is which milestone, and the summary.
Edge: the runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from pd_sessions.bench.stats import ratio, summary
from pd_sessions.runtime.process import alive, session_family

ROOT = Path(__file__).resolve().parents[2]
MODES = ("rebuild", "reuse")
# The line `pd-sessions sweep` prints right after it spawned a config's instances and router
# (cluster.running_cluster; the first instance was spawned a few milliseconds before it).
SPAWNED = re.compile(r": started \d+ instances and the router")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Milestones in the order a run reaches them: (name, how its first line is recognized).
MILESTONES: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("session", lambda line: line.startswith("nox > Running session")),
    ("venv_created", lambda line: line.startswith("nox > Creating virtual environment")),
    (
        "venv_reused",
        lambda line: line.startswith(("nox > Reusing existing virtual environment", "nox > Re-using")),
    ),
    ("canary", lambda line: line.startswith("nox > ") and "pd_sessions.env.import_canary" in line),
    ("cli", lambda line: line.startswith("nox > ") and "-m pd_sessions sweep" in line),
    ("spawned", lambda line: bool(SPAWNED.search(line))),
)
# How long one run may take to reach the spawn (a rebuild on a slow host included).
RUN_TIMEOUT_S = 900.0
# After SIGTERM: the sweep's teardown budget is about its grace + a few seconds.
STOP_SLACK_S = 15.0


def nox_argv(
    nox: Sequence[str], session: str, envdir: Path, mode: str, posargs: Sequence[str], noxfile: Path
) -> list[str]:
    """The command line of one run.

    mode "rebuild" -> ``--reuse-venv=never``: nox recreates the session venv, as every call did
                      before the sessions had reuse_venv=True
    mode "reuse"   -> no flag: the noxfile's reuse_venv=True keeps the venv (the installs run
                      again and find everything in place)
    another mode   -> ValueError
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}; allowed: {', '.join(MODES)}")
    flags = ["--reuse-venv=never"] if mode == "rebuild" else []
    return [*nox, "-f", str(noxfile), "-s", session, "--envdir", str(envdir), *flags, "--", *posargs]


def milestones(lines: Iterable[tuple[float, str]]) -> dict[str, float]:
    """name -> seconds of the first output line that marks it (see MILESTONES); ANSI colours
    are ignored. Milestones that never appeared are absent."""
    out: dict[str, float] = {}
    for t, raw in lines:
        line = ANSI.sub("", raw).strip()
        for name, matches in MILESTONES:
            if name not in out and matches(line):
                out[name] = t
    return out


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per mode: the time to the spawn (summary over the runs that reached it), and each
    milestone's; then how much a reused venv saves (medians) and the ratio rebuild / reuse."""
    out: dict[str, Any] = {}
    for mode in MODES:
        ok = [r for r in runs if r["mode"] == mode and r["ok"]]
        names = [n for n, _ in MILESTONES if any(n in r["milestones_s"] for r in ok)]
        out[mode] = {
            "runs": len([r for r in runs if r["mode"] == mode]),
            "ok": len(ok),
            "to_spawn_s": summary([r["milestones_s"]["spawned"] for r in ok]),
            "milestones_s": {
                n: summary([r["milestones_s"][n] for r in ok if n in r["milestones_s"]]) for n in names
            },
        }
    before, after = out["rebuild"]["to_spawn_s"]["median"], out["reuse"]["to_spawn_s"]["median"]
    out["saved_s"] = None if before is None or after is None else round(before - after, 2)
    r = ratio(before, after)
    out["ratio"] = None if r is None else round(r, 2)
    return out


def measure_once(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log: Path,
    timeout_s: float = RUN_TIMEOUT_S,
    stop_slack_s: float = STOP_SLACK_S,
) -> dict[str, Any]:
    """Run ``argv`` in a process group of its own until the spawn line, SIGTERM the group,
    verify that everything it started is gone. Every output line goes to ``log`` with its
    time since the start."""
    lines: list[tuple[float, str]] = []
    spawned = threading.Event()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    root = psutil.Process(proc.pid)

    def read() -> None:
        assert proc.stdout is not None
        with log.open("w") as f:
            for raw in proc.stdout:
                t = time.monotonic() - t0
                lines.append((t, raw.rstrip("\n")))
                f.write(f"[{t:8.2f}] {raw}")
                f.flush()
                if SPAWNED.search(ANSI.sub("", raw)):
                    spawned.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    rec: dict[str, Any] = {"argv": list(argv), "log": str(log)}
    family: dict[int, psutil.Process] = {}
    try:
        while not spawned.is_set() and proc.poll() is None and time.monotonic() - t0 < timeout_s:
            spawned.wait(0.5)
        # what the run has started by now (looked up once: polling would load the host it measures)
        family = {p.pid: p for p in (session_family(root) if alive(root) else [])}
        exited_early = proc.poll()
    finally:
        stop_at = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    # Wait for nox, then for everything the run started (the sweep tears its cluster down).
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=stop_slack_s * 4)
    end = time.monotonic() + stop_slack_s
    while time.monotonic() < end and any(alive(p) for p in family.values()):
        time.sleep(0.1)
    left = [p for p in family.values() if alive(p)]
    rec["stopped_in_s"] = round(time.monotonic() - stop_at, 3)
    rec["left"] = []
    for p in left:  # ours: report it, then make sure it is gone
        with contextlib.suppress(psutil.Error):
            rec["left"].append(f"{p.pid} {' '.join(p.cmdline())[:200]}")
            p.kill()
    reader.join(timeout=5)
    rec["exit_code"] = proc.poll()
    rec["milestones_s"] = {k: round(v, 3) for k, v in milestones(lines).items()}
    rec["processes_seen"] = len(family)
    if "spawned" in rec["milestones_s"] and not rec["left"]:
        rec["ok"], rec["error"] = True, None
    elif rec["left"]:
        rec["ok"], rec["error"] = False, f"{len(left)} process(es) outlived the stop: {rec['left'][:3]}"
    elif exited_early is not None:
        tail = " | ".join(line for _, line in lines[-5:])
        rec["ok"], rec["error"] = False, f"nox exited with {exited_early} before spawning: {tail}"
    else:
        rec["ok"], rec["error"] = False, f"no instance spawned within {timeout_s:.0f} s"
    return rec


def run(
    logs: Path,
    *,
    session: str,
    posargs: Sequence[str],
    repeats: int,
    progress: Callable[[str], None],
    nox: Sequence[str] | None = None,
    noxfile: Path = ROOT / "noxfile.py",
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``repeats`` x (rebuild, then reuse) of ``nox -s SESSION -- POSARGS`` in a scratch envdir."""
    nox = list(nox or [sys.executable, "-m", "nox"])
    logs.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in (environ if environ is not None else os.environ).items() if k != "VIRTUAL_ENV"}
    runs: list[dict[str, Any]] = []
    scratch = Path(tempfile.mkdtemp(prefix="pd-bench-startup-"))
    try:
        for rep in range(repeats):
            for mode in MODES:
                results = scratch / f"results-{rep}-{mode}"
                argv = nox_argv(
                    nox, session, scratch / "nox", mode, [*posargs, "--results-dir", str(results)], noxfile
                )
                progress(f"startup [{len(runs) + 1}/{2 * repeats}]: {mode}: {' '.join(argv)}")
                rec = measure_once(argv, env=env, log=logs / f"{rep}-{mode}.log")
                runs.append({"mode": mode, "repeat": rep, **rec})
                progress(
                    f"startup [{len(runs)}/{2 * repeats}]: {mode}: "
                    + (
                        f"first instance spawned {rec['milestones_s']['spawned']:.1f} s after `nox`; "
                        f"stopped, all {rec['processes_seen']} processes gone in {rec['stopped_in_s']:.1f} s"
                        if rec["ok"]
                        else f"FAILED: {rec['error']}"
                    )
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "session": session,
        "posargs": list(posargs),
        "command": " ".join([*nox, "-s", session, "[--reuse-venv=never]", "--", *posargs]),
        "what": "from invoking nox to the CLI's line saying it spawned the instances (the first one "
        "a few ms before), a scratch --envdir; rebuild = --reuse-venv=never, reuse = the "
        "noxfile's reuse_venv=True",
        "runs": runs,
        **summarize(runs),
    }
