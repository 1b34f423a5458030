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
from pathlib import Path
from typing import Protocol

from pd_sessions.errors import InstallError

ROOT = Path(__file__).resolve().parent.parent
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


class Installer(Protocol):
    def install(self, *args: str, env: Mapping[str, str] | None = None) -> None: ...

    def run_install(self, *args: str) -> object: ...


def index_env(environ: Mapping[str, str]) -> dict[str, str]:
    """uv does not read pip's config: hand it pip's find-links folder(s) if set."""
    links = environ.get("PIP_FIND_LINKS", "").split()
    if links and "UV_FIND_LINKS" not in environ:
        return {"UV_FIND_LINKS": ",".join(links)}
    return {}


def lane_requirements(platform: str) -> Path:
    if platform not in ("cpu", "cuda"):
        raise InstallError(f"no requirements for platform {platform!r}; allowed: cpu, cuda")
    return REQUIREMENTS / f"{platform}.txt"


def ldconfig_libs(run: Callable[[Sequence[str]], str] | None = None) -> set[str]:
    """Library sonames the dynamic loader knows (from ``ldconfig -p``)."""
    def default(cmd: Sequence[str]) -> str:
        ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
        return subprocess.run([ldconfig, *cmd[1:]], capture_output=True, text=True,
                              check=False).stdout

    out = (run or default)(["ldconfig", "-p"])
    return {line.split()[0] for line in out.splitlines()[1:] if line.strip()}


def missing_system_packages(known: set[str], libs: Mapping[str, str] = SYSTEM_LIBS) -> list[str]:
    """Debian packages to install so every library in ``libs`` resolves."""
    return sorted({pkg for lib, pkg in libs.items() if lib not in known})


def ensure_system_packages(packages: Sequence[str], *, is_root: bool | None = None,
                           run: Callable[[Sequence[str]], int] | None = None,
                           say: Callable[[str], None] = print) -> None:
    """apt-get install ``packages`` (as root), or raise InstallError naming the command."""
    if not packages:
        return
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    root = os.geteuid() == 0 if is_root is None else is_root
    if not root or not shutil.which("apt-get"):
        raise InstallError(f"missing system libraries for the connector wheels: install "
                           f"{' '.join(packages)} (e.g. `sudo apt-get update && sudo {' '.join(cmd)}`)")
    runner = run or (lambda c: subprocess.run(list(c), check=False).returncode)
    for step in (["apt-get", "update"], cmd):
        say(f"pd-sessions install: {' '.join(step)}")
        rc = runner(step)
        if rc != 0:
            raise InstallError(f"`{' '.join(step)}` failed with status {rc}")


def install_lane(session: Installer, platform: str, *, environ: Mapping[str, str] | None = None,
                 say: Callable[[str], None] = print) -> None:
    """Install everything a sweep needs on ``platform`` into the session's venv."""
    env = dict(os.environ if environ is None else environ)
    if platform == "cpu":
        ensure_system_packages(missing_system_packages(ldconfig_libs()), say=say)
    session.install("-r", str(lane_requirements(platform)), env=index_env(env))
    if platform == "cpu":
        say(f"pd-sessions install: removing {', '.join(CPU_MISMATCHED)} (built for another torch)")
        session.run_install("uv", "pip", "uninstall", *CPU_MISMATCHED)
    session.install("-e", str(ROOT))
