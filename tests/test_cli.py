"""The CLI as a user runs it (subprocess); nothing here starts vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from pd_sessions.runtime.machine import detect

pytestmark = pytest.mark.procs


def cli(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "pd_sessions", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_dry_run_prints_every_plan_and_launches_nothing():
    r = cli("sweep", "mooncake_sweep", "--dry-run")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    names = ("1x1", "2x2", "1x2", "2x1", "2p1d", "1p2d")
    assert all(f"plan {n}:" in out for n in names)
    # 2 instances in each of the four TP configs, 3 in each xPyD config; one router each
    assert out.count("vllm.entrypoints.openai.api_server") == 4 * 2 + 2 * 3
    assert out.count("vllm_router.launch_router") == len(names)
    assert "nothing was launched" in out and "--kv-connector mooncake" in out


def test_dry_run_only():
    r = cli("sweep", "mooncake_sweep", "--dry-run", "--only", "1x1")
    assert r.returncode == 0 and "plan 1x1" in r.stdout and "plan 2x2" not in r.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (("sweep", "mooncake_sweep", "--bogus"), "unrecognized arguments: --bogus"),
        (("sweep", "mooncake_sweep", "--only", "3x3"), "--only: no config named '3x3'"),
        (("sweep", "mooncake_swep"), 'did you mean "mooncake_sweep"'),
        (("sweep", "mooncake_sweep", "--platform", "tpu"), "invalid choice: 'tpu'"),
    ],
)
def test_bad_arguments_exit_2_naming_the_field(args, needle):
    r = cli(*args)
    assert r.returncode == 2
    assert needle in r.stderr


@pytest.mark.skipif(bool(detect().gpus), reason="this host has GPUs")
def test_cuda_without_gpus_is_refused():
    r = cli("sweep", "mooncake_sweep", "--platform", "cuda", "--dry-run")
    assert r.returncode == 2 and "no GPU is visible" in r.stderr


def test_bad_config_file_exit_2(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('name="bad"\n[defaults]\nmodel="m"\n[[config]]\nname="x"\nprefill_tp=0\n')
    r = cli("sweep", str(p), "--dry-run")
    assert r.returncode == 2 and "prefill_tp: got 0" in r.stderr and str(p) in r.stderr


def test_the_two_bad_inputs_seen_exit_2_before_launch_in_the_projects_words(tmp_path):
    """A path-like --model that does not exist (vLLM would fail 8 s after launch with Hugging
    Face's "Repo id must be in the form ..."), and a sweep file without `model`."""
    r = cli("sweep", "mooncake_sweep", "--platform", "cpu", "--model", "/a/path/that/does/not/exist")
    assert r.returncode == 2 and "--model: '/a/path/that/does/not/exist'" in r.stderr
    assert "does not exist" in r.stderr and "results and logs" not in r.stdout
    p = tmp_path / "no_model.toml"
    p.write_text('name = "x"\n[[config]]\nname = "1x1"\n')
    r = cli("sweep", str(p), "--platform", "cpu")
    assert r.returncode == 2 and f"{p} [[config]] #1: model: missing; every config needs it" in r.stderr
    assert "ClusterConfig" not in r.stderr and "positional" not in r.stderr


def test_kimi_dry_run_prints_the_nightly_plan_anywhere():
    r = cli("sweep", "kimi_linear_nightly", "--dry-run", "--allow-unpinned-remote-code")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "prefill-0: http://127.0.0.1:" in out and "(GPUs 0,1," in out
    assert "decode-0: http://127.0.0.1:" in out and "(GPUs 2,3," in out
    assert "1xD(TP1,DP2+EP)" in out and "--enable-expert-parallel" in out and "--data-parallel-size 2" in out
    assert "revision UNPINNED" in out and "VLLM_SSM_CONV_STATE_LAYOUT=DS" in out
    assert (
        "--mamba-cache-mode align" in out and "--max-model-len 32768" in out and "--trust-remote-code" in out
    )
    assert "--gpu-memory-utilization 0.9" in out and "--kv-connector nixl" in out
    assert "ports: all" in out and "distinct" in out


def test_kimi_unpinned_needs_the_explicit_flag():
    r = cli("sweep", "kimi_linear_nightly", "--dry-run")
    assert r.returncode == 2 and "--allow-unpinned-remote-code" in r.stderr


@pytest.mark.skipif(len(detect().gpus) >= 4, reason="this host has 4 GPUs")
def test_kimi_without_4_gpus_exits_before_starting():
    r = cli("sweep", "kimi_linear_nightly", "--allow-unpinned-remote-code")
    assert r.returncode == 2
    assert "kimi_linear_nightly needs 4 GPUs" in r.stderr and "nothing was started" in r.stderr


def test_overrides_are_visible_in_the_dry_run():
    r = cli(
        "sweep",
        "mooncake_sweep",
        "--dry-run",
        "--only",
        "1x1",
        "--model",
        "tiny-mixtral",
        "--set",
        "block_size=64",
        "--set",
        "attention_backend=CPU_ATTN",
        "--extra-arg=--max-num-seqs=4",
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for line in (
        "override (command line): model = 'tiny-mixtral'",
        "override (command line): block_size = 64",
        "override (command line): extra_args += '--max-num-seqs=4'",
    ):
        assert out.count(line) == 2, line  # banner + plan
    assert "--served-model-name tiny-mixtral" in out and "--block-size 64" in out
    assert "--attention-backend CPU_ATTN" in out
    argv = next(line for line in out.splitlines() if "argv" in line and "api_server" in line)
    assert argv.endswith("--enforce-eager --max-num-seqs=4")  # one argv element, after the config's


def test_bad_override_exits_2_before_anything_starts():
    r = cli("sweep", "mooncake_sweep", "--only", "1x1", "--set", "gpu_memory_utilisation=0.8")
    assert r.returncode == 2
    assert 'gpu_memory_utilisation: unknown field (did you mean "gpu_memory_utilization"?)' in r.stderr
    assert "configs:" not in r.stdout


def test_banner_names_where_vllm_and_the_router_come_from():
    r = cli("sweep", "mooncake_sweep", "--dry-run", "--only", "1x1")
    assert r.returncode == 0, r.stderr
    assert "environment: Python " in r.stdout and "  vllm" in r.stdout and "  vllm_router" in r.stdout


def _nox(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_nox_posargs_are_parsed_by_the_package_parser_before_any_install():
    # a bad override or flag stops the session with exit 2 and installs nothing
    r = _nox("--no-venv", "-s", "mooncake_sweep", "--", "--set", "blok_size=16")
    assert r.returncode == 2 and 'did you mean "block_size"' in r.stderr and "install" not in r.stderr.lower()
    r = _nox("--no-venv", "-s", "mooncake_sweep", "--", "--platform=tpu")
    assert r.returncode == 2 and "invalid choice: 'tpu'" in r.stderr
    # --help prints the sweep's options and installs nothing (also without --no-venv: no venv work)
    r = _nox("--no-venv", "-s", "mooncake_sweep", "--", "--help")
    assert r.returncode == 0 and "--set FIELD=VALUE" in r.stdout and "--extra-arg ARG" in r.stdout
    assert "envfacts" not in r.stderr and "pip" not in r.stderr


def test_known_sweep_names_are_sweeps_only():
    r = cli("sweep", "baselines", "--dry-run")
    assert r.returncode == 2 and "no sweep named 'baselines'" in r.stderr
    known = r.stderr.split("known: ")[1]
    assert "mooncake_sweep" in known and "baselines" not in known


def test_the_generic_sweep_session_takes_a_name_or_a_toml(tmp_path):
    r = _nox("--no-venv", "-s", "sweep", "--", "mooncake_swep")
    assert r.returncode == 2 and 'did you mean "mooncake_sweep"' in r.stderr
    r = _nox("--no-venv", "-s", "sweep")
    assert r.returncode == 2 and "name the sweep first" in r.stderr
    r = _nox(
        "--no-venv", "-s", "sweep", "--", "pd_sessions/configs/nixl_sweep.toml", "--dry-run", "--only", "1x1"
    )
    assert r.returncode == 0, r.stderr
    assert "plan 1x1" in r.stdout and "--kv-connector nixl" in r.stdout


def test_commands_with_their_own_parser_get_the_rest_of_the_line():
    """bench and wheelhouse parse their options in their own module (imported when they run)."""
    r = cli("bench", "--help")
    assert r.returncode == 0 and "--parts" in r.stdout and "--router-requests" in r.stdout, r.stderr
    r = cli("bench", "--parts", "nope", "--repeats", "1")
    assert (
        r.returncode == 2
        and "--parts takes router, teardown, clusters, checks, digest, startup, report, multihost, "
        "packing (got nope)"
        in r.stderr
    )
    r = cli("wheelhouse", "--help")
    assert r.returncode == 0 and "--exclude-installed" in r.stdout, r.stderr
    assert "bench-report" in cli("--help").stdout


def test_bench_report_renders_a_results_json_again(tmp_path):
    from helpers.builders import bench_doc

    doc = bench_doc([])
    (tmp_path / "results.json").write_text(json.dumps(doc))
    r = cli("bench-report", str(tmp_path / "results.json"))
    assert r.returncode == 0, r.stderr
    assert str(tmp_path / "results.md") in r.stdout.splitlines()
    assert (tmp_path / "results.md").read_text().startswith("# pd-sessions benchmark (2026-11-29")


def test_bench_report_names_a_missing_file(tmp_path):
    r = cli("bench-report", str(tmp_path / "nope.json"))
    assert r.returncode == 2 and f"{tmp_path / 'nope.json'}: no such file" in r.stderr


# ------------------------------------------------------------------ issue 39's four bad inputs


def test_a_sweep_path_that_is_a_directory_is_refused_naming_the_fix(tmp_path):
    (tmp_path / "mine.toml").write_text("")
    for command in ("sweep", "serve"):
        r = cli(command, str(tmp_path), "--dry-run", "--only", "1x1")
        assert r.returncode == 2, r.stdout + r.stderr
        assert "Traceback" not in r.stderr and "IsADirectoryError" not in r.stderr, r.stderr
        assert f"{tmp_path}: path: is a directory, not a sweep file (it holds mine.toml)" in r.stderr
        assert "give a .toml file's path or a built-in sweep name" in r.stderr


@pytest.mark.parametrize("command", ["sweep", "serve"])
def test_one_simulated_host_is_refused(command):
    """Prefill and decode would share the one host: nothing would cross a link."""
    r = cli(command, "mooncake_sweep", "--only", "1x1", "--simulate-hosts", "1", "--dry-run")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--simulate-hosts: got 1: prefill and decode would share that one host" in r.stderr
    assert "give 2 or more" in r.stderr and "Traceback" not in r.stderr
    r = cli(command, "mooncake_sweep", "--only", "1x1", "--simulate-hosts", "-2", "--dry-run")
    assert r.returncode == 2 and "--simulate-hosts: got -2; give a number of hosts, 2 or more" in r.stderr


@pytest.mark.parametrize("command", ["sweep", "serve"])
def test_allow_loopback_advertise_on_one_host_is_refused(command):
    r = cli(command, "mooncake_sweep", "--only", "1x1", "--allow-loopback-advertise", "--dry-run")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--allow-loopback-advertise has no effect on one host" in r.stderr, r.stderr
    assert "give it with --ray ADDRESS or --simulate-hosts N, or leave it out" in r.stderr


# Runs the CLI in this interpreter, then says which of the modules that make simulated hosts
# (runtime/simhosts.py: the namespaces, links and Ray nodes; Ray) were ever imported: a dry run
# must import neither.
MAKERS_IMPORTED = (
    "import sys; from pd_sessions import cli; rc = cli.main(sys.argv[1:]); "
    "made = sorted(m for m in sys.modules if m in ('pd_sessions.runtime.simhosts', 'ray')); "
    "print('makers imported:', made); sys.exit(rc)"
)


@pytest.mark.parametrize("command", ["sweep", "serve"])
def test_a_dry_run_of_simulated_hosts_makes_nothing_and_plans_their_stated_shape(command):
    """No namespace, no link, no Ray node: the hosts' plan alone (core/simhost_plan.py) gives
    the plan its hosts (host1 prefill, host2 decode, the router on the bridge's address)."""
    netns_dir = "/run/netns"
    before = sorted(os.listdir(netns_dir)) if os.path.isdir(netns_dir) else []
    links_before = sorted(os.listdir("/sys/class/net"))
    argv = [command, "mooncake_sweep", "--only", "1x1", "--platform", "cpu", "--simulate-hosts", "2"]
    r = subprocess.run(
        [sys.executable, "-c", MAKERS_IMPORTED, *argv, "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "makers imported: []" in r.stdout, r.stdout
    assert "2 simulated hosts planned as stated, none made" in r.stdout
    assert "prefill-0: http://198.18.0.1:" in r.stdout, r.stdout
    assert "decode-0: http://198.18.0.2:" in r.stdout
    assert " on host1 (" in r.stdout and " on host2 (" in r.stdout
    assert (sorted(os.listdir(netns_dir)) if os.path.isdir(netns_dir) else []) == before
    assert sorted(os.listdir("/sys/class/net")) == links_before
