"""The bug catalogue: every P/D bug class pd-sessions injects, one registry as data
(``pd_sessions/configs/bug_catalogue.toml``; docs/bug-catalogue.md). Pure: reads the TOML text,
checks every entry against the check registry, and answers what injects and what catches each
class. The recall table (core/recall_table.py) judges a run's results against it.

A class is injected either by a fault check (``injection.check``: its verdict judges it, PASS =
caught) or by config settings (``injection.settings``: e.g. a decode with other weights; every
check of ``caught_by`` must then FAIL on a config with those settings). ``connectors`` says where
`nox -s recall` runs it (a connector left out has a reason in ``not_run_reason``), ``ci_not_run``
where CI's shared runs leave it out, with the reason.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_sessions.core import check_registry, connectors
from pd_sessions.core.errors import ConfigError, did_you_mean

REGISTRY = Path(__file__).resolve().parent.parent / "configs" / "bug_catalogue.toml"

# The recall table's columns: the connectors `nox -s recall` runs every class on.
CONNECTORS = tuple(spec.name for spec in connectors.RECALL)
ENTRY_KEYS = (
    "id", "title", "links", "caught_by", "connectors", "detection", "injection", "not_run_reason",
    "ci_not_run",
)  # fmt: skip
INJECTION_KEYS = ("how", "check", "settings")
# The config settings that inject a bug class (core/config.py; the faulty decode), with the
# type of their value. A ConfigResult records the ones a config sets (its "injected").
INJECTION_SETTINGS: Mapping[str, type] = {
    "decode_weights_seed": int,
    "decode_kv_transfer": bool,
    "decode_num_gpu_blocks_override": int,  # from decode_extra_args' --num-gpu-blocks-override
}
NOT_A_CLASS_KEYS = ("check", "reason")
_ID = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_PLACEHOLDER = re.compile(r"\{([^{}]+)\}")


@dataclass(frozen=True)
class Injection:
    how: str  # in words
    check: str = ""  # the fault check that injects and judges it ("" = settings)
    settings: Mapping[str, Any] = field(default_factory=dict)  # the config settings that inject it


@dataclass(frozen=True)
class BugClass:
    id: str  # its name in the recall table
    title: str  # what goes wrong, one line
    links: tuple[str, ...]  # the users' reports (https://...) or docs/failure-modes.md rows
    injection: Injection
    caught_by: tuple[str, ...]  # the checks that must catch it
    connectors: tuple[str, ...]  # where `nox -s recall` runs it
    detection: str  # the detection figure's template ({details key}, {message})
    not_run_reason: Mapping[str, str] = field(default_factory=dict)  # connector -> why not run
    ci_not_run: Mapping[str, str] = field(default_factory=dict)  # connector -> why CI leaves it out

    def expected(self, *, ci: bool) -> tuple[str, ...]:
        """The connectors a run must cover it on: `nox -s recall`'s, less CI's declared ones."""
        return tuple(c for c in self.connectors if not (ci and c in self.ci_not_run))

    def reason_left_out(self, connector: str, *, ci: bool) -> str:
        """Why it is not expected on ``connector`` ("" = it is)."""
        if connector not in self.connectors:
            return self.not_run_reason.get(connector, "not in the class's connectors")
        return self.ci_not_run.get(connector, "") if ci else ""

    def matches_settings(self, injected: Mapping[str, Any]) -> bool:
        """Whether a config whose injected settings are ``injected`` injects this class."""
        s = self.injection.settings
        return bool(s) and all(k in injected and injected[k] == v for k, v in s.items())


@dataclass(frozen=True)
class NotAClass:
    check: str  # an injecting check
    reason: str  # why it is no bug class


@dataclass(frozen=True)
class Catalogue:
    bugs: tuple[BugClass, ...]
    not_classes: tuple[NotAClass, ...] = ()

    def ids(self) -> tuple[str, ...]:
        return tuple(b.id for b in self.bugs)


def injecting_checks() -> tuple[str, ...]:
    """Every check of the registry that injects something: a fault through the injector, or a
    fault on the wire between the hosts."""
    return tuple(dict.fromkeys((*check_registry.FAULTS, *check_registry.WIRE)))


def uncatalogued(catalogue: Catalogue) -> list[str]:
    """The injecting checks that are neither a class's injection nor declared no class."""
    known = {b.injection.check for b in catalogue.bugs} | {n.check for n in catalogue.not_classes}
    return [c for c in injecting_checks() if c not in known]


