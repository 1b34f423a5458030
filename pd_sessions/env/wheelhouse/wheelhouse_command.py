"""``pd-sessions wheelhouse`` (and ``nox -s wheelhouse --``): its parser, and main, which checks the
options, runs the build and prints what it left (sizes, what was left out and why, unmet
requirements, stale files) and how to install from it.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from pd_sessions.core.errors import InstallError, UsageError
from pd_sessions.env.in_place import FIND_LINKS_ENV, offline_args
from pd_sessions.env.wheelhouse.download import build, find_builder
from pd_sessions.env.wheelhouse.resolve import (
    DEFAULT_VLLM,
    LAZY,
    Result,
    Target,
    parse_cuda,
    parse_python,
    read_freeze,
    session_requirements,
)


def _size(w: Mapping[str, object]) -> int:
    return int(str(w["size"]))


def size_table(wheels: Sequence[Mapping[str, object]]) -> list[str]:
    """``  289.6 MiB  vllm==0.26.0`` lines, largest first, then the total."""
    rows = sorted(wheels, key=lambda w: -_size(w))
    total = sum(_size(w) for w in rows)
    return [f"{_size(w) / 2**20:9.1f} MiB  {w['name']}=={w['version']}" for w in rows] + [
        f"{total / 2**20:9.1f} MiB  total, {len(rows)} wheels"
    ]


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
        result = _build(args, target)
    except (UsageError, InstallError) as e:
        print(f"wheelhouse: {e}", file=sys.stderr)
        return e.exit_status if isinstance(e, UsageError) else 1
    print("\n".join(summary(result, args.out)))
    return 0


def _build(args: argparse.Namespace, target: Target) -> Result:
    """Check the tools, read the options, run the build."""
    if importlib.util.find_spec("pip") is None or shutil.which("uv") is None:
        raise UsageError(
            f"{sys.executable} needs pip (for `pip download`) and uv on PATH (for the "
            f"resolution): `nox -s wheelhouse` installs both; else `pip install pip uv`"
        )
    installed = read_freeze(args.exclude_installed.read_text()) if args.exclude_installed else {}
    skip = list(args.skip or []) + ([] if args.keep_lazy else list(LAZY))
    index_args = [a for url in args.extra_index_url for a in ("--extra-index-url", url)]
    builder = find_builder(target.python, given=args.builder)
    return build(
        target,
        args.out,
        requirements=session_requirements(target, vllm=args.vllm),
        installed=installed,
        skip=skip,
        constraints=args.constraint,
        index_args=index_args,
        builder=builder,
    )


def summary(result: Result, out: Path) -> list[str]:
    """What main prints after a build: sizes, what was not downloaded and why, the requirements
    the target's versions do not meet, stale files, then the install command."""
    lines = size_table(result.wheels)
    lines += [f"  not downloaded: {spec}: {reason}" for spec, reason in sorted(result.skipped.items())]
    lines += [f"  requirement not met (install with --no-deps): {line}" for line in result.unmet]
    lines += [f"  not in the lock (left in the folder; remove it): {name}" for name in result.stale]
    return lines + [
        f"wheelhouse: {len(result.wheels)} wheels in {out} for {result.target.describe()} "
        f"in {result.seconds:.0f} s; install with "
        f"`python -m pip install --no-deps {' '.join(offline_args(str(out)))} -r "
        f"{out / 'requirements.lock'}` or set {FIND_LINKS_ENV}={out}"
    ]
