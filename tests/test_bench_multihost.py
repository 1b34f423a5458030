"""The bench's multihost part (pd_sessions/bench/multihost.py): its summary and table against the
issue's limits, and which processes count as Ray's. (Running it needs the simulated hosts:
`pd-sessions bench --parts multihost`.)"""

from __future__ import annotations

from pd_sessions.bench import multihost


def run(mode, wall, rss=0, ok=True):
    return {"mode": mode, "ok": ok, "wall_s": wall, "ray_rss_bytes": rss}


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
    assert s["ray_rss_gib"]["median"] == round(950 / 1024, 3)
    table = "\n".join(multihost.markdown({"sweep": "mooncake_sweep", "config": "1x1", **s}))
    assert "| wall (whole command) | 62.0 s (60.0-64.0) | 85.0 s (80.0-90.0) | 23.0 s | 30 s |" in table
    assert "| 1.5 GiB |" in table


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
