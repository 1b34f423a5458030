"""Environment installation for the sessions: pure decisions + their application.

The noxfile calls :func:`install_lane` with its session, which provides
``install(*args, env=...)`` and ``run_install(*args)`` (nox's API); tests pass
a fake.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from pd_sessions.core import connectors as kv_connectors
from pd_sessions.core.connectors.base import Package
from pd_sessions.core.errors import InstallError

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements"

# PyPI's torchvision/torchaudio/torchcodec do not match torch 2.13.0+cpu: with them
# installed, transformers' model classes fail to import ("torchvision::nms does not
# exist"). Text models need none of them.
CPU_MISMATCHED = ("torchvision", "torchaudio", "torchcodec")

# Shared libraries the connector wheels load, and the Debian packages that ship them.
SYSTEM_LIBS: Mapping[str, str] = {
    "libibverbs.so.1": "libibverbs1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
}

# Commands the tests session needs beyond the lane, and the Debian packages that ship them: the
# canary's tests build real ELF files with a C compiler; the report page is checked in headless
# Chromium, driven through Debian's chromedriver (the same build: no browser download); the
# simulated hosts run each Ray node with `ip netns exec`; the wire faults between them
# (checks/faults/wire_*.py) drop KV packets with nftables and cap the link with tc.
TEST_COMMANDS: Mapping[str, str] = {
    "gcc": "gcc",
    "chromium": "chromium",
    "chromedriver": "chromium-driver",
    "ip": "iproute2",
    "tc": "iproute2",
    "nft": "nftables",
}


class Installer(Protocol):
    def install(self, *args: str, env: Mapping[str, str] | None = None) -> None: ...

    def run_install(self, *args: str) -> object: ...


def index_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Environment for uv installs.

    - uv does not read pip's config: hand it pip's find-links folder(s) if set.
    - uv does not compile bytecode (pip does): without .pyc files, and with
      PYTHONDONTWRITEBYTECODE set as on CI machines, every vLLM process (API server,
      engine core, each worker) compiles torch's and vLLM's sources again at import:
      tens of seconds per process. So compile once at install (a user's
      UV_COMPILE_BYTECODE wins).
    """
    out = {"UV_COMPILE_BYTECODE": "1"} if "UV_COMPILE_BYTECODE" not in environ else {}
    links = environ.get("PIP_FIND_LINKS", "").split()
    if links and "UV_FIND_LINKS" not in environ:
        out["UV_FIND_LINKS"] = ",".join(links)
    return out


def lane_requirements(platform: str) -> Path:
    if platform not in ("cpu", "cuda"):
        raise InstallError(f"no requirements for platform {platform!r}; allowed: cpu, cuda")
    return REQUIREMENTS / f"{platform}.txt"


def ldconfig_libs(run: Callable[[Sequence[str]], str] | None = None) -> set[str]:
    """Library sonames the dynamic loader knows (from ``ldconfig -p``)."""

    def default(cmd: Sequence[str]) -> str:
        ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
        return subprocess.run([ldconfig, *cmd[1:]], capture_output=True, text=True, check=False).stdout

    out = (run or default)(["ldconfig", "-p"])
    return {line.split()[0] for line in out.splitlines()[1:] if line.strip()}


def missing_system_packages(known: set[str], libs: Mapping[str, str] = SYSTEM_LIBS) -> list[str]:
    """Debian packages to install so every library in ``libs`` resolves."""
    return sorted({pkg for lib, pkg in libs.items() if lib not in known})


def missing_commands(
    commands: Mapping[str, str], which: Callable[[str], str | None] = shutil.which
) -> list[str]:
    """Debian packages to install so every command in ``commands`` (command -> package) is on PATH."""
    return sorted({pkg for command, pkg in commands.items() if which(command) is None})


def ensure_system_packages(
    packages: Sequence[str],
    *,
    is_root: bool | None = None,
    run: Callable[[Sequence[str]], int] | None = None,
    say: Callable[[str], None] = print,
) -> None:
    """apt-get install ``packages`` (as root), or raise InstallError naming the command."""
    if not packages:
        return
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    root = os.geteuid() == 0 if is_root is None else is_root
    if not root or not shutil.which("apt-get"):
        raise InstallError(
            f"missing system packages (libraries the connector wheels load, or the tests' compiler): "
            f"install {' '.join(packages)} (e.g. `sudo apt-get update && sudo {' '.join(cmd)}`)"
        )
    runner = run or (lambda c: subprocess.run(list(c), check=False).returncode)
    for step in (["apt-get", "update"], cmd):
        say(f"pd-sessions install: {' '.join(step)}")
        rc = runner(step)
        if rc != 0:
            raise InstallError(f"`{' '.join(step)}` failed with status {rc}")


