"""--exec/--pytest, serve and the pd_cluster plugin: the pure parts, the CLI's refusals before
launch, and the live behaviour against the throwaway fake stack (pd_sessions/data/fake_stack: the
harness's own handling is under test; real vLLM runs are in test_e2e_user_commands.py)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest
from helpers import ROOT, USER
from helpers.builders import CPU2, GPUS4, cfg, plan
from helpers.fake_runs import FakeSweep, assert_nothing_left, fake_stack_env, fake_sweep_toml
from helpers.procs import gone
from helpers.waiting import wait_until, within

from pd_sessions.core.errors import UsageError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.results import FAIL, PASS, ConfigResult
from pd_sessions.pytest_plugin import parse_spec
from pd_sessions.report.writers import write_junit
from pd_sessions.run import serve
from pd_sessions.run import user_commands as uc
from pd_sessions.runtime import clusterenv

LIVE = pytest.mark.usefixtures("bystander")


def found(name):
    return f"/usr/bin/{name}"


# --- parsing and validation (pure) ---------------------------------------------------------


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "empty command"),
        ("   ", "empty command"),
        ("python -c 'unbalanced", "cannot split it into words"),
    ],
)
def test_bad_exec_text_is_refused(text, needle):
    with pytest.raises(UsageError, match=needle):
        uc.parse_exec(text, 0, which=found)


def test_missing_executable_is_named():
    with pytest.raises(UsageError, match="executable 'no-such-tool' not found on PATH"):
        uc.parse_exec("no-such-tool --flag", 0, which=lambda name: None)


def test_a_path_that_is_not_executable_is_named(tmp_path):
    f = tmp_path / "script.sh"
    f.write_text("echo hi\n")
    with pytest.raises(UsageError, match="is not an executable file"):
        uc.parse_exec(f"{f} arg", 0)


def test_exec_is_split_like_a_shell_but_keeps_metacharacters_as_words():
    c = uc.parse_exec("""pytest -k 'a and b' x.py; rm -rf / --junitxml={junitxml}""", 3, which=found)
    assert c.argv == ("pytest", "-k", "a and b", "x.py;", "rm", "-rf", "/", "--junitxml={junitxml}")
    assert c.name == "exec[3]" and c.log_name == "exec-3.log"


def test_from_cli_keeps_command_line_order_and_builds_pytest_argv(tmp_path):
    t = tmp_path / "test_x.py"
    t.write_text("")
    cmds = uc.from_cli(
        ["echo hi", [str(t), f"{t}::test_one"]],
        python="/venv/python",
        dry_run=False,
        have_pytest=True,
        which=found,
    )
    assert [c.name for c in cmds] == ["exec[0]", "exec[1]"]
    assert cmds[1].argv[:5] == ("/venv/python", "-m", "pytest", "-p", "pd_sessions.pytest_plugin")
    assert cmds[1].argv[-3:] == (str(t), f"{t}::test_one", "--junitxml={junitxml}")


@pytest.mark.parametrize(
    "items,kw,needle",
    [
        (["echo hi"], {"dry_run": True}, "--dry-run launches none"),
        ([["tests/no_such_file.py"]], {}, "no_such_file.py: no such file"),
        ([["tests/conftest.py"]], {"have_pytest": False}, "pytest is not installed for /venv/python"),
    ],
)
def test_from_cli_refusals(items, kw, needle):
    args = {"python": "/venv/python", "dry_run": False, "have_pytest": True, **kw}
    with pytest.raises(UsageError, match=needle):
        uc.from_cli(items, which=found, **args)


def test_nothing_given_is_no_command():
    assert uc.from_cli(None, python="p", dry_run=True, have_pytest=False) == ()


# --- what a command is told (pure) ---------------------------------------------------------


def test_env_and_description_of_a_2p2d_cpu_plan():
    c = cfg("2p2d", connector="nixl", num_prefill=2, num_decode=2)
    cluster = plan(c, Inventory(gpus=(), cpus=(0, 1, 2, 3)), platform="cpu")
    env = clusterenv.cluster_env(cluster, Path("/r/cluster.json"))
    p, d = cluster.prefill, cluster.decode
    assert env["PREFILL_PORT"] == str(p[0].port) and env["DECODE_PORT"] == str(d[0].port)
    assert env["PREFILL_PORTS"] == f"{p[0].port},{p[1].port}"
    assert env["DECODE_PORTS"] == f"{d[0].port},{d[1].port}"
    assert env["PROXY_HOST"] == "127.0.0.1" and env["PROXY_PORT"] == str(cluster.router.port)
    assert env["TEST_MODEL"] == "m" and env["BLOCK_SIZE"] == "128"
    assert env["PD_SESSIONS_CLUSTER"] == "/r/cluster.json" and set(env) <= set(clusterenv.ENV_NAMES)
    info = clusterenv.describe(cluster)
    json.dumps(info)  # serialisable as is
    assert info["connector"] == "nixl" and info["router"]["url"] == cluster.router.url
    assert [x["kv_transfer_config"]["kv_role"] for x in info["prefill"] + info["decode"]] == [
        "kv_producer"
    ] * 2 + ["kv_consumer"] * 2
    assert info["prefill"][1]["cpu_bind"] == p[1].cpu_bind
    assert info["decode"][0]["metrics_url"] == f"{d[0].url}/metrics"


def test_block_size_is_only_set_when_the_plan_sets_it():
    cluster = plan(cfg(), GPUS4, platform="cuda")
    assert "BLOCK_SIZE" not in clusterenv.cluster_env(
        cluster
    ) and "PD_SESSIONS_CLUSTER" not in clusterenv.cluster_env(cluster)
    assert clusterenv.describe(cluster)["prefill"][0]["gpus"] == ["0"]
    cluster = plan(cfg(block_size=64), GPUS4, platform="cuda")
    assert clusterenv.cluster_env(cluster)["BLOCK_SIZE"] == "64"


def test_export_lines_quote_for_a_shell():
    assert clusterenv.export_lines({"A": "1", "B": "x y'z"}) == ["export A=1", "export B='x y'\"'\"'z'"]


def test_serve_banner_has_urls_exports_and_a_request(tmp_path):
    cluster = plan(cfg(), CPU2, platform="cpu")
    lines = serve.banner(cluster, clusterenv.cluster_env(cluster), tmp_path)
    text = "\n".join(lines)
    assert cluster.router.url in text and cluster.prefill[0].url in text and cluster.decode[0].url in text
    assert f"export PROXY_PORT={cluster.router.port}" in lines
    assert f"curl -s {cluster.router.url}/v1/completions" in text and '"model": "m"' in text


# --- verdicts and JUnit (pure) -------------------------------------------------------------

CMD = uc.UserCommand(index=1, argv=("pytest", "x.py"), given="pytest x.py")


def verdict(**kw):
    args = {
        "returncode": 0,
        "seconds": 1.0,
        "timed_out": False,
        "timeout_s": 60,
        "log_path": Path("/r/exec-1.log"),
        "log_tail": "last line",
        "junit": None,
    }
    return uc.evaluate(CMD, **{**args, **kw})


def test_evaluate_decision_table():
    assert verdict().verdict == PASS and "exit status 0" in verdict().message
    r = verdict(returncode=3)
    assert r.verdict == FAIL and "exit status 3" in r.message and "last line" in r.message
    r = verdict(returncode=None, timed_out=True)
    assert r.verdict == FAIL and "did not finish within 60 s" in r.message and r.name == "exec[1]"
    r = verdict(returncode=None, dead="decode-0 (http://x) exited with status 9 while exec[1] ran")
    assert r.verdict == FAIL and r.message.startswith("decode-0 (http://x) exited")
    junit = {"tests": 2, "failures": 1, "errors": 0, "skipped": 0, "first_failure": "m::t: boom", "path": "j"}
    r = verdict(returncode=1, junit=junit)
    assert "2 tests: 1 failed" in r.message and "first failure: m::t: boom" in r.message


JUNIT = """<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="t.mod" name="test_ok" time="0.1"/>
<testcase classname="t.mod" name="test_bad">
<failure message="AssertionError: router said 'x'&#10;second line">trace</failure></testcase>
<testcase classname="t.mod" name="test_skip"><skipped message="no"/></testcase>
</testsuite></testsuites>"""


def test_junit_summary_and_merge_into_ours(tmp_path):
    j = tmp_path / "exec-0.junit.xml"
    j.write_text(JUNIT)
    s = uc.junit_summary(j)
    assert (s["tests"], s["failures"], s["errors"], s["skipped"]) == (3, 1, 0, 1)
    assert s["first_failure"] == "t.mod::test_bad: AssertionError: router said 'x'"
    assert uc.junit_summary(tmp_path / "absent.xml") is None
    (tmp_path / "bad.xml").write_text("<not xml")
    assert uc.junit_summary(tmp_path / "bad.xml") is None

    check = verdict(returncode=1, junit=s)
    check.name = "exec[0]"
    r = ConfigResult(
        name="1x1", shape="s", connector="nixl", platform="cpu", checks=[check], run_dir=str(tmp_path)
    )
    r.decide(["exec[0]"])
    path = write_junit([r], tmp_path / "junit.xml", suite="sw", expected_checks=["exec[0]"])
    root = ET.parse(path).getroot()
    cases = {(c.get("classname"), c.get("name")): c for c in root.iter("testcase")}
    assert set(cases) == {
        ("sw.1x1", "exec[0]"),
        ("sw.1x1.exec[0].t.mod", "test_ok"),
        ("sw.1x1.exec[0].t.mod", "test_bad"),
        ("sw.1x1.exec[0].t.mod", "test_skip"),
    }
    assert "router said 'x'" in cases[("sw.1x1.exec[0].t.mod", "test_bad")].find("failure").get("message")
    suite = root.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("4", "2", "1")


def test_plugin_cluster_spec():
    assert parse_spec("nixl_sweep:1x1") == ("nixl_sweep", "1x1")
    assert parse_spec(("a.toml", "2x2")) == ("a.toml", "2x2")
    with pytest.raises(pytest.UsageError, match="give SWEEP:CONFIG"):
        parse_spec("nixl_sweep")


# --- the CLI refuses before launching -------------------------------------------------------


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "pd_sessions", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.procs
@pytest.mark.parametrize(
    "args,needle",
    [
        (("sweep", "mooncake_sweep", "--dry-run", "--exec", "echo hi"), "--dry-run launches none"),
        (
            ("sweep", "mooncake_sweep", "--exec", "no-such-tool-xyz"),
            "executable 'no-such-tool-xyz' not found",
        ),
        (("sweep", "mooncake_sweep", "--exec", ""), "empty command"),
        (("sweep", "mooncake_sweep", "--pytest", "tests/no_such_test.py"), "no such file or directory"),
        (("sweep", "mooncake_sweep", "--exec", "echo", "--exec-timeout", "0"), "--exec-timeout: got 0"),
        (("serve", "mooncake_sweep"), "serve starts one config: name it with --only"),
        (("serve", "mooncake_sweep", "--exec", "echo"), "unrecognized arguments: --exec"),
    ],
)
def test_bad_input_exits_2_before_launch(args, needle):
    r = cli(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr
    assert "started" not in r.stdout


# --- live, against the fake stack ------------------------------------------------------------


@pytest.mark.procs
@LIVE
def test_hanging_command_is_stopped_at_the_timeout_with_its_children(tmp_path):
    hang = (
        f'{sys.executable} -c "import subprocess, sys, time; '
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open('{tmp_path}/child', 'w').write(str(p.pid)); print('hanging', flush=True); "
        'time.sleep(600)"'
    )
    r = FakeSweep(tmp_path, args=("--exec", hang, "--exec-timeout", "2"))
    assert r.wait(60) == 1, r.text
    checks = json.loads((r.run_dir / "result.json").read_text())["checks"]
    check = next(c for c in checks if c["name"] == "exec[0]")
    assert check["verdict"] == "fail" and "did not finish within 2 s (--exec-timeout)" in check["message"]
    assert check["seconds"] >= 2
    within(check["seconds"] - 2, 20.0, "the stop past the 2 s --exec-timeout (the command: 600 s)")
    assert "hanging" in r.text  # its log was tailed
    assert (
        not psutil.pid_exists(int((tmp_path / "child").read_text()))
        or psutil.Process(int((tmp_path / "child").read_text())).status() == psutil.STATUS_ZOMBIE
    )
    assert_nothing_left(r.run_dir)


KILL_DECODE = """import os, signal, sys, time
import psutil
port = int(os.environ["DECODE_PORT"])
pid = next(c.pid for c in psutil.net_connections("inet") if c.laddr and c.laddr.port == port
           and c.status == psutil.CONN_LISTEN)
