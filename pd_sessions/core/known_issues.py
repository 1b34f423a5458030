"""Known upstream bugs: one registry, as data (``pd_sessions/configs/known_issues.toml``), and the
verdicts it gives the checks that reproduce them. Pure: the installed versions are passed in.

An entry names the upstream link, what breaks, the component and version range (a PEP 440
specifier on vLLM, vllm-router or a connector's package), the check that reproduces it (on which
connector and lane) and how its failure is recognised (``fails_when``: conditions on the check's
details or message). In range, the check still runs, bounded, and :func:`judge` turns its
verdict into XFAIL, XPASS or FAIL; out of range it is an ordinary check. An entry without a check
says how it is handled instead (``handled``: a refusal before launch, which cites it with
:func:`cite`, or a setting of the CPU lane).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from pd_sessions.core.errors import ConfigError
from pd_sessions.core.results import FAIL, XFAIL, XPASS, CheckResult

REGISTRY = Path(__file__).resolve().parent.parent / "configs" / "known_issues.toml"

ENTRY_KEYS = (
    "id", "link", "breaks", "component", "versions", "check", "handled", "connector", "platform",
    "after", "fails_when",
)  # fmt: skip
CONDITION_KEYS = ("detail", "equals", "one_of", "subset_of", "absent", "message")
_MISSING = object()


@dataclass(frozen=True)
class Condition:
    """One part of "fails the way the entry says": a details key (dotted: nested) that ``equals``
    a value, is ``one_of`` a list, is a non-empty list whose every item is in ``subset_of`` (a bug
    whose cases reproduce some of the time each), or is ``absent`` (missing or None; False:
    present), or a ``message`` regex searched in the check's message."""

    detail: str = ""
    equals: Any = _MISSING
    one_of: tuple[Any, ...] | None = None
    subset_of: tuple[Any, ...] | None = None
    absent: bool | None = None
    message: str = ""

    def holds(self, r: CheckResult) -> bool:
        if self.message:
            return re.search(self.message, r.message) is not None
        value = _lookup(r.details, self.detail)
        if self.absent is not None:
            return (value is None) == self.absent
        if self.one_of is not None:
            return value in self.one_of
        if self.subset_of is not None:
            return isinstance(value, list) and bool(value) and all(v in self.subset_of for v in value)
        return bool(value == self.equals)

    def describe(self) -> str:
        if self.message:
            return f"message ~ /{self.message}/"
        if self.absent is not None:
            return f"{self.detail} {'absent' if self.absent else 'present'}"
        if self.one_of is not None:
            return f"{self.detail} in {list(self.one_of)!r}"
        if self.subset_of is not None:
            return f"{self.detail}: some of {list(self.subset_of)!r}, nothing else"
        return f"{self.detail} == {self.equals!r}"


def _lookup(details: Mapping[str, Any], dotted: str) -> Any:
    value: Any = details
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


@dataclass(frozen=True)
class KnownIssue:
    id: str  # what verdicts, refusals and the retire message cite
    link: str  # the upstream issue (or source line, where no issue exists)
    breaks: str  # what goes wrong, as seen
    component: str  # "vllm", "vllm-router", or a connector's package module
    versions: SpecifierSet  # the range it is known in ("" = every version)
    check: str = ""  # the check that reproduces it; "" = none does
    handled: str = ""  # how pd-sessions handles it instead (check == ""): a refusal, a setting
    connector: str = ""  # "" = any
    platform: str = ""  # "" = any
    # the check that makes the bug happen, where that is another than ``check`` (a strand that
    # conservation sees after request_features' n > 1): the entry applies only in a window where
    # it ran before (else ``check`` passing says nothing of the bug: no XPASS); "" = always
    after: str = ""
    fails_when: tuple[Condition, ...] = ()

    def in_range(self, installed: str | None) -> bool:
        """Whether ``installed`` (the component's version; None: unknown) is in the range. An
        unknown or unreadable version counts as in range: the bug is expected until seen fixed."""
        if installed is None:
            return True
        try:
            return Version(installed) in self.versions
        except InvalidVersion:
            return True

    def applies(self, check: str, *, connector: str, platform: str) -> bool:
        return self.check == check and self.connector in ("", connector) and self.platform in ("", platform)

    def matches(self, r: CheckResult) -> bool:
        return all(c.holds(r) for c in self.fails_when)

    def to_dict(self, installed: str | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "link": self.link,
            "component": self.component,
            "versions": str(self.versions),
            "installed": installed,
            "fails_when": [c.describe() for c in self.fails_when],
        }


