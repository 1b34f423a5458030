"""Import canary for the KV connectors. Run it as its own process:

    python -m pd_sessions.env.import_canary CONNECTOR... [--torch-cuda-major N|none]

so a crash in native code ends the canary, not the session. It checks, in order:

1. distributions: which connector wheels are installed (each connector package's variants, in
   pd_sessions/core/connectors/); two Mooncake variants at once, or a ``nixl-cuN`` that does not
   match torch's CUDA major, is a failure;
2. native libraries, before importing them: the ELF dynamic section (DT_NEEDED)
   of each connector's native modules (read with pyelftools); every
   ``libcudart.so.N`` must match torch's CUDA major and resolve on this machine
   (RPATH/RUNPATH, LD_LIBRARY_PATH, the ldconfig cache, NVIDIA runtime wheels);
   a CPU-only torch must not need libcudart at all;
3. imports: the package's ``imports`` (``mooncake.engine``; ``nixl._api`` for NIXL);
4. with ``--harness``: the harness's own dependencies (pyproject.toml's ``dependencies``, :data:`HARNESS`)
   are importable here, so a ``--no-venv`` interpreter that lacks one is named before a check
   crashes on it (2026-12-05: ``tomli_w`` missing crashed the perf check on a lent GPU).

Prints a short report, then one JSON line; exits 1 on any failure.
The checks are pure functions over facts, so tests can give them any facts.

Why ``python -m`` (not a ``pd-sessions`` subcommand): a process boundary. It runs in the target
interpreter (the noxfile starts it there after installing), in a process of its own, so that a
connector whose native code crashes takes the canary down, not the session.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_sessions.core import connectors as kv_connectors
from pd_sessions.core.connectors.base import Package
from pd_sessions.env.envfacts import canonical

# A package's distributions are the ones whose native modules are read, and its native_prefixes
# the modules its imports load (file name prefixes). Other extensions in the wheels (e.g. NIXL's
# expert-parallel nixl_ep_* built per torch/CUDA) are never loaded by those imports, so not judged.
CUDART = re.compile(r"^libcudart\.so\.(\d+)$")


@dataclass
class Finding:
    check: str
    ok: bool
    message: str


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    distributions: dict[str, str] = field(default_factory=dict)

    def add(self, check: str, ok: bool, message: str) -> None:
        self.findings.append(Finding(check, ok, message))

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    def to_json(self) -> str:
        return json.dumps(
            {
                "ok": self.ok,
                "distributions": self.distributions,
                "findings": [f.__dict__ for f in self.findings],
            },
            sort_keys=True,
        )


# ------------------------------------------------------------------ pure checks


# pyproject.toml's dependencies: distribution -> the module it is imported as (tests/test_canary.py
# keeps the two lists equal).
HARNESS = {
    "psutil": "psutil",
    "prometheus_client": "prometheus_client",
    "packaging": "packaging",
    "pyelftools": "elftools",
    "jinja2": "jinja2",
    "tomli-w": "tomli_w",
}


def check_harness(importable: Callable[[str], bool]) -> list[Finding]:
    """One finding per harness dependency: importable here, or a failure naming the fix."""
    out = []
    for dist, module in HARNESS.items():
        if importable(module):
            out.append(Finding("harness", True, f"import {module}"))
        else:
            out.append(
                Finding(
                    "harness",
                    False,
                    f"the harness needs {dist} (import {module}) and this interpreter lacks it: "
                    f"pip install '{dist}' into it (pyproject.toml's dependencies list it)",
                )
            )
    return out


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_distributions(
    installed: Mapping[str, str], torch_cuda: int | None, connectors: Sequence[str]
) -> list[Finding]:
    """Variant conflicts and CUDA-major mismatches among the installed wheels of the named
    connectors' packages (connector or package names), one finding per package."""
    inst = {canonical(k): v for k, v in installed.items()}
    out: list[Finding] = []
    for package in kv_connectors.packages(connectors):
        if package.base is None:
            out.append(_variants_only(package, inst, torch_cuda))
        else:
            out.append(_base_and_backend(package, inst, torch_cuda))
    return out