print(f"killing decode pid {pid} at {time.time():.3f}", flush=True)
os.kill(pid, signal.SIGKILL)
time.sleep(120)
"""


@pytest.mark.procs
@LIVE
def test_a_server_dying_while_a_command_runs_fails_it_at_once_naming_the_server(tmp_path):
    script = tmp_path / "kill_decode.py"
    script.write_text(KILL_DECODE)
    r = FakeSweep(tmp_path, args=("--exec", f"{sys.executable} {script}", "--exec", "true"))
    assert r.wait(60) == 1, r.text
    log = (r.run_dir / "exec-0.log").read_text()
    killed = float(re.search(r"killing decode pid \d+ at ([0-9.]+)", log)[1])
    within(r.first("FAILED: decode-0") - killed, 10.0, "the failure after the kill (the command: 120 s)")
    result = json.loads((r.run_dir / "result.json").read_text())
    check = next(c for c in result["checks"] if c["name"] == "exec[0]")
    assert check["verdict"] == "fail" and check["message"].startswith("decode-0 (http://127.0.0.1:")
    assert "while exec[0] ran" in check["message"] and "SIGKILL" in check["message"]
    assert result["outcome"] == "error" and result["error"].startswith("decode-0")
    assert "exec[1]" not in {c["name"] for c in result["checks"]}  # never ran: the cluster is gone
    assert_nothing_left(r.run_dir)


def _serve(tmp_path, env=None):
    toml = tmp_path / "sweep.toml"
    toml.write_text(fake_sweep_toml(connector="nixl"))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pd_sessions",
            "serve",
            str(toml),
            "--only",
            "1x1",
            "--platform",
            "cpu",
            "--grace",
            "2",
            "--results-dir",
            str(tmp_path / "r"),
        ],
        cwd=ROOT,
        env={**fake_stack_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.procs
@LIVE
def test_serve_prints_env_answers_and_stops_cleanly_on_sigterm(tmp_path):
    p = _serve(tmp_path)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("serving until Ctrl-C"):
            break
    env = dict(re.findall(r"^export (\w+)=(\S+)$", "".join(lines), re.M))
    req = urllib.request.Request(
        f"http://{env['PROXY_HOST']}:{env['PROXY_PORT']}/v1/completions",
        data=json.dumps({"model": env["TEST_MODEL"], "prompt": "hi", "max_tokens": 3}).encode(),
        headers={"Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    assert json.loads(opener.open(req, timeout=10).read())["usage"]["completion_tokens"] == 3
    cluster = json.loads(Path(env["PD_SESSIONS_CLUSTER"]).read_text())
    assert cluster["connector"] == "nixl" and (tmp_path / "r" / "1x1" / "cluster.env").exists()
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    assert "stopped by SIGTERM: torn down" in out
    assert_nothing_left(tmp_path / "r" / "1x1")


@pytest.mark.procs
@LIVE
def test_serve_exits_non_zero_naming_a_server_that_dies(tmp_path):
    p = _serve(tmp_path, env={"FAKE_DECODE_BEHAVIOR": "die_after_ready:1"})
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1, out
    assert re.search(r"FAILED: decode-0 \(http://127.0.0.1:\d+\) exited with status 7 while serving", out)
    assert_nothing_left(tmp_path / "r" / "1x1")


KILLS_ITS_DECODE = """import os, signal

