"""The packing bench runs from an installed package (issue 39): the fake stack it starts in place
of vLLM and the router (pd_sessions/data/fake_stack) is package data, so a wheel built from the
package alone (no tests/ folder) carries it, and the bench's environment, imported from that
wheel's files, starts the shipped fake vLLM, which answers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from helpers.needs import needs

ROOT = Path(__file__).resolve().parent.parent
FAKE_STACK = ROOT / "pd_sessions" / "data" / "fake_stack"

# Run from the unpacked wheel: the bench's fake-stack environment, one fake vLLM instance started
# with it as pd-sessions starts vLLM (`python -m vllm.entrypoints.openai.api_server`), asked for
# its model, then its process group killed and waited for.
FROM_THE_WHEEL = textwrap.dedent(
    """
    import json, os, signal, socket, subprocess, sys, time, urllib.request
    from pathlib import Path

    import pd_sessions
    from pd_sessions.bench import packing_bench

    site = Path(sys.argv[1])
    assert Path(pd_sessions.__file__).is_relative_to(site), pd_sessions.__file__
    assert packing_bench.FAKE_STACK.is_relative_to(site), packing_bench.FAKE_STACK
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with packing_bench._fake_stack(startup_s=0, exit_s=0):
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", "from-the-wheel"]
        p = subprocess.Popen(argv, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    print(json.load(r)["data"][0]["id"])
                    break
            except OSError:
                assert p.poll() is None and time.monotonic() < deadline, p.returncode
                time.sleep(0.2)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # its "engine core" too
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"process group {p.pid} still there")
    """
)


def _wheel(tmp_path: Path) -> Path:
    """A wheel of the package built from a copy of it without tests/ (offline, this venv's
    setuptools)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "pd_sessions", src / "pd_sessions", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    p = subprocess.run([*argv, "-w", str(out), str(src)], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    (wheel,) = out.glob("pd_sessions-*.whl")
    return wheel


@pytest.mark.procs
def test_the_packing_bench_finds_its_fake_stack_in_a_wheel_without_tests(tmp_path):
    needs("setuptools")  # the wheel is built offline with this environment's setuptools
    wheel = _wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.relative_to(ROOT).as_posix() for p in FAKE_STACK.rglob("*.py")}
    assert "pd_sessions/data/fake_stack/fake_server.py" in shipped
    assert shipped <= names, sorted(shipped - names)
    assert not [n for n in names if n.startswith("tests/")]
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # the unpacked wheel, not this checkout
    p = subprocess.run(
        [sys.executable, "-c", FROM_THE_WHEEL, str(site)], capture_output=True, text=True, cwd=run, env=env
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines()[-1] == "from-the-wheel"