def _variants_only(package: Package, inst: Mapping[str, str], torch_cuda: int | None) -> Finding:
    """Exactly one variant, the one built for torch's CUDA major (Mooncake)."""
    found = [d for d in package.variant_dists if d in inst]
    want = package.variant_for(torch_cuda)
    if not found:
        return Finding(
            "distributions",
            False,
            f"no {package.title} wheel is installed" + (f"; install {want}" if want else ""),
        )
    if len(found) > 1:
        keep = want if want in found else found[0]
        drop = [d for d in found if d != keep]
        return Finding(
            "distributions",
            False,
            f"{len(found)} {package.title} variants installed at once: "
            + ", ".join(f"{d}=={inst[d]}" for d in found)
            + f" (they ship the same `{package.module}` package and overwrite each other); "
            f"fix: uv pip uninstall {' '.join(drop)} "
            f"&& uv pip install --reinstall {keep}=={inst[keep]}",
        )
    d = found[0]
    if want and d != want:
        return Finding(
            "distributions",
            False,
            f"{d}=={inst[d]} is built for {_cuda_name(package.built_for(d))}, torch is "
            f"{_cuda_name(torch_cuda)}; fix: uv pip uninstall {d} && uv pip install {want}=={inst[d]}",
        )
    return Finding("distributions", True, f"{d}=={inst[d]}")


def _base_and_backend(package: Package, inst: Mapping[str, str], torch_cuda: int | None) -> Finding:
    """The base installed, and its backends built for torch's CUDA major (NIXL: on CPU-only torch
    any backend loads; its UCX backend moves DRAM without a GPU)."""
    base = package.base or ""
    backends = [d for d in package.variant_dists if d in inst]
    bad = [d for d in backends if torch_cuda is not None and package.built_for(d) != torch_cuda]
    if base not in inst:
        return Finding("distributions", False, f"the {base} package is not installed")
    if bad:
        want = package.variant_for(torch_cuda)
        return Finding(
            "distributions",
            False,
            f"{', '.join(f'{d}=={inst[d]}' for d in bad)} does not match torch's "
            f"{_cuda_name(torch_cuda)}; fix: uv pip uninstall {' '.join(bad)} "
            f"&& uv pip install --no-deps {want}=={inst[base]}",
        )
    if not backends:
        return Finding(
            "distributions",
            False,
            f"{base} is installed without a backend wheel ({', '.join(package.variant_dists)})",
        )
    return Finding("distributions", True, ", ".join(f"{d}=={inst[d]}" for d in [base, *backends]))


def _cuda_name(major: int | None) -> str:
    return "CPU-only" if major is None else f"CUDA {major}"


def check_needed(
    lib: str, needed: Iterable[str], torch_cuda: int | None, resolves: Mapping[str, str | None]
) -> list[Finding]:
    """Verdict on one native module's DT_NEEDED list.

    ``resolves`` maps each needed libcudart soname to where it was found (or None).
    """
    out = []
    for name in needed:
        m = CUDART.match(name)
        if not m:
            continue
        major = int(m.group(1))
        if torch_cuda is None:
            out.append(
                Finding(
                    "elf",
                    False,
                    f"{lib} needs {name} but torch is CPU-only: "
                    "this is a CUDA build of the connector; install its non-cuda variant",
                )
            )
        elif major != torch_cuda:
            out.append(
                Finding(
                    "elf",
                    False,
                    f"{lib} needs {name} but torch is CUDA {torch_cuda}: "
                    f"install the connector variant built for CUDA {torch_cuda}",
                )
            )
        elif not resolves.get(name):
            out.append(
                Finding(
                    "elf",
                    False,
                    f"{lib} needs {name}, which does not resolve on this "
                    "machine (not in RPATH/RUNPATH, LD_LIBRARY_PATH, the ldconfig cache "
                    "or the nvidia-*-cu runtime wheels)",
                )
            )
        else:
            out.append(Finding("elf", True, f"{lib}: {name} -> {resolves[name]}"))
    if not out:
        out.append(Finding("elf", True, f"{lib}: needs no libcudart"))
    return out


# ------------------------------------------------------------------ facts (edge)