def test_one_kills_the_decode(pd_cluster):
    (decode,) = [r for r in pd_cluster.cluster.instances if r.name == "decode-0"]
    os.kill(decode.pid, signal.SIGKILL)
    decode.popen.wait()

def test_two_must_not_run_against_a_dead_cluster(pd_cluster):
    pass
"""


def _plugin_argv(tmp_path, *files):
    toml = tmp_path / "sweep.toml"
    toml.write_text(fake_sweep_toml(connector="mooncake"))
    return [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "pd_sessions.pytest_plugin",
        "-v",
        "-p",
        "no:cacheprovider",
        *map(str, files),
        "--pd-cluster",
        f"{toml}:1x1",
        "--pd-platform",
        "cpu",
        "--pd-results-dir",
        str(tmp_path / "r"),
    ]


def _plugin_env():
    return {k: v for k, v in fake_stack_env().items() if k != "PD_SESSIONS_CLUSTER"}


def _plugin_pytest(tmp_path, *files):
    return subprocess.run(
        _plugin_argv(tmp_path, *files),
        cwd=tmp_path,
        env=_plugin_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.procs
@LIVE
def test_plugin_fixture_starts_a_cluster_for_the_tests_and_tears_it_down(tmp_path):
    r = _plugin_pytest(tmp_path, USER / "pd_parity_fixture.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed" in r.stdout and "[pd_cluster] 1x1: cluster ready" in r.stdout
    assert_nothing_left(tmp_path / "r" / "sweep" / "1x1")


@pytest.mark.procs
@LIVE
def test_plugin_fails_the_next_test_fast_when_a_server_died(tmp_path):
    f = tmp_path / "kills_decode.py"
    f.write_text(KILLS_ITS_DECODE)
    r = _plugin_pytest(tmp_path, f)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 passed, 1 error" in r.stdout
    assert re.search(
        r"decode-0 \(http://127.0.0.1:\d+\) exited with status -9 \(SIGKILL\) before "
        r".*test_two_must_not_run",
        r.stdout,
    )
    assert "--- last lines of its log ---" in r.stdout
    assert_nothing_left(tmp_path / "r" / "sweep" / "1x1")


SLOW = """import pathlib, time

