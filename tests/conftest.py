"""The suite's fixtures (pytest finds this file at the rootdir's tests/; nothing imports it): the
shared end-to-end runs on real vLLM and the simulated hosts. Helpers are in tests/helpers/."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import USER, ci_summary
from helpers.cli_runs import environment_facts, nox_no_venv
from helpers.e2e_runs import (
    FAULTY_SWEEP,
    LOOPBACK_CASES,
    MOONCAKE_FAULTS,
    NIXL_FAULTS,
    NO_DIGEST,
    SOAK_CYCLES,
    WIRE,
    WIRE_LOSS_RATES,
    SweepRun,
    e2e_dir,
    rehearsal,
    simhosts_leftovers,
    start_rehearsal,
    sweep_once,
)
from helpers.needs import needs, no_skip_in_unit_tier, simhosts_available


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """`nox -s unit` (PD_SESSIONS_UNIT_TIER=1): a skip fails (helpers.needs.no_skip_in_unit_tier)."""
    outcome = yield
    no_skip_in_unit_tier(outcome.get_result())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The verdicts worth seeing in a CI log even when their tests pass (helpers.ci_summary)."""
    lines = config.stash.get(ci_summary.LINES, [])
    if lines:
        terminalreporter.section("judged in this run")
        for line in lines:
            terminalreporter.write_line(line)


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