def read_elf(path: Path) -> tuple[list[str], list[str]]:
    """(DT_NEEDED, RPATH+RUNPATH entries) of an ELF shared object, via pyelftools."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    needed: list[str] = []
    paths: list[str] = []
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for section in elf.iter_sections():
            if not isinstance(section, DynamicSection):
                continue
            for tag in section.iter_tags():
                if tag.entry.d_tag == "DT_NEEDED":
                    needed.append(tag.needed)  # type: ignore[attr-defined]  # set per tag type
                elif tag.entry.d_tag == "DT_RPATH":
                    paths += tag.rpath.split(":")  # type: ignore[attr-defined]  # set per tag type
                elif tag.entry.d_tag == "DT_RUNPATH":
                    paths += tag.runpath.split(":")  # type: ignore[attr-defined]  # set per tag type
    origin = str(path.parent)
    return needed, [p.replace("$ORIGIN", origin).replace("${ORIGIN}", origin) for p in paths if p]


def ldconfig_cache() -> dict[str, str]:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return {}
    cache: dict[str, str] = {}
    for line in out.splitlines()[1:]:
        parts = line.strip().split(" => ")
        if len(parts) == 2:
            cache.setdefault(parts[0].split()[0], parts[1])
    return cache


def nvidia_wheel_dirs() -> list[str]:
    """lib folders of NVIDIA runtime wheels (nvidia-cuda-runtime-cuNN etc.) on sys.path."""
    dirs = []
    for entry in sys.path:
        base = Path(entry) / "nvidia"
        if base.is_dir():
            dirs += [str(p) for p in base.glob("*/lib") if p.is_dir()]
            dirs += [str(p) for p in base.glob("cu*/lib") if p.is_dir()]
    return dirs


def resolve(
    name: str, rpaths: Sequence[str], cache: Mapping[str, str], extra_dirs: Sequence[str] = ()
) -> str | None:
    search = [*rpaths, *os.environ.get("LD_LIBRARY_PATH", "").split(":"), *extra_dirs]
    for d in search:
        if d and (Path(d) / name).exists():
            return str(Path(d) / name)
    return cache.get(name)


def installed_distributions() -> dict[str, str]:
    out = {}
    for dist in md.distributions():
        meta: Any = dist.metadata  # an email Message: .get is not in the PackageMetadata protocol
        name = meta.get("Name")
        if name:
            out[canonical(name)] = dist.version
    return out


def native_modules(dist: str) -> list[Path]:
    try:
        files = md.files(dist) or []
    except md.PackageNotFoundError:
        return []
    return [
        Path(str(f.locate()))
        for f in files
        if str(f).endswith(".so") and "/" in str(f) and not str(f).split("/")[0].endswith(".libs")
    ]


def torch_cuda_major() -> int | None:
    import torch

    if getattr(torch.version, "hip", None):
        raise SystemExit("canary: ROCm torch is not supported yet")
    v = torch.version.cuda
    return int(v.split(".")[0]) if v else None


def run(connectors: Sequence[str], torch_cuda: int | None, *, harness: bool = False) -> Report:
    report = Report()
    inst = installed_distributions()
    packages = kv_connectors.packages(connectors)
    ours = {d for p in kv_connectors.packages() for d in p.distributions}
    report.distributions = {d: v for d, v in inst.items() if d in ours}
    if harness:
        report.findings += check_harness(_importable)
    report.findings += check_distributions(inst, torch_cuda, connectors)
    cache = ldconfig_cache()
    extra = nvidia_wheel_dirs()
    for package in packages:
        for dist in package.distributions:
            for so in native_modules(dist):
                if not so.name.startswith(package.native_prefixes):
                    continue
                needed, rpaths = read_elf(so)
                res = {n: resolve(n, rpaths, cache, extra) for n in needed if CUDART.match(n)}
                report.findings += check_needed(f"{dist}:{so.name}", needed, torch_cuda, res)
    if not report.ok:  # never import a module already known to be broken
        return report
    for package in packages:
        for mod in package.imports:
            try:
                importlib.import_module(mod)
                report.add("import", True, f"import {mod}")
            except Exception as e:  # any failure: the report names it
                report.add("import", False, f"import {mod} failed: {type(e).__name__}: {e}")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pd_sessions.env.import_canary")
    p.add_argument(
        "connectors",
        nargs="+",
        choices=sorted({*kv_connectors.names(), *(p.name for p in kv_connectors.packages())}),
        help="connectors (or their packages) whose wheels to check",
    )
    p.add_argument(
        "--torch-cuda-major",
        default=None,
        help="override torch's CUDA major ('none' for CPU-only); default: ask torch",
    )
    p.add_argument(
        "--harness",
        action="store_true",
        help="also check that the harness's own dependencies (pyproject.toml) import here: "
        "for a --no-venv interpreter",
    )
    args = p.parse_args(argv)
    if args.torch_cuda_major is None:
        cuda = torch_cuda_major()
    else:
        cuda = None if args.torch_cuda_major == "none" else int(args.torch_cuda_major)
    report = run(args.connectors, cuda, harness=args.harness)
    print(f"import canary ({', '.join(args.connectors)}; torch {_cuda_name(cuda)}):")
    for f in report.findings:
        print(f"  [{'ok' if f.ok else 'FAIL'}] {f.check}: {f.message}")
    print(report.to_json())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
