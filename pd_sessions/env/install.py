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
# simulated hosts run each Ray node with `ip netns exec`.
TEST_COMMANDS: Mapping[str, str] = {
    "gcc": "gcc",
    "chromium": "chromium",
    "chromedriver": "chromium-driver",
    "ip": "iproute2",
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
    """{'mooncake': 'mooncake-transfer-engine>=0.3.12', 'nixl': 'nixl==1.5.1'} from the file."""
    out = {}
    for line in (path or REQUIREMENTS / "kv_connectors.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            out["mooncake" if req.name.startswith("mooncake") else req.name] = str(req).replace(" ", "")
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


def plan_connectors(doc: Mapping[str, object], connectors: Sequence[str]) -> tuple[Platform, list[Action]]:
    platform, installed = facts_from_json(doc)
    reqs = kv_requirements()
    nixl = reqs.get("nixl", "")
    return platform, connector_actions(
        platform,
        installed,
        connectors=connectors,
        mooncake_req=reqs["mooncake"],
        nixl_version=nixl.split("==")[1] if "==" in nixl else None,
    )


# ------------------------------------------------------------------ connector variants

MOONCAKE = {
    12: "mooncake-transfer-engine",
    13: "mooncake-transfer-engine-cuda13",
    None: "mooncake-transfer-engine-non-cuda",
}
NIXL_BACKENDS = {12: "nixl-cu12", 13: "nixl-cu13"}


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
    mooncake_req: str = "mooncake-transfer-engine>=0.3.12",
    nixl_version: str | None = None,
    available: Mapping[str, Sequence[str]] | None = None,
) -> list[Action]:
    """Ordered install actions that leave exactly the connector variants ``platform`` needs.

    Decision table (Mooncake; the requirement names the default wheel, its specifier
    is kept for whichever variant is chosen):
        platform     wanted variant                       other variants installed
        CUDA 12      mooncake-transfer-engine              uninstalled first
        CUDA 13      mooncake-transfer-engine-cuda13       uninstalled first
        CPU          mooncake-transfer-engine-non-cuda     uninstalled first
        ROCm / other CUDA major -> InstallError "unsupported"
    Version: the wanted variant already installed at a version the requirement allows
    -> nothing to do; else the version of an installed variant that the requirement
    allows (a swap keeps the version); else the requirement's specifier. With
    ``available`` (variant -> versions on the index), a pinned version the wanted
    variant does not have is an InstallError.
    NIXL: ``nixl`` (meta) plus ``nixl-cuN`` for torch's CUDA major (nixl-cu12 with
    --no-deps on CPU, whose DRAM backend works without a GPU); other backends uninstalled.
    """
    inst: dict[str, str] = {canonicalize_name(k): v for k, v in installed.items()}
    if platform.kind == "rocm":
        raise InstallError(
            "ROCm is not supported yet by pd-sessions' connector install "
            "(no ROCm Mooncake/NIXL variant is known); use a CUDA or CPU host"
        )
    major = platform.cuda_major if platform.kind == "cuda" else None
    if platform.kind == "cuda" and major not in (12, 13):
        raise InstallError(f"torch is built for CUDA {major}; supported: CUDA 12, CUDA 13, CPU")
    actions: list[Action] = []
    if "mooncake" in connectors:
        req = Requirement(mooncake_req)
        want = MOONCAKE[major]
        others = [d for d in MOONCAKE.values() if d != want and d in inst]
        actions += [Action("uninstall", d) for d in others]
        have = inst.get(want)
        if have is not None and Version(have) in req.specifier and not others:
            pass  # already right
        else:
            keep = next((inst[d] for d in others if Version(inst[d]) in req.specifier), None)
            spec = f"=={keep}" if keep else str(req.specifier)
            if keep and available is not None and keep not in available.get(want, ()):
                raise InstallError(
                    f"{want}=={keep} (to replace {', '.join(others)} at the same version) "
                    f"does not exist for {platform.describe()}; available: "
                    f"{', '.join(available.get(want, ())) or 'none'}"
                )
            actions.append(Action("install", want, spec))
    if "nixl" in connectors:
        backend = NIXL_BACKENDS[major] if major else NIXL_BACKENDS[12]
        actions += [Action("uninstall", d) for d in NIXL_BACKENDS.values() if d != backend and d in inst]
        version = nixl_version or inst.get("nixl")
        spec = f"=={version}" if version else ""
        if "nixl" not in inst:
            actions.append(Action("install", "nixl", spec, no_deps=True))
        if backend not in inst or (version and inst.get(backend) != version):
            actions.append(Action("install", backend, spec, no_deps=True))
    return actions


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