@pytest.fixture(scope="session")
def mooncake_sweep(tmp_path_factory) -> SweepRun:
    """The built-in Mooncake sweep's 1x1, every default check and the fault scenarios of
    MOONCAKE_FAULTS (the connectors wrapped by the fault injector), then kv_digest (the KV
    digest of every request before it: test_e2e_kv_digest) and hostile_clients, last (client-made
    kv_transfer_params: test_e2e_hostile_clients), through `nox --no-venv` on
    this (hand-prepared) environment as vLLM's CI runs it, with the user's passing test files
    (`--pytest`: an env-style file and a pd_cluster-fixture file) against its cluster, after the
    faults. Shared by test_e2e_cpu_lane (all checks pass, nothing installed, nothing
    left), test_e2e_user_commands (the user's files pass against the sweep's cluster) and
    test_e2e_faults (every scenario keeps its promise)."""
    needs("vllm")
    needs("mooncake.engine")
    needs("openai")
    tmp = e2e_dir(tmp_path_factory, "mooncake_nox")
    results = tmp / "r"
    before = environment_facts(tmp)["installed"]
    run = sweep_once(
        results,
        argv=nox_no_venv(
            sys.executable,
            "--only",
            "1x1",
            "--results-dir",
            str(results),
            "--check",
            MOONCAKE_FAULTS,
            "--check",
            "kv_digest",
            "--check",
            "hostile_clients",
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
    lane; CI runs it once, here), the fault scenarios of NIXL_FAULTS, the soak (SOAK_CYCLES restart cycles:
    test_e2e_soak), kv_digest and hostile_clients (last), through the CLI, serving
    the remote-code tiny model (trust_remote_code: vLLM and lm_eval load its own classes) with
    margin-mode parity forced (auto would pick exact on the CPU lane; exact parity on a healthy
    pair is the Mooncake sweep's) and kv_load_failure_policy "recompute" (the Mooncake run keeps
    vLLM's default, "fail": the drop scenario sees both). Shared by test_e2e_cpu_lane (all checks
    pass, nothing left), test_e2e_nightly (remote code, margin parity passes on a healthy pair,
    NIXL evidence), test_e2e_perf (its figures) and test_e2e_faults."""
    needs("vllm")
    needs("nixl._api")
    results = e2e_dir(tmp_path_factory, "nixl") / "r"
    return sweep_once(
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
            "--check",
            "soak",
            "--set",
            f"check_options.soak.cycles={SOAK_CYCLES}",
            "--check",
            "kv_digest",
            "--check",
            "hostile_clients",
            "--results-dir",
            str(results),
        ),
    )


@pytest.fixture(scope="session")
def nixl_push_sweep(tmp_path_factory) -> SweepRun:
    """The NIXL push sweep's 1x1 (NixlPushConnector: the third connector, one module,
    pd_sessions/core/connectors/nixl_push.py) through the session the noxfile makes from its spec
    (`nox --no-venv -s nixl_push_sweep`), every default check but accuracy: lm_eval's import and
    24 samples took 47 s of 59 s of checks on a loaded host (docs/cpu-lane.md, "NIXL push mode":
    every default check passed in runs of their own); push's KV path is what smoke, parity,
    kv_transfer, request_features, cache_paths and burst send through it."""
    needs("vllm")
    needs("nixl._api")
    results = e2e_dir(tmp_path_factory, "nixl_push") / "r"
    argv = nox_no_venv(
        sys.executable,
        "--only",
        "1x1",
        "--skip-check",
        "accuracy",
        "--results-dir",
        str(results),
        session="nixl_push_sweep",
    )
    return sweep_once(results, argv=argv)


@pytest.fixture(scope="session")
def preemption_sweep(tmp_path_factory) -> SweepRun:
    """The built-in preemption sweep's 1x1 (Mooncake): a decode with 8 KV blocks of 32 tokens
    under a burst that needs about 24, checks smoke and preemption (issue 27)."""
    needs("vllm")
    needs("mooncake.engine")
    results = e2e_dir(tmp_path_factory, "preemption") / "r"
    return sweep_once(
        results, args=("sweep", "preemption", "--platform", "cpu", "--results-dir", str(results))
    )


@pytest.fixture(scope="session")
def faulty_sweep(tmp_path_factory) -> SweepRun:
    """FAULTY_SWEEP run once with a failing user command (`--exec` with {junitxml}); shared by
    test_e2e_cpu_lane (silent recompute, accuracy vs another seed), test_e2e_nightly (margin
    parity) and test_e2e_user_commands (a failing user command)."""
    needs("vllm")
    needs("mooncake.engine")
    needs("openai")
    tmp = e2e_dir(tmp_path_factory, "faulty")
    toml = tmp / "faulty.toml"
    toml.write_text(FAULTY_SWEEP)
    failing = f"{sys.executable} -m pytest {USER / 'pd_fails_on_purpose.py'} --junitxml {{junitxml}}"
    results = tmp / "r"
    return sweep_once(
        results,
        args=("sweep", str(toml), "--platform", "cpu", "--results-dir", str(results), "--exec", failing),
    )


@pytest.fixture(scope="session")
def simulated_hosts_2(tmp_path_factory):
    """Two simulated hosts (``--simulate-hosts 2``: host1 and host2, each a network namespace
    with its own address, loopback, core share and Ray node; the Ray head on the bridge),
    shared by every test that asks for it. Yields runtime.simhosts.SimulatedHosts. A test may
    connect this process to it as the driver (``ray.init(**sim.ray_init_kwargs())``, once);
    the fixture disconnects before it removes the hosts, then asserts nothing of them is left."""
    simhosts_available()
    from pd_sessions.runtime.simhosts import simulated_hosts

    with simulated_hosts(2, tmp_path_factory.mktemp("simhosts"), say=print) as sim:
        pids = [r.pid for r in sim.processes]
        yield sim
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    assert simhosts_leftovers(sim.run_id, pids) == []


@pytest.fixture(scope="session")
def loopback_runs(simulated_hosts_2, tmp_path_factory) -> dict[str, SweepRun]:
    """Both loopback can-fail rehearsals (LOOPBACK_CASES, with --allow-loopback-advertise), run at
    the same time on the shared hosts: each spends most of its wall waiting (for its instances'
    start, then for a P/D path that cannot work), so together they take little more than one.
    sweep -> its finished run."""
    needs("nixl._api")
    needs("mooncake.engine")
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
    wire faults (WIRE); kv_digest left out (NO_DIGEST)."""
    needs("mooncake.engine")
    rates = ", ".join(map(str, WIRE_LOSS_RATES["hosts_mooncake"]))
    loss = ("--set", f"check_options.wire_loss.rates=[{rates}]")
    return rehearsal(tmp_path_factory, simulated_hosts_2, "mooncake_sweep", *WIRE, *loss, *NO_DIGEST)


@pytest.fixture(scope="session")
def hosts_nixl(simulated_hosts_2, tmp_path_factory) -> SweepRun:
    """The NIXL sweep's 1x1 across the two simulated hosts, every default check, then the wire
    faults (WIRE); kv_digest left out (NO_DIGEST)."""
    needs("nixl._api")
    return rehearsal(tmp_path_factory, simulated_hosts_2, "nixl_sweep", *WIRE, *NO_DIGEST)