def _text(raw: Mapping[str, Any], key: str, where: str) -> str:
    v = raw.get(key, "")
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(key, f"must be a non-empty string, got {v!r}", source=where)
    return v


def _names(
    raw: Mapping[str, Any], key: str, where: str, allowed: tuple[str, ...], what: str
) -> tuple[str, ...]:
    v = raw.get(key)
    if not isinstance(v, list) or not v or not all(isinstance(s, str) for s in v):
        raise ConfigError(key, f"must be a non-empty list of {what}, got {v!r}", source=where)
    for s in v:
        if s not in allowed:
            raise ConfigError(
                key,
                f"unknown {what[:-1]} {s!r}{did_you_mean(s, allowed)}; known: {', '.join(allowed)}",
                source=where,
            )
    return tuple(v)


def _reasons(raw: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    v = raw.get(key, {})
    if not isinstance(v, Mapping):
        raise ConfigError(key, f"must be a table connector = reason, got {v!r}", source=where)
    for conn, reason in v.items():
        if conn not in CONNECTORS:
            raise ConfigError(
                f"{key}.{conn}", f"unknown connector{did_you_mean(conn, CONNECTORS)}; known: "
                f"{', '.join(CONNECTORS)}", source=where,
            )  # fmt: skip
        if not isinstance(reason, str) or not reason.strip():
            raise ConfigError(f"{key}.{conn}", "say why, as a non-empty string", source=where)
    return dict(v)


def _injection(raw: Any, where: str) -> Injection:
    if not isinstance(raw, Mapping):
        raise ConfigError(
            "injection", "give a [bug.injection] table: how, and check or settings", source=where
        )
    for key in raw:
        if key not in INJECTION_KEYS:
            raise ConfigError(
                f"injection.{key}", f"unknown key; one of {', '.join(INJECTION_KEYS)}", source=where
            )
    how = _text(raw, "how", f"{where} injection")
    check, settings = raw.get("check", ""), raw.get("settings", {})
    if bool(check) == bool(settings):
        raise ConfigError(
            "injection", "give exactly one of `check` (the fault check that injects it) and `settings` "
            "(the config settings that inject it)", source=where,
        )  # fmt: skip
    if check:
        injecting = injecting_checks()
        if check not in injecting:
            raise ConfigError(
                "injection.check", f"{check!r} is no injecting check{did_you_mean(str(check), injecting)}; "
                f"known: {', '.join(injecting)}", source=where,
            )  # fmt: skip
        return Injection(how=how, check=check)
    if not isinstance(settings, Mapping):
        raise ConfigError("injection.settings", f"must be a table, got {settings!r}", source=where)
    for key, value in settings.items():
        want = INJECTION_SETTINGS.get(key)
        if want is None:
            raise ConfigError(
                f"injection.settings.{key}", f"not a setting that injects a fault; known: "
                f"{', '.join(INJECTION_SETTINGS)}", source=where,
            )  # fmt: skip
        if type(value) is not want:
            raise ConfigError(
                f"injection.settings.{key}", f"must be a {want.__name__}, got {value!r}", source=where
            )
    return Injection(how=how, settings=dict(settings))


def _links(raw: Mapping[str, Any], where: str) -> tuple[str, ...]:
    links = raw.get("links")
    if not isinstance(links, list) or not links:
        raise ConfigError("links", "give the users' reports: a non-empty list of addresses", source=where)
    for link in links:
        if not isinstance(link, str) or not link.startswith(("https://", "docs/")):
            raise ConfigError(
                "links", f"{link!r}: give an https:// address upstream, or a docs/ page and row", source=where
            )
    return tuple(links)


def entry(raw: Any, source: str, index: int) -> BugClass:
    """One [[bug]], checked: ConfigError names the entry (its id, else its index) and the field."""
    where = f"{source}: bug {index}"
    if not isinstance(raw, Mapping):
        raise ConfigError("bug", f"must be a table, got {raw!r}", source=where)
    if isinstance(raw.get("id"), str) and raw["id"]:
        where = f"{source}: bug {raw['id']!r}"
    for key in raw:
        if key not in ENTRY_KEYS:
            raise ConfigError(
                key,
                f"unknown key{did_you_mean(key, ENTRY_KEYS)}; one of {', '.join(ENTRY_KEYS)}",
                source=where,
            )
    ident = _text(raw, "id", where)
    if not _ID.match(ident):
        raise ConfigError("id", f"{ident!r}: use lower-case letters, digits and -", source=where)
    connectors = _names(raw, "connectors", where, CONNECTORS, "connectors")
    not_run = _reasons(raw, "not_run_reason", where)
    missing = [c for c in CONNECTORS if c not in connectors and c not in not_run]
    if missing:
        raise ConfigError(
            "not_run_reason", f"{', '.join(missing)} left out of connectors: say why in "
            f"[bug.not_run_reason] ({missing[0]} = \"...\"), or add it to connectors", source=where,
        )  # fmt: skip
    ci_not_run = _reasons(raw, "ci_not_run", where)
    if not [c for c in connectors if c not in ci_not_run]:
        raise ConfigError("ci_not_run", "every class must run in CI on at least one connector", source=where)
    detection = _text(raw, "detection", where)
    if not _PLACEHOLDER.search(detection):
        raise ConfigError(
            "detection",
            "write it from the results: a {details key} or {message}, not a figure by hand",
            source=where,
        )
    return BugClass(
        id=ident,
        title=_text(raw, "title", where),
        links=_links(raw, where),
        injection=_injection(raw.get("injection"), where),
        caught_by=_names(raw, "caught_by", where, check_registry.NAMES, "checks"),
        connectors=connectors,
        detection=detection,
        not_run_reason=not_run,
        ci_not_run=ci_not_run,
    )


def _not_a_class(raw: Any, source: str, index: int) -> NotAClass:
    where = f"{source}: not_a_class {index}"
    if not isinstance(raw, Mapping) or set(raw) != set(NOT_A_CLASS_KEYS):
        raise ConfigError(
            "not_a_class", f"give exactly {' and '.join(NOT_A_CLASS_KEYS)}, got {raw!r}", source=where
        )
    check, reason = _text(raw, "check", where), _text(raw, "reason", where)
    if check not in injecting_checks():
        raise ConfigError(
            "check", f"{check!r} is no injecting check; known: {', '.join(injecting_checks())}", source=where
        )
    return NotAClass(check=check, reason=reason)


def parse(text: str, source: str = "bug_catalogue.toml") -> Catalogue:
    """Every entry of a catalogue's text; ConfigError on the first malformed one, a repeated id or
    an injecting check given twice."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("toml", str(e), source=source) from None
    extra = [k for k in data if k not in ("bug", "not_a_class")]
    if extra:
        raise ConfigError(
            extra[0], "unknown top-level key; entries are [[bug]] or [[not_a_class]]", source=source
        )
    bugs = tuple(entry(raw, source, i) for i, raw in enumerate(data.get("bug", [])))
    if not bugs:
        raise ConfigError("bug", "the catalogue has no [[bug]] entry", source=source)
    nots = tuple(_not_a_class(raw, source, i) for i, raw in enumerate(data.get("not_a_class", [])))
    seen: set[str] = set()
    for ident in (b.id for b in bugs):
        if ident in seen:
            raise ConfigError("id", f"{ident!r} appears twice", source=source)
        seen.add(ident)
    checks = [b.injection.check for b in bugs if b.injection.check] + [n.check for n in nots]
    twice = sorted({c for c in checks if checks.count(c) > 1})
    if twice:
        raise ConfigError("injection.check", f"{', '.join(twice)} injects more than one entry", source=source)
    return Catalogue(bugs=bugs, not_classes=nots)


def load(path: Path = REGISTRY) -> Catalogue:
    return parse(path.read_text(), str(path))
