"""The canary's verdicts over real ELF files built with gcc at test time (no ELF mocks). Without a
C compiler those tests fail saying so: the tests session installs gcc with the CPU lane's Debian
packages (pd_sessions.env.lane_install.TEST_COMMANDS)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.needs import FULL_ENV

from pd_sessions.env import import_canary

GCC = shutil.which("gcc") or shutil.which("cc")


def _cc(args, cwd):
    subprocess.run([GCC, *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def elfs(tmp_path_factory) -> dict[str, Path]:
    """stub libcudart.so.12 / .so.13, a module linked to each, and one linked to neither."""
    assert GCC, (
        "no C compiler (gcc or cc) on PATH: these tests build real ELF files with it. "
        "`nox -s tests` installs gcc with the CPU lane's Debian packages; elsewhere install it "
        "(e.g. `sudo apt-get install gcc`)"
    )
    d = tmp_path_factory.mktemp("elf")
    (d / "stub.c").write_text("int cudaRuntimeGetVersion(int *v) { *v = 0; return 0; }\n")
    (d / "mod.c").write_text(
        "int cudaRuntimeGetVersion(int *v);\nint probe(void) { int v; return cudaRuntimeGetVersion(&v); }\n"
    )
    (d / "plain.c").write_text("int probe(void) { return 0; }\n")
    out = {}
    for major in (12, 13):
        libdir = d / f"cuda{major}"
        libdir.mkdir()
        _cc(
            [
                "-shared",
                "-fPIC",
                f"-Wl,-soname,libcudart.so.{major}",
                "-o",
                str(libdir / f"libcudart.so.{major}"),
                "stub.c",
            ],
            d,
        )
        (libdir / "libcudart.so").symlink_to(f"libcudart.so.{major}")
        # RUNPATH=$ORIGIN/cuda{major}: resolves next to the module, as wheels do
        _cc(
            [
                "-shared",
                "-fPIC",
                "-o",
                str(d / f"engine_cu{major}.so"),
                "mod.c",
                f"-L{libdir}",
                "-lcudart",
                f"-Wl,-rpath,$ORIGIN/cuda{major}",
            ],
            d,
        )
        # same link, no rpath: resolves only if the loader knows the library
        _cc(
            [
                "-shared",
                "-fPIC",
                "-o",
                str(d / f"engine_cu{major}_norpath.so"),
                "mod.c",
                f"-L{libdir}",
                "-lcudart",
            ],
            d,
        )
        out[f"cu{major}"] = d / f"engine_cu{major}.so"
        out[f"cu{major}_norpath"] = d / f"engine_cu{major}_norpath.so"
    _cc(["-shared", "-fPIC", "-o", str(d / "engine_cpu.so"), "plain.c"], d)
    out["cpu"] = d / "engine_cpu.so"
    return out


def verdicts(path: Path, torch_cuda):
    needed, rpaths = import_canary.read_elf(path)
    res = {n: import_canary.resolve(n, rpaths, cache={}) for n in needed if import_canary.CUDART.match(n)}
    return import_canary.check_needed(path.name, needed, torch_cuda, res)


@pytest.mark.procs
def test_read_elf_sees_needed_and_origin(elfs):
    needed, rpaths = import_canary.read_elf(elfs["cu13"])
    assert "libcudart.so.13" in needed
    assert rpaths == [str(elfs["cu13"].parent / "cuda13")]


@pytest.mark.procs
@pytest.mark.parametrize(
    "lib,torch_cuda,ok,needle",
    [
        ("cu13", 13, True, "libcudart.so.13 ->"),
        ("cu12", 12, True, "libcudart.so.12 ->"),
        ("cu12", 13, False, "needs libcudart.so.12 but torch is CUDA 13"),
        ("cu13", 12, False, "needs libcudart.so.13 but torch is CUDA 12"),
        ("cu13", None, False, "torch is CPU-only"),
        ("cu13_norpath", 13, False, "does not resolve on this machine"),
        ("cpu", None, True, "needs no libcudart"),
        ("cpu", 13, True, "needs no libcudart"),
    ],
)
def test_elf_verdicts(elfs, lib, torch_cuda, ok, needle):
    (f,) = verdicts(elfs[lib], torch_cuda)
    assert f.ok is ok and needle in f.message


@pytest.mark.procs
def test_ld_library_path_resolves(elfs, monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", str(elfs["cu13"].parent / "cuda13"))
    (f,) = verdicts(elfs["cu13_norpath"], 13)
    assert f.ok


@pytest.mark.parametrize(
    "installed,cuda,ok,needles",
    [
        ({"mooncake-transfer-engine-non-cuda": "0.3.13.post1"}, None, True, ["non-cuda==0.3.13.post1"]),
        ({"mooncake-transfer-engine-cuda13": "0.3.14"}, 13, True, ["cuda13==0.3.14"]),
        (
            {"mooncake-transfer-engine-non-cuda": "0.3.13.post1", "mooncake-transfer-engine": "0.3.13.post1"},
            None,
            False,
            [
                "2 Mooncake variants installed at once",
                "mooncake-transfer-engine==0.3.13.post1",
                "mooncake-transfer-engine-non-cuda==0.3.13.post1",
                "fix: uv pip uninstall mooncake-transfer-engine ",
            ],
        ),
        (
            {"mooncake-transfer-engine": "0.3.14"},
            13,
            False,
            ["built for CUDA 12, torch is CUDA 13", "uv pip install mooncake-transfer-engine-cuda13==0.3.14"],
        ),
        ({}, 13, False, ["no Mooncake wheel", "mooncake-transfer-engine-cuda13"]),
    ],
)
def test_distribution_verdicts(installed, cuda, ok, needles):
    (f,) = import_canary.check_distributions(installed, cuda, ["mooncake"])
    assert f.ok is ok
    for n in needles:
        assert n in f.message


def test_nixl_backend_must_match_torch():
    (f,) = import_canary.check_distributions({"nixl": "1.5.1", "nixl-cu12": "1.5.1"}, 13, ["nixl"])
    assert not f.ok and "nixl-cu12==1.5.1 does not match torch's CUDA 13" in f.message
    assert "nixl-cu13==1.5.1" in f.message
    (f,) = import_canary.check_distributions({"nixl": "1.5.1", "nixl-cu13": "1.5.1"}, 13, ["nixl"])
    assert f.ok


@pytest.mark.procs
def test_canary_cli_json_line_and_status():
    """The real canary on this environment's Mooncake (CPU lane: non-cuda wheel must pass)."""
    r = subprocess.run(
        [sys.executable, "-m", "pd_sessions.env.import_canary", "mooncake", "--torch-cuda-major", "none"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = r.stdout.strip().splitlines()[-1]
    doc = json.loads(last)
    assert doc["ok"] is (r.returncode == 0)
    if FULL_ENV:  # the CPU lane's real wheel
        assert r.returncode == 0, r.stdout
        assert "mooncake-transfer-engine-non-cuda" in doc["distributions"]
        assert any(f["check"] == "import" and f["ok"] for f in doc["findings"])


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_cuda12_wheel_next_to_non_cuda_fails_then_printed_fix_passes(tmp_path):
    """Real wheels in a throwaway venv: the default (CUDA 12) Mooncake wheel installed by hand
    next to the non-cuda one makes the canary fail naming both; its printed fix makes it pass."""
    uv = shutil.which("uv")
    assert uv, "uv is in requirements/test.txt"
    venv = tmp_path / "venv"
    py = venv / "bin" / "python"
    subprocess.run([uv, "venv", "-q", "-p", sys.executable, str(venv)], check=True)

    def pip(*args):
        subprocess.run([uv, "pip", *args, "--python", str(py), "-q"], check=True, cwd=tmp_path)

    root = Path(__file__).resolve().parent.parent
    pip("install", "--no-deps", "-e", str(root))
    pip("install", "pyelftools", "packaging", "psutil", "prometheus_client")
    pip("install", "--no-deps", "mooncake-transfer-engine-non-cuda==0.3.13.post1")
    pip("install", "--no-deps", "mooncake-transfer-engine==0.3.13.post1")

    def canary():
        r = subprocess.run(
            [str(py), "-m", "pd_sessions.env.import_canary", "mooncake", "--torch-cuda-major", "none"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return r.returncode, r.stdout

    rc, out = canary()
    assert rc == 1, out
    line = next(x for x in out.splitlines() if "Mooncake variants installed at once" in x)
    assert "mooncake-transfer-engine==0.3.13.post1" in line
    assert "mooncake-transfer-engine-non-cuda==0.3.13.post1" in line
    fix = line.split("fix: ", 1)[1]
    assert fix == (
        "uv pip uninstall mooncake-transfer-engine && "
        "uv pip install --reinstall mooncake-transfer-engine-non-cuda==0.3.13.post1"
    )
    assert "needs libcudart.so.12 but torch is CPU-only" in out
    for step in fix.split(" && "):
        pip(*step.split()[2:])
    rc, out = canary()
    assert rc == 0, out
    assert '"ok": true' in out.splitlines()[-1]


def test_harness_dependencies_are_pyproject_dependencies():
    """HARNESS lists exactly pyproject.toml's dependencies (tomli-w was missing there: a --no-venv
    run on a lent GPU crashed inside the perf check on ModuleNotFoundError: tomli_w)."""
    import re
    import tomllib

    root = Path(__file__).resolve().parent.parent
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0] for d in deps}
    assert names == set(import_canary.HARNESS)
    assert "tomli-w" in names


def test_missing_harness_dependency_is_named_with_its_fix():
    findings = import_canary.check_harness(lambda module: module != "tomli_w")
    bad = [f for f in findings if not f.ok]
    assert len(bad) == 1 and bad[0].check == "harness"
    assert "tomli-w (import tomli_w)" in bad[0].message and "pip install 'tomli-w'" in bad[0].message
    assert all(f.ok for f in import_canary.check_harness(lambda module: True))
