"""The wheelhouse's edge: run uv (resolve) and pip (download, build sdists), check and hash what
landed in the folder, write ``manifest.json``, ``requirements.lock`` and ``SHA256SUMS``.

The decisions (what to download, which wheels fit the target, the manifest's data) are
:mod:`pd_sessions.env.wheelhouse.resolve`'s. The subprocess runner is a parameter: tests pass a
fake that plays uv and pip.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import Version

from pd_sessions.core.errors import InstallError, UsageError
from pd_sessions.env.lane_install import index_env
from pd_sessions.env.wheelhouse.resolve import (
    Result,
    Target,
    choose,
    overrides_text,
    pinned_name,
    read_pins,
    unmet,
    wheel_supported,
)

Runner = Callable[[Sequence[str], Mapping[str, str]], "subprocess.CompletedProcess[str]"]


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


# ------------------------------------------------------------------ running them


def _run(cmd: Sequence[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), env=dict(env), capture_output=True, text=True, check=False)


@dataclass(frozen=True)
class Tools:
    """How a build runs uv and pip: the runner, their environment, the index options, and the
    interpreter that resolves for and builds sdists (``--builder``; None: this one)."""

    run: Runner
    env: Mapping[str, str]
    index_args: Sequence[str] = ()
    builder: str | None = None

    def checked(self, cmd: Sequence[str], what: str) -> str:
        """Run ``cmd``; its stdout, or InstallError naming ``what``, the command and its output's tail."""
        proc = self.run(cmd, self.env)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
            raise InstallError(f"{what} failed (status {proc.returncode}): {' '.join(cmd)}\n{tail}")
        return proc.stdout


def tool_env(environ: Mapping[str, str]) -> dict[str, str]:
    """uv's and pip's environment: ``environ`` with the index settings both read
    (:func:`~pd_sessions.env.lane_install.index_env`), and uv never downloading a Python."""
    env = dict(environ)
    env.update(index_env(env))
    env.setdefault("UV_PYTHON_DOWNLOADS", "never")
    return env


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


# ------------------------------------------------------------------ the build


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
    tools = Tools(run, tool_env(os.environ if environ is None else environ), index_args, builder)
    out.mkdir(parents=True, exist_ok=True)
    result = Result(target)
    with tempfile.TemporaryDirectory(prefix="pd-wheelhouse-") as tmp_name:
        tmp = Path(tmp_name)
        say(f"wheelhouse: resolving {len(requirements)} requirements for {target.describe()}")
        pins = _resolve(target, tmp, requirements, installed, constraints, tools)
        wanted, result.skipped = choose(pins, target, installed, skip)
        say(f"wheelhouse: {len(pins)} resolved, {len(wanted)} to download, {len(result.skipped)} left out")
        specs = [f"{n}=={v}" for n, v in wanted.items()]
        tools.checked(download_cmd(target, out, specs, index_args=index_args), "downloading (pip download)")
        result.built = _wheels_from_sdists(target, out, tmp, wanted, tools, say)
    files, result.stale = _collect(out, wanted, target)
    result.wheels, requires = _describe(files, wanted)
    result.unmet = unmet(requires, {**installed, **{n: wanted[n] for n in files}}, target)
    result.seconds = time.monotonic() - start
    write_outputs(out, result)
    return result


def _resolve(
    target: Target,
    tmp: Path,
    requirements: Sequence[str],
    installed: Mapping[str, str | None],
    constraints: Sequence[Path],
    tools: Tools,
) -> dict[str, str]:
    """``uv pip compile`` the requirements for the target, what it has as overrides: the pins."""
    (tmp / "requirements.in").write_text("\n".join(requirements) + "\n")
    overrides = None
    if installed:
        overrides = tmp / "installed.txt"
        overrides.write_text(overrides_text(installed))
    cmd = compile_cmd(
        target,
        tmp / "requirements.in",
        tmp / "resolved.txt",
        overrides=overrides,
        constraints=constraints,
        python=tools.builder,
        index_args=tools.index_args,
    )
    tools.checked(cmd, "resolving (uv pip compile)")
    return read_pins((tmp / "resolved.txt").read_text())


def _wheels_from_sdists(
    target: Target, out: Path, tmp: Path, wanted: Mapping[str, str], tools: Tools, say: Callable[[str], None]
) -> list[str]:
    """Build a wheel of each pin pip could only get as an sdist for the target: the pins built."""
    built = []
    for name, version in wanted.items():
        sdist = find_sdist(out, name, version)
        if sdist is not None:
            _build_sdist(target, f"{name}=={version}", sdist, out, tmp, tools)
            built.append(f"{name}=={version}")
            say(
                f"wheelhouse: {name}=={version} has no wheel for {target.describe()}: "
                "built one from its sdist"
            )
    return built


def _collect(out: Path, wanted: Mapping[str, str], target: Target) -> tuple[dict[str, Path], list[str]]:
    """The folder's wheels: {name: path} of the pinned ones, and the file names of the others (stale).

    a pinned wheel that does not install on the target  -> InstallError (remove it)
    a wanted pin with no wheel in the folder            -> InstallError naming every one
    """
    files: dict[str, Path] = {}
    stale: list[str] = []
    for path in sorted(out.glob("*.whl")):
        key = pinned_name(path.name, wanted)
        if key is None:
            stale.append(path.name)
        elif not wheel_supported(path.name, target):
            raise InstallError(
                f"{path.name} does not install on {target.describe()} (its tags are not "
                f"the target's); remove it and check --python/--platform-tag"
            )
        else:
            files[key] = path
    missing = sorted(set(wanted) - set(files))
    if missing:
        raise InstallError(f"no wheel in {out} for: {', '.join(f'{n}=={wanted[n]}' for n in missing)}")
    return files, stale


def _describe(
    files: Mapping[str, Path], wanted: Mapping[str, str]
) -> tuple[list[dict[str, object]], dict[str, list[str]]]:
    """Each wheel's manifest entry (name, version, file, sha256, size) and its Requires-Dist."""
    wheels: list[dict[str, object]] = []
    requires = {}
    for name, path in files.items():
        wheels.append(
            {
                "name": name,
                "version": wanted[name],
                "file": path.name,
                "sha256": sha256(path),
                "size": path.stat().st_size,
            }
        )
        requires[f"{name}=={wanted[name]}"] = wheel_requires(path)
    return wheels, requires


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


def _build_sdist(target: Target, spec: str, sdist: Path, out: Path, tmp: Path, tools: Tools) -> None:
    built = tmp / "built"
    built.mkdir(exist_ok=True)
    tools.checked(build_cmd(tools.builder or sys.executable, sdist, built), f"building a wheel of {spec}")
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
    (out / "requirements.lock").write_text(result.lock())
    (out / "SHA256SUMS").write_text(result.sha256sums())