def install_lane(
    session: Installer,
    platform: str,
    *,
    environ: Mapping[str, str] | None = None,
    say: Callable[[str], None] = print,
    commands: Mapping[str, str] | None = None,
) -> None:
    """Install vLLM, the router and this package for ``platform`` into the session's venv
    (the connector wheels come after, from :func:`connector_actions`). First the Debian
    packages: on the CPU lane those of the connector wheels' libraries, and for every platform
    those of ``commands`` (command -> package, e.g. :data:`TEST_COMMANDS`) missing from PATH."""
    env = dict(os.environ if environ is None else environ)
    packages = missing_commands(commands or {})
    if platform == "cpu":
        packages = sorted({*missing_system_packages(ldconfig_libs()), *packages})
    ensure_system_packages(packages, say=say)
    session.install("-r", str(lane_requirements(platform)), env=index_env(env))
    if platform == "cpu":
        say(f"pd-sessions install: removing {', '.join(CPU_MISMATCHED)} (built for another torch)")
        session.run_install("uv", "pip", "uninstall", *CPU_MISMATCHED)
    session.install("-e", str(ROOT))


def kv_requirements(path: Path | None = None) -> dict[str, str]:
    """{'mooncake': 'mooncake-transfer-engine>=0.3.12', 'nixl': 'nixl==1.5.1'} from the file: each
    line keyed by the connector package whose distribution it names."""
    out = {}
    for line in (path or REQUIREMENTS / "kv_connectors.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            name = canonicalize_name(req.name)
            package = next((p for p in kv_connectors.packages() if name in p.distributions), None)
            out[package.name if package else name] = str(req).replace(" ", "")
    return out


def facts_from_json(doc: Mapping[str, object]) -> tuple[Platform, dict[str, str]]:
    """(what torch is built for, installed distributions) from ``python -m pd_sessions.env.envfacts``'s
    document. No torch counts as CPU."""
    torch = doc.get("torch") or {}
    assert isinstance(torch, Mapping)
    if torch.get("hip"):
        platform = Platform("rocm")
    elif torch.get("cuda"):
        platform = Platform("cuda", int(str(torch["cuda"]).split(".")[0]))
    else:
        platform = Platform("cpu")
    return platform, dict(doc.get("installed") or {})  # type: ignore[call-overload]


def plan_connectors(doc: Mapping[str, object], names: Sequence[str]) -> tuple[Platform, list[Action]]:
    """What torch is built for in ``doc``'s interpreter, and the actions that leave the variants of
    the named connectors' packages it needs, at requirements/kv_connectors.txt's versions."""
    platform, installed = facts_from_json(doc)
    return platform, connector_actions(platform, installed, connectors=names, requirements=kv_requirements())


# ------------------------------------------------------------------ connector variants


@dataclass(frozen=True)
class Platform:
    """What the installed torch was built for."""

    kind: str  # "cuda" | "rocm" | "cpu"
    cuda_major: int | None = None

    def describe(self) -> str:
        return f"CUDA {self.cuda_major}" if self.kind == "cuda" else self.kind.upper()


@dataclass(frozen=True)
class Action:
    op: str  # "uninstall" | "install"
    dist: str
    spec: str = ""  # "==0.3.14", ">=0.3.12", "" (uninstall)
    no_deps: bool = False

    def __str__(self) -> str:
        return f"{self.op} {self.dist}{self.spec}" + (" (--no-deps)" if self.no_deps else "")


def connector_actions(
    platform: Platform,
    installed: Mapping[str, str],
    *,
    connectors: Sequence[str],
    requirements: Mapping[str, str] | None = None,
    available: Mapping[str, Sequence[str]] | None = None,
) -> list[Action]:
    """Ordered install actions that leave exactly the variants ``platform`` needs of the packages
    of ``connectors`` (connector or package names; each package's ``variants`` table in
    pd_sessions/core/connectors/ says which distribution each torch build takes).

    ``requirements``: package name -> requirement (requirements/kv_connectors.txt); a package
    without one takes any version (the installed-environment mode keeps what it finds).
        ROCm, or a CUDA major no table has           -> InstallError "unsupported"
        a package of variants only (Mooncake)        -> :func:`_variant_actions`
        a base package plus a backend variant (NIXL) -> :func:`_base_actions`
    """
    inst: dict[str, str] = {canonicalize_name(k): v for k, v in installed.items()}
    packages = kv_connectors.packages(connectors)
    if platform.kind == "rocm":
        raise InstallError(
            "ROCm is not supported yet by pd-sessions' connector install "
            f"(no ROCm {'/'.join(p.title for p in packages)} variant is known); use a CUDA or CPU host"
        )
    major = platform.cuda_major if platform.kind == "cuda" else None
    if platform.kind == "cuda" and major not in (12, 13):
        raise InstallError(f"torch is built for CUDA {major}; supported: CUDA 12, CUDA 13, CPU")
    actions: list[Action] = []
    for package in packages:
        requirement = (requirements or {}).get(package.name)
        if package.base is None:
            actions += _variant_actions(package, requirement, platform, major, inst, available)
        else:
            actions += _base_actions(package, requirement, major, inst)
    return actions


def _variant_actions(
    package: Package,
    requirement: str | None,
    platform: Platform,
    major: int | None,
    inst: Mapping[str, str],
    available: Mapping[str, Sequence[str]] | None,
) -> list[Action]:
    """A package of variants only, exactly one installed (they overwrite each other). The
    requirement names the default wheel; its specifier is kept for whichever variant is chosen.

        platform     wanted variant                       other variants installed
        CUDA 12      mooncake-transfer-engine              uninstalled first
        CUDA 13      mooncake-transfer-engine-cuda13       uninstalled first
        CPU          mooncake-transfer-engine-non-cuda     uninstalled first
    Version: the wanted variant already installed at a version the requirement allows
    -> nothing to do; else the version of an installed variant that the requirement
    allows (a swap keeps the version); else the requirement's specifier. With
    ``available`` (variant -> versions on the index), a pinned version the wanted
    variant does not have is an InstallError.
    """
    req = Requirement(requirement or package.requirement)
    want = package.variant_for(major)
    if want is None:
        raise InstallError(f"{package.title} has no variant for {platform.describe()}")
    others = [d for d in package.variant_dists if d != want and d in inst]
    actions = [Action("uninstall", d) for d in others]
    have = inst.get(want)
    if have is not None and Version(have) in req.specifier and not others:
        return actions  # already right
    keep = next((inst[d] for d in others if Version(inst[d]) in req.specifier), None)
    spec = f"=={keep}" if keep else str(req.specifier)
    if keep and available is not None and keep not in available.get(want, ()):
        raise InstallError(
            f"{want}=={keep} (to replace {', '.join(others)} at the same version) "
            f"does not exist for {platform.describe()}; available: "
            f"{', '.join(available.get(want, ())) or 'none'}"
        )
    return actions + [Action("install", want, spec, no_deps=package.no_deps)]


def _base_actions(
    package: Package, requirement: str | None, major: int | None, inst: Mapping[str, str]
) -> list[Action]:
    """A base distribution plus the backend variant for torch's CUDA major (NIXL: ``nixl`` and
    ``nixl-cuN``; nixl-cu12 on CPU, whose DRAM backend works without a GPU), both at one version
    (the requirement's ``==`` pin, else the installed base's); other backends uninstalled."""
    base = package.base
    assert base is not None
    backend = package.variant_for(major) or package.variant_dists[0]
    actions = [Action("uninstall", d) for d in package.variant_dists if d != backend and d in inst]
    version = _pinned(requirement) or inst.get(base)
    spec = f"=={version}" if version else ""
    if base not in inst:
        actions.append(Action("install", base, spec, no_deps=package.no_deps))
    if backend not in inst or (version and inst.get(backend) != version):
        actions.append(Action("install", backend, spec, no_deps=package.no_deps))
    return actions


def _pinned(requirement: str | None) -> str | None:
    """The version a requirement pins with ``==`` (None when it pins none)."""
    if not requirement:
        return None
    pins = [s.version for s in Requirement(requirement).specifier if s.operator == "=="]
    return pins[0] if pins else None


def apply_actions(
    session: Installer,
    actions: Sequence[Action],
    platform: Platform,
    *,
    env: Mapping[str, str] | None = None,
    say: Callable[[str], None] = print,
) -> None:
    """Run ``actions`` in order through the session's installer; each printed first."""
    for a in actions:
        say(f"pd-sessions install: {a}")
        try:
            if a.op == "uninstall":
                session.run_install("uv", "pip", "uninstall", a.dist)
            else:
                session.install(
                    *(["--no-deps"] if a.no_deps else []), f"{a.dist}{a.spec}", env=dict(env or {})
                )
        except Exception as e:  # nox raises its own CommandFailed; name what failed
            raise InstallError(
                f"could not {a.op} {a.dist}{a.spec or ''} for {platform.describe()}: {e}"
            ) from e
