"""The soak (checks/soak.py): the growth of each process between reads while it stays the same
process (:func:`cycle_growth`), and the verdict (:func:`evaluate`) fed figures: growth beyond the
bound fails naming the process, the resource and every cycle's figure; a wrong answer after a
restart fails; an unreadable figure is NOT RUN; a healthy soak passes. The reading of a real
process tree (runtime/proc_usage.py) is tested on throwaway children (procs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pd_sessions.checks import soak
from pd_sessions.core import check_registry, known_issues
from pd_sessions.core.results import FAIL, NOT_RUN, PASS, XFAIL, XPASS
from pd_sessions.runtime.proc_usage import Unreadable, tree_usage
from pd_sessions.runtime.process import Running

LIMITS = soak.bounds(check_registry.BY_NAME["soak"].options)
PASSED_STEP = {"parity": PASS, "parity_message": "ok", "kv_digest": PASS, "kv_digest_message": "ok"}


def read(pid, fds=100, threads=20, rss=500.0, kv=0.0, router=False):
    r = {"pid": pid, "fds": fds, "threads": threads, "rss_mib": rss}
    return r if router else {**r, "kv_blocks": kv}


def healthy_samples(k, *, decode_fds=100, prefill_rss=500.0, router_threads=8, prefill_kv=0.0):
    """One cycle's reads: before, after the prefill's restart, after the decode's (PIDs change at
    each one's restart); the survivors' figures as given."""
    p_old, p_new, d_old, d_new = 10 * k, 10 * k + 1, 10 * k + 2, 10 * k + 3
    before = {
        "prefill-0": read(p_old),
        "decode-0": read(d_old),
        "router": read(7, threads=8, router=True),
    }
    mid = {
        "prefill-0": read(p_new),
        "decode-0": read(d_old, fds=decode_fds),
        "router": read(7, threads=router_threads, router=True),
    }
    after = {
        "prefill-0": read(p_new, rss=prefill_rss, kv=prefill_kv),
        "decode-0": read(d_new),
        "router": read(7, threads=router_threads, router=True),
    }
    return [before, mid, after]


def cycle(k, samples, steps=None):
    growth, unread = soak.cycle_growth(samples)
    steps = steps or [
        {"restarted": "prefill-0", "error": None, "ready_s": 20.0, "pd_back_s": 21.0, **PASSED_STEP},
        {"restarted": "decode-0", "error": None, "ready_s": 20.0, "pd_back_s": 21.0, **PASSED_STEP},
    ]
    return {"cycle": k, "growth": growth, "unreadable": unread, "steps": steps, "seconds": 45.0}


def test_growth_counts_only_while_a_process_stays_the_same():
    growth, unread = soak.cycle_growth(healthy_samples(1, decode_fds=103, prefill_rss=520.0))
    assert unread == []
    # the decode lived through the prefill's restart, the prefill through the decode's
    assert growth["decode-0"] == {"fds": 3.0, "threads": 0.0, "rss_mib": 0.0, "kv_blocks": 0.0}
    assert growth["prefill-0"]["rss_mib"] == 20.0
    assert growth["router"] == {"fds": 0.0, "threads": 0.0, "rss_mib": 0.0}


def test_a_healthy_soak_passes_with_its_figures():
    r = soak.evaluate([cycle(k, healthy_samples(k)) for k in (1, 2, 3)], planned=3, limits=LIMITS)
    assert r.verdict == PASS, r.message
    assert r.message.startswith("3 cycles of restarts in place (prefill-0, decode-0 each)")
    assert r.tables[0].title.startswith("growth per cycle")
    assert len(r.tables[0].rows) == 9 and len(r.tables[1].rows) == 6


@pytest.mark.parametrize(
    ("grow", "process", "resource", "figures"),
    [
        ({"decode_fds": 112}, "decode-0", "fds", "+12, +12, +12"),
        ({"router_threads": 20}, "router", "threads", "+12, +12, +12"),
        ({"prefill_rss": 700.0}, "prefill-0", "rss_mib", "+200, +200, +200"),
        ({"prefill_kv": 1.0}, "prefill-0", "kv_blocks", "+1, +1, +1"),
    ],
)
def test_growth_beyond_the_bound_fails_naming_the_process_the_resource_and_each_cycle(
    grow, process, resource, figures
):
    r = soak.evaluate([cycle(k, healthy_samples(k, **grow)) for k in (1, 2, 3)], planned=3, limits=LIMITS)
    assert r.verdict == FAIL
    assert f"{process} {resource} grew" in r.message
    assert f"per cycle: {figures})" in r.message
    assert f"bound {LIMITS[resource]:g}" in r.message


def test_a_one_off_allocation_within_the_mean_passes_and_a_steady_leak_of_the_same_total_fails():
    """The bound is on the mean per cycle: a single +5 fds in one of 3 cycles (mean 1.7) is within
    2; a steady +3 a cycle (the NIXL decode's, per prefill restart) is not."""
    one_off = [cycle(1, healthy_samples(1, decode_fds=105)), *(cycle(k, healthy_samples(k)) for k in (2, 3))]
    assert soak.evaluate(one_off, planned=3, limits=LIMITS).verdict == PASS
    steady = [cycle(k, healthy_samples(k, decode_fds=103)) for k in (1, 2, 3)]
    r = soak.evaluate(steady, planned=3, limits=LIMITS)
    assert (
        r.verdict == FAIL and "decode-0 fds grew +3 per cycle (bound 2; per cycle: +3, +3, +3)" in r.message
    )


def test_the_nixl_decodes_sockets_per_prefill_restart_read_xfail_through_their_known_issue():
    """nixl-remove-remote-agent-keeps-endpoints: only the decodes' fds beyond the bound, nothing else
    broken, is XFAIL citing the link; the prefill's fds, or a wrong answer besides, stay FAIL."""
    issue = next(k for k in known_issues.load() if k.id == "nixl-remove-remote-agent-keeps-endpoints")
    assert issue.applies("soak", connector="nixl", platform="cpu")
    decode_leak = [cycle(k, healthy_samples(k, decode_fds=103)) for k in (1, 2, 3)]
    r = known_issues.judge(soak.evaluate(decode_leak, planned=3, limits=LIMITS), issue, "1.5.1")
    assert r.verdict == XFAIL and "https://github.com/ai-dynamo/nixl/issues/2025" in r.message
    prefill_leak = [cycle(k, healthy_samples(k, decode_fds=103, prefill_rss=530.0)) for k in (1, 2, 3)]
    r = known_issues.judge(soak.evaluate(prefill_leak, planned=3, limits=LIMITS), issue, "1.5.1")
    assert r.verdict == FAIL
    healthy = [cycle(k, healthy_samples(k)) for k in (1, 2, 3)]
    assert (
        known_issues.judge(soak.evaluate(healthy, planned=3, limits=LIMITS), issue, "1.5.1").verdict == XPASS
    )


def test_parity_wrong_after_a_restart_fails_naming_the_cycle_and_the_restart():
    steps = [
        {"restarted": "prefill-0", "error": None, **PASSED_STEP},
        {
            "restarted": "decode-0",
            "error": None,
            **PASSED_STEP,
            "parity": FAIL,
            "parity_message": "prompt 2 differs at token 0",
        },
    ]
    cycles = [cycle(1, healthy_samples(1)), cycle(2, healthy_samples(2), steps)]
    r = soak.evaluate(cycles, planned=2, limits=LIMITS)
    assert r.verdict == FAIL
    assert "cycle 2: decode-0 restarted, then parity FAIL: prompt 2 differs at token 0" in r.message


def test_a_digest_failure_or_a_failed_restart_fails():
    bad_digest = [{"restarted": "prefill-0", "error": None, **PASSED_STEP, "kv_digest": FAIL}]
    r = soak.evaluate([cycle(1, healthy_samples(1), bad_digest)], planned=1, limits=LIMITS)
    assert r.verdict == FAIL and "kv_digest FAIL" in r.message
    no_start = [{"restarted": "decode-0", "error": "did not start again in place: exited 1"}]
    r = soak.evaluate([cycle(1, healthy_samples(1)[:1], no_start)], planned=3, limits=LIMITS)
    assert r.verdict == FAIL and "cycle 1: decode-0: did not start again in place" in r.message


def test_an_instance_that_outlives_its_sigkill_is_not_run_invalid_never_pass():
    undead = [{"restarted": "prefill-0", "error": "x", "undead": "not restarted: the SIGKILL did not end it"}]
    r = soak.evaluate([cycle(1, healthy_samples(1)[:1], undead)], planned=3, limits=LIMITS)
    assert r.verdict == NOT_RUN
    assert r.message == "invalid: cycle 1: prefill-0 not restarted: the SIGKILL did not end it"


def test_fewer_cycles_than_planned_without_a_reason_fails():
    r = soak.evaluate([cycle(1, healthy_samples(1))], planned=3, limits=LIMITS)
    assert r.verdict == FAIL and "1 of 3 cycles ran" in r.message


def test_an_unreadable_figure_is_not_run_with_its_reason_never_pass():
    samples = healthy_samples(1)
    samples[2]["decode-0"] = {"pid": 13, "unreadable": "KV blocks of decode-0: /metrics: connection refused"}
    r = soak.evaluate([cycle(1, samples)], planned=1, limits=LIMITS)
    assert r.verdict == NOT_RUN
    assert "cycle 1: KV blocks of decode-0: /metrics: connection refused" in r.message


def test_parity_or_digest_that_could_not_look_is_not_run():
    steps = [{"restarted": "prefill-0", "error": None, **PASSED_STEP, "kv_digest": NOT_RUN}]
    r = soak.evaluate([cycle(1, healthy_samples(1), steps)], planned=1, limits=LIMITS)
    assert r.verdict == NOT_RUN and "kv_digest after prefill-0's restart NOT RUN" in r.message


def test_growth_beyond_the_bound_fails_even_when_another_figure_is_unreadable():
    samples = healthy_samples(1, decode_fds=150)
    samples[2]["router"] = {"pid": 7, "unreadable": "fds/threads/RSS of router: AccessDenied"}
    r = soak.evaluate([cycle(1, samples)], planned=1, limits=LIMITS)
    assert r.verdict == FAIL and "decode-0 fds grew +50" in r.message


def test_the_soak_is_opt_in_and_needs_the_digest_after_it():
    info = check_registry.BY_NAME["soak"]
    assert not info.default and info.requires == ("kv_digest",)
    names = check_registry.NAMES
    assert names.index("soak") < names.index("kv_digest")
    with pytest.raises(Exception, match="soak needs kv_digest after it"):
        check_registry.resolve(["smoke", "soak"])
    assert LIMITS["kv_blocks"] == 0.0


# ------------------------------------------------------------ reading a real process tree


def _running(p: subprocess.Popen, tmp_path: Path, node=None) -> Running:
    return Running(
        name="prefill-0", popen=p, log_path=tmp_path / "x.log", started_at=time.monotonic(), node=node
    )


@pytest.mark.procs
def test_a_process_trees_fds_threads_and_rss_are_summed_over_its_children(tmp_path):
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "files = [open('/dev/null') for _ in range(20)]\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        u = tree_usage(_running(p, tmp_path))
        assert u.processes == 2
        assert u.fds >= 20 + 3  # the parent's 20 files at least, and the child's own
        assert u.threads >= 2 and u.rss_mib > 1
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    with pytest.raises(Unreadable, match=r"prefill-0 \(pid \d+\)"):
        tree_usage(_running(p, tmp_path))


def test_a_process_on_another_host_is_unreadable_naming_it(tmp_path):
    class Handle:
        pid = 1

    with pytest.raises(Unreadable, match="prefill-0 runs on host2"):
        tree_usage(_running(Handle(), tmp_path, node="host2"))  # type: ignore[arg-type]


# ------------------------------------------------------------ nox -s soak and pd-sessions soak


def test_the_soak_session_takes_cycles_and_runs_the_soak_command_over_nixl():
    from test_nox_support import FakeSession, stopped

    from pd_sessions.env import nox_support

    session = FakeSession(["--cycles", "5", "--dry-run", "--grace", "3"], name="soak")
    nox_support.soak(session)
    ((argv, _),) = session.ran("-m", "pd_sessions", "soak")
    assert argv[argv.index("soak") :] == ("soak", "nixl_sweep", "--cycles", "5", "--dry-run", "--grace", "3")
    for bad in (["--cycles"], ["--cycles", "0"], ["--cycles", "x"]):
        session = FakeSession(bad, name="soak")
        assert stopped(nox_support.soak, session) == 2
        assert "--cycles: give the number of restart cycles, 1 or more" in session.logged
        assert session.of("run") == []


def test_the_soak_command_is_a_sweep_of_smoke_soak_and_kv_digest_with_its_cycles():
    from pd_sessions import cli
    from pd_sessions.core.errors import UsageError
    from pd_sessions.run import soak_command as soak_run

    args = cli._parser().parse_args(["soak", "--cycles", "4", "--grace", "3"])
    got = soak_run.soak_args(args)
    assert got.sweep == "nixl_sweep" and got.only == ["1x1"]
    assert got.set_fields == ['checks=["smoke", "soak", "kv_digest"]', "check_options.soak.cycles=4"]
    assert str(got.results_dir).startswith("results/soak-") and got.strict is True
    own = cli._parser().parse_args(["soak", "--set", 'checks=["soak", "kv_digest"]', "--only", "2x2"])
    got = soak_run.soak_args(own)
    assert got.set_fields == ['checks=["soak", "kv_digest"]', "check_options.soak.cycles=3"]
    assert got.only == ["2x2"]
    with pytest.raises(UsageError, match="--cycles 0: give 1 or more"):
        soak_run.soak_args(cli._parser().parse_args(["soak", "--cycles", "0"]))


def test_the_printed_report_has_the_per_cycle_table_the_means_against_the_bounds_and_the_verdict():
    from pd_sessions.run.soak_command import report_lines

    r = soak.evaluate(
        [cycle(k, healthy_samples(k, decode_fds=112)) for k in (1, 2)], planned=2, limits=LIMITS
    )
    lines = report_lines([{"name": "1x1", "checks": [r.to_dict()]}, {"name": "2x2", "outcome": "error"}])
    text = "\n".join(lines)
    assert "1x1: growth per cycle, of each process while it stayed the same" in text
    assert any(line.split()[:3] == ["1", "decode-0", "12"] for line in lines)
    assert any(line.split()[:2] == ["bound", "2"] for line in lines)
    assert "1x1: soak FAIL: decode-0 fds grew +12 per cycle (bound 2; per cycle: +12, +12)" in text
    assert "2x2: soak did not run (error: no result)" in text


def test_over_mooncake_the_soak_is_not_run_citing_the_routers_stale_engine_id(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(soak, "component_versions", lambda: {"vllm-router": "0.1.17", "vllm": "0.32.0"})

    def window(connector):
        return SimpleNamespace(
            plan=SimpleNamespace(config=SimpleNamespace(connector=connector), platform="cpu")
        )

    r = soak.restarts_known_broken(window("mooncake"))
    assert r is not None and r.verdict == NOT_RUN
    assert (
        "router-stale-mooncake-engine-id, vllm-router 0.1.17: https://github.com/vllm-project/router/pull/151"
        in (r.message)
    )
    assert soak.restarts_known_broken(window("nixl")) is None
