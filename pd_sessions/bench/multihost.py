"""The ``multihost`` part: what the rehearsal across hosts costs (issue 26's limits).

Side by side, ``--repeats`` times each, in alternating order: one config run by
``pd-sessions sweep SWEEP --only CONFIG`` on this host, and the same with ``--simulate-hosts 2``
(two network namespaces, each a Ray node; the head, the driver and the router here). For each
run: the whole command's wall time (the simulated hosts' making and removal included: what a
user waits for), its phases from result.json, and the peak resident memory (sampled every 0.5 s)
of the run's Ray processes (head, nodes, workers, the agents). The namespaces, veths and bridge are
kernel objects with no process of their own: their memory is the kernel's, not counted.

Resident memory of a set of processes is judged by their summed PSS (each shared page divided
among the processes that map it, as /proc/PID/smaps_rollup gives it): Ray's dozen Python processes
map the same interpreter and libraries, and a sum of their RSS counts those pages once per
process (seen: 1.8 GiB summed RSS for 1.2 GiB PSS). The summed RSS is recorded beside it.

Limits (issue 26): the rehearsal adds at most 30 s to a config's wall, and at most 1.5 GiB
resident for Ray and the namespaces.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from pd_sessions.bench.stats import summary
from pd_sessions.runtime.process import session_family

MODES = ("one_host", "two_hosts")
WALL_LIMIT_S = 30.0
RAY_MEMORY_LIMIT_GIB = 1.5
SAMPLE_S = 0.5


def is_ray(argv: list[str]) -> bool:
    """A process of Ray's own (not a vLLM or a harness process that merely mentions it)."""
    text = " ".join(argv[:3])
    return any(
        k in text for k in ("raylet", "gcs_server", "ray::", "ray.scripts", "ray/_private", "ray/dashboard")
    )


class RaySampler:
    """Peak summed PSS (and, for reference, summed RSS) of the Ray processes under ``root`` (its
    descendants and their sessions)."""

    def __init__(self, root: int):
        self.root = root
        self.peak = 0
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            with contextlib.suppress(psutil.Error):
                pss = rss = 0
                for p in session_family(psutil.Process(self.root)):
                    with contextlib.suppress(psutil.Error):
                        if is_ray(p.cmdline()):
                            m = p.memory_full_info()
                            pss, rss = pss + m.pss, rss + m.rss
                self.peak, self.peak_rss = max(self.peak, pss), max(self.peak_rss, rss)

    def close(self) -> tuple[int, int]:
        """(peak summed PSS, peak summed RSS), bytes."""
        self._stop.set()
        self._thread.join(5)
        return self.peak, self.peak_rss


def run_once(argv: list[str], results: Path, log: Path) -> dict[str, Any]:
    """One sweep run: its wall, exit status, phases and the peak memory of its Ray processes."""
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        sampler = RaySampler(proc.pid)
        rc = proc.wait()
    wall = time.monotonic() - t0
    pss, rss = sampler.close()
    rec: dict[str, Any] = {
        "ok": rc == 0,
        "rc": rc,
        "wall_s": round(wall, 2),
        "ray_pss_bytes": pss,
        "ray_rss_bytes": rss,
    }
    try:
        doc = json.loads((results / "summary.json").read_text())
        rec["phases"] = doc["configs"][0]["phases"]
    except (OSError, ValueError, KeyError, IndexError):
        rec["phases"] = {}
    if rc != 0:
        rec["error"] = f"exit status {rc}; log {log}"
    return rec


def run(
    logs: Path,
    *,
    sweep: str,
    config: str,
    platform: str,
    repeats: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """``repeats`` x (one host, two simulated hosts) of one config, every check but accuracy."""
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for rep in range(repeats):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            results = logs / f"{rep}-{mode}"
            argv = [sys.executable, "-m", "pd_sessions", "sweep", sweep, "--only", config]
            argv += ["--platform", platform, "--skip-check", "accuracy", "--results-dir", str(results)]
            argv += ["--simulate-hosts", "2"] if mode == "two_hosts" else []
            progress(f"multihost [{len(runs) + 1}/{2 * repeats}]: {mode}: {' '.join(argv[2:])}")
            rec = run_once(argv, results, logs / f"{rep}-{mode}.log")
            runs.append({"mode": mode, "repeat": rep, **rec})
            done = (
                f"wall {rec['wall_s']:.1f} s, Ray PSS {rec['ray_pss_bytes'] / 2**20:.0f} MiB "
                f"(summed RSS {rec['ray_rss_bytes'] / 2**20:.0f} MiB)"
            )
            progress(
                f"multihost [{len(runs)}/{2 * repeats}]: {mode}: " + (done if rec["ok"] else rec["error"])
            )
    return {"sweep": sweep, "config": config, "runs": runs, **summarize(runs)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per mode, the wall added by two hosts, Ray's memory; None where a mode has no run."""
    ok = {m: [r for r in runs if r["mode"] == m and r["ok"]] for m in MODES}
    wall = {m: summary([r["wall_s"] for r in ok[m]]) for m in MODES}
    pss = summary([r["ray_pss_bytes"] / 2**30 for r in ok["two_hosts"]])
    rss = summary([r["ray_rss_bytes"] / 2**30 for r in ok["two_hosts"]])
    added = (
        round(wall["two_hosts"]["median"] - wall["one_host"]["median"], 2)
        if wall["one_host"]["n"] and wall["two_hosts"]["n"]
        else None
    )
    return {
        "wall_s": wall,
        "added_wall_s": added,
        "ray_pss_gib": pss,
        "ray_rss_gib": rss,
        "limits": {"added_wall_s": WALL_LIMIT_S, "ray_pss_gib": RAY_MEMORY_LIMIT_GIB},
    }


def markdown(mh: dict[str, Any] | None) -> list[str]:
    """The part's table and its verdict against the issue's limits."""
    if not mh:
        return []

    def med(s: dict[str, Any] | None, unit: str) -> str:
        return f"{s['median']:.1f}{unit} ({s['min']:.1f}-{s['max']:.1f})" if s and s["n"] else "-"

    added, pss, rss = mh["added_wall_s"], mh["ray_pss_gib"], mh["ray_rss_gib"]
    lines = [
        f"## Across hosts: the rehearsal's cost ({mh['sweep']} {mh['config']}, `multihost` part)",
        "",
        "| | one host | two simulated hosts | added | limit |",
        "| --- | --- | --- | --- | --- |",
        f"| wall (whole command) | {med(mh['wall_s']['one_host'], ' s')} | "
        f"{med(mh['wall_s']['two_hosts'], ' s')} | {added:.1f} s | {WALL_LIMIT_S:g} s |"
        if added is not None
        else "| wall (whole command) | - | - | - | - |",
        f"| Ray's resident memory (peak summed PSS) | 0 | {med(pss, ' GiB')} | "
        f"| {RAY_MEMORY_LIMIT_GIB:g} GiB |",
        f"| (peak summed RSS: shared pages once per process) | 0 | {med(rss, ' GiB')} | | |",
        "",
    ]
    return lines
