"""The bench's multihost part (pd_sessions/bench/multihost.py): its summary and table against the
issue's limits, and which processes count as Ray's. (Running it needs the simulated hosts:
`pd-sessions bench --parts multihost`.)"""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
from helpers.waiting import wait_until

from pd_sessions.bench import multihost


def run(mode, wall, pss=0, ok=True):
    return {"mode": mode, "ok": ok, "wall_s": wall, "ray_pss_bytes": pss, "ray_rss_bytes": 2 * pss}


def test_the_summary_is_the_added_median_wall_and_the_peak_ray_memory():
    runs = [
        run("one_host", 60.0),
        run("two_hosts", 80.0, 900 * 2**20),
        run("one_host", 64.0),
        run("two_hosts", 90.0, 1000 * 2**20),
        run("two_hosts", 10.0, 1, ok=False),  # a failed run counts nowhere
    ]
    s = multihost.summarize(runs)
    assert s["added_wall_s"] == 85.0 - 62.0
    assert s["ray_pss_gib"]["median"] == round(950 / 1024, 3)
    assert s["ray_rss_gib"]["median"] == round(1900 / 1024, 3)
    table = "\n".join(multihost.markdown({"sweep": "mooncake_sweep", "config": "1x1", **s}))
    assert "| wall (whole command) | 62.0 s (60.0-64.0) | 85.0 s (80.0-90.0) | 23.0 s | 30 s |" in table
    assert "| Ray's resident memory (peak summed PSS) | 0 | 0.9 GiB (0.9-1.0) | | 1.5 GiB |" in table
    assert "| (peak summed RSS: shared pages once per process) | 0 | 1.9 GiB (1.8-2.0) | | |" in table


@pytest.mark.procs
def test_the_sampler_counts_shared_pages_once_pss_below_the_summed_rss():
    """Real processes: a parent and two Python children taken for Ray's (the marker in their
    argv); the same interpreter's pages are shared, so their summed PSS is below their summed RSS.
    The parent (not Ray's: its argv spells the marker in two pieces) counts in neither."""
    child = "[sys.executable, '-c', 'import time; time.sleep(60) # ' + 'ray/' + '_private']"
    code = f"import subprocess, sys, time; cs = [subprocess.Popen({child}) for _ in range(2)]; time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    me = psutil.Process(parent.pid)
    try:
        wait_until(lambda: len(me.children()) == 2, 20, "the two children")
        assert multihost.is_ray(me.children()[0].cmdline()) and not multihost.is_ray(me.cmdline())
        sampler = multihost.RaySampler(parent.pid)
        wait_until(lambda: sampler.peak_rss > 0, 20, "a sample")
        pss, rss = sampler.close()
        one = max(c.memory_info().rss for c in me.children())
        assert 0 < pss < rss <= 2 * one + 2**20, (pss, rss, one)
    finally:
        kids = me.children()
        for p in [me, *kids]:
            p.kill()
        psutil.wait_procs([me, *kids], timeout=10)


def test_without_runs_of_a_mode_nothing_is_added():
    s = multihost.summarize([run("two_hosts", 80.0, 5)])
    assert s["added_wall_s"] is None
    assert "| wall (whole command) | - | - | - | - |" in "\n".join(
        multihost.markdown({"sweep": "s", "config": "c", **s})
    )


def test_ray_processes_are_told_from_the_harness_and_vllm():
    assert multihost.is_ray(["/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet", "--x"])
    assert multihost.is_ray(["ray::NodeAgent.spawn"])
    assert multihost.is_ray(["/py", "-m", "ray.scripts.scripts", "start", "--head"])
    assert not multihost.is_ray(["/py", "-m", "pd_sessions", "sweep", "x", "--ray", "auto"])
    assert not multihost.is_ray(["/py", "-m", "vllm.entrypoints.openai.api_server", "--model", "ray"])