def _text(raw: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> str:
    v = raw.get(key, "")
    if not isinstance(v, str) or (required and not v.strip()):
        raise ConfigError(key, f"must be a non-empty string, got {v!r}", source=where)
    return v


def _condition(raw: Any, where: str) -> Condition:
    if not isinstance(raw, Mapping):
        raise ConfigError("fails_when", f"each condition must be a table, got {raw!r}", source=where)
    for key in raw:
        if key not in CONDITION_KEYS:
            raise ConfigError(
                f"fails_when.{key}", f"unknown key; one of {', '.join(CONDITION_KEYS)}", source=where
            )
    if "message" in raw:
        try:
            re.compile(str(raw["message"]))
        except re.error as e:
            raise ConfigError("fails_when.message", f"not a regex: {e}", source=where) from None
        return Condition(message=str(raw["message"]))
    detail = raw.get("detail")
    if not isinstance(detail, str) or not detail:
        raise ConfigError(
            "fails_when.detail", "give a details key (or `message`, a regex of the message)", source=where
        )
    tests = [k for k in ("equals", "one_of", "subset_of", "absent") if k in raw]
    if len(tests) != 1:
        raise ConfigError(
            "fails_when",
            f"{detail}: give exactly one of equals, one_of, subset_of, absent (got {tests})",
            source=where,
        )
    for key in ("one_of", "subset_of"):
        if key in raw and not isinstance(raw[key], list):
            raise ConfigError(f"fails_when.{key}", f"must be a list, got {raw[key]!r}", source=where)
    if "absent" in raw and not isinstance(raw["absent"], bool):
        raise ConfigError("fails_when.absent", f"must be true or false, got {raw['absent']!r}", source=where)
    return Condition(
        detail=detail,
        equals=raw.get("equals", _MISSING),
        one_of=tuple(raw["one_of"]) if "one_of" in raw else None,
        subset_of=tuple(raw["subset_of"]) if "subset_of" in raw else None,
        absent=raw.get("absent"),
    )


def entry(raw: Any, source: str, index: int) -> KnownIssue:
    """One entry, checked: ConfigError names the entry (its id, else its index) and the field."""
    where = f"{source}: issue {index}"
    if not isinstance(raw, Mapping):
        raise ConfigError("issue", f"must be a table, got {raw!r}", source=where)
    if isinstance(raw.get("id"), str) and raw["id"]:
        where = f"{source}: issue {raw['id']!r}"
    for key in raw:
        if key not in ENTRY_KEYS:
            raise ConfigError(key, f"unknown key; one of {', '.join(ENTRY_KEYS)}", source=where)
    ident, link = _text(raw, "id", where), _text(raw, "link", where)
    if not link.startswith("https://"):
        raise ConfigError("link", f"must be an https:// address upstream, got {link!r}", source=where)
    try:
        versions = SpecifierSet(_text(raw, "versions", where, required=False))
    except InvalidSpecifier as e:
        raise ConfigError(
            "versions", f"not a PEP 440 specifier ({e}), e.g. '>=0.32.0,<0.34'", source=where
        ) from None
    check = _text(raw, "check", where, required=False)
    handled = _text(raw, "handled", where, required=False)
    fails = raw.get("fails_when", [])
    if not isinstance(fails, list):
        raise ConfigError("fails_when", "must be a list of tables ([[issue.fails_when]])", source=where)
    if check and not fails:
        raise ConfigError(
            "fails_when", f"say how {check}'s failure is recognised as this bug (a condition)", source=where
        )
    if not check and not handled:
        raise ConfigError(
            "check",
            "name the check that reproduces it, or `handled`: how it is handled instead",
            source=where,
        )
    return KnownIssue(
        id=ident,
        link=link,
        breaks=_text(raw, "breaks", where),
        component=_text(raw, "component", where),
        versions=versions,
        check=check,
        handled=handled,
        connector=_text(raw, "connector", where, required=False),
        platform=_text(raw, "platform", where, required=False),
        after=_text(raw, "after", where, required=False),
        fails_when=tuple(_condition(c, where) for c in fails),
    )


def parse(text: str, source: str = "known_issues.toml") -> tuple[KnownIssue, ...]:
    """Every entry of a registry's text; ConfigError on the first malformed one or a repeated id."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("toml", str(e), source=source) from None
    extra = [k for k in data if k != "issue"]
    if extra:
        raise ConfigError(extra[0], "unknown top-level key; entries are [[issue]] tables", source=source)
    out = tuple(entry(raw, source, i) for i, raw in enumerate(data.get("issue", [])))
    seen: set[str] = set()
    for issue in out:
        if issue.id in seen:
            raise ConfigError("id", f"{issue.id!r} appears twice", source=source)
        seen.add(issue.id)
    return out


def load(path: Path = REGISTRY) -> tuple[KnownIssue, ...]:
    return parse(path.read_text(), str(path))


def get(ident: str, issues: Sequence[KnownIssue] | None = None) -> KnownIssue:
    """The entry ``ident``; KeyError names the known ids."""
    for e in load() if issues is None else issues:
        if e.id == ident:
            return e
    raise KeyError(f"no known issue {ident!r} in {REGISTRY.name}")


def cite(ident: str) -> str:
    """How a refusal cites its entry: "known issue ID: LINK"."""
    return f"known issue {ident}: {get(ident).link}"


def every_applicable(
    issues: Sequence[KnownIssue],
    check: str,
    *,
    connector: str,
    platform: str,
    versions: Mapping[str, str],
    ran: Collection[str] | None = None,
) -> list[tuple[KnownIssue, str | None]]:
    """The entries whose check, connector and lane are these and whose range holds the installed
    version (``versions``: component -> version), each with that version, in the registry's
    order; none: the check is an ordinary one here. ``ran``: the checks that ran before it in
    its window (None: not known; an entry's ``after`` is then not required)."""
    out = []
    for e in issues:
        if e.after and ran is not None and e.after not in ran:
            continue
        if e.applies(check, connector=connector, platform=platform) and e.in_range(versions.get(e.component)):
            out.append((e, versions.get(e.component)))
    return out


def judge(r: CheckResult, issue: KnownIssue, installed: str | None) -> CheckResult:
    """The verdict of a check whose known issue is in range (``installed``: the component's
    version, None when unknown):

    =====================================  =======================================================
    the check                              verdict
    =====================================  =======================================================
    failed the way the entry says          XFAIL "still broken upstream: LINK (known issue ID)"
    passed                                 XPASS "fixed in COMPONENT X.Y: retire known issue ID"
                                           (fails the run)
    failed another way                     FAIL, its own message and what the entry expected
    NOT RUN                                NOT RUN (it did not look: nothing to say of the bug)
    =====================================  =======================================================
    """
    details = {**r.details, "known_issue": issue.to_dict(installed)}
    version = installed or "(version unknown)"
    if r.passed:
        verdict, msg = (
            XPASS,
            f"fixed in {issue.component} {version}: retire known issue {issue.id} ({issue.link}); "
            f"it passed: {r.message}",
        )
    elif r.verdict == FAIL and issue.matches(r):
        verdict, msg = XFAIL, f"still broken upstream: {issue.link} (known issue {issue.id}): {r.message}"
    elif r.verdict == FAIL:
        expected = "; ".join(c.describe() for c in issue.fails_when)
        verdict, msg = (
            FAIL,
            f"{r.message} (not the way known issue {issue.id} fails: it expects {expected})",
        )
    else:
        return r
    return CheckResult(
        r.name,
        verdict,
        msg,
        details,
        seconds=r.seconds,
        figures=r.figures,
        tables=r.tables,
        started_at=r.started_at,
    )