def test_waits(pd_cluster):
    pathlib.Path("started").write_text("")
    time.sleep(120)
"""


def _slow_pytest(tmp_path, **streams) -> subprocess.Popen:
    """pytest running SLOW (a test that holds a ``pd_cluster`` for 120 s), once its cluster is up."""
    f = tmp_path / "slow.py"
    f.write_text(SLOW)
    p = subprocess.Popen(_plugin_argv(tmp_path, f), cwd=tmp_path, env=_plugin_env(), **streams)
    wait_until((tmp_path / "started").exists, 60, "the test to start (the cluster up)", proc=p, tick=0.05)
    return p


@pytest.mark.procs
@LIVE
def test_sigterm_to_pytest_tears_the_fixture_cluster_down(tmp_path):
    p = _slow_pytest(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 2, out  # pytest's "interrupted"
    assert "stopped by SIGTERM" in out and "tearing down" in out
    assert_nothing_left(tmp_path / "r" / "sweep" / "1x1")


@pytest.mark.procs
@LIVE
def test_sigkill_to_the_pytest_that_owns_the_fixture_cluster_leaves_nothing(tmp_path):
    """pytest killed outright while a test uses ``pd_cluster``: it can do nothing, so the cluster
    hears it from the kernel (the servers' parent-death signal) and from the lifeline's reaper
    (run/lifeline.py), which stops whatever is left and verifies it gone. Every PID of the
    cluster, the reaper's too, is gone within the fixture's grace (10 s) and the wait after
    SIGKILL."""
    p = _slow_pytest(tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    family = psutil.Process(p.pid).children(recursive=True)
    reapers = [c for c in family if "pd_sessions.runtime.reaper" in " ".join(c.cmdline())]
    servers = [c for c in family if "vllm.entrypoints.openai.api_server" in " ".join(c.cmdline())]
    assert len(reapers) == 1 and len(servers) == 2, family
    assert len(family) >= 7, family  # 2 servers + their engine cores, the router (gate + core), the reaper
    p.kill()
    p.wait(10)
    pids = [c.pid for c in family]
    wait_until(
        lambda: all(gone(pid) for pid in pids),
        10 + 5 + 5,
        lambda: f"every process of the fixture's cluster gone (left: {[x for x in pids if not gone(x)]})",
    )
    log = (tmp_path / "r" / "sweep" / "reaper.log").read_text()
    assert f"pd-sessions pid {p.pid} is gone while" in log, log
    assert_nothing_left(tmp_path / "r" / "sweep" / "1x1")


@pytest.mark.procs
def test_plugin_without_the_fixture_starts_nothing(tmp_path):
    f = tmp_path / "test_plain.py"
    f.write_text("def test_plain():\n    pass\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "pd_sessions.pytest_plugin",
            "-v",
            str(f),
            "-p",
            "no:cacheprovider",
            "--basetemp",
            str(tmp_path / "base"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "1 passed" in r.stdout and "[pd_cluster]" not in r.stdout
    assert not list((tmp_path / "base").glob("pd_cluster*"))  # no cluster was even planned


def test_junit_stays_well_formed_with_control_characters_in_messages_and_logs(tmp_path):
    (tmp_path / "exec-0.log").write_text("pytest diff: + \x1b[31mred\x1b[0m \x00 \ufffd done\n")
    check = verdict(returncode=1)
    check.name, check.message = "exec[0]", "router said '\x0c\x1b'"
    r = ConfigResult(
        name="1x1", shape="s", connector="nixl", platform="cpu", checks=[check], run_dir=str(tmp_path)
    )
    r.decide(["exec[0]"])
    path = write_junit([r], tmp_path / "junit.xml", suite="sw", expected_checks=["exec[0]"])
    failure = ET.parse(path).getroot().find("testsuite/testcase/failure")
    assert failure.get("message") == "router said '\\x0c\\x1b'"
    assert "\\x1b[31mred\\x1b[0m \\x00 \ufffd done" in failure.text
