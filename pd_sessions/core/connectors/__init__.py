"""The KV connectors the harness knows, one module each (``mooncake``, ``nixl``, ``nixl_push``), and
the registry the rest of the harness reads them from.

Adding a connector is one module here (a :class:`~pd_sessions.core.connectors.base.ConnectorSpec`
named ``SPEC``, listed in :data:`ALL`), its tests (``tests/test_connectors.py`` runs every
registered spec through the same checks) and a sweep file (``configs/<name>_sweep.toml``: the
noxfile makes ``nox -s <name>_sweep`` from it). Nothing outside this package branches on a
connector's name (``tests/test_connector_names.py`` reads the source to keep it so).

Standard library only: ``envfacts`` imports it inside interpreters that have nothing else yet,
and the noxfile with nox's own.
"""

from __future__ import annotations

from collections.abc import Iterable

from pd_sessions.core.connectors import mooncake, nixl, nixl_push
from pd_sessions.core.connectors.base import ConnectorSpec, Option, Package
from pd_sessions.core.errors import ConfigError, did_you_mean

# Every connector, in the order sweeps, tables and install plans list them.
ALL: tuple[ConnectorSpec, ...] = (mooncake.SPEC, nixl.SPEC, nixl_push.SPEC)
# The connector a config gets when it names none, and the examples' default cluster.
DEFAULT = mooncake.SPEC
MOONCAKE, NIXL, NIXL_PUSH = mooncake.SPEC, nixl.SPEC, nixl_push.SPEC
# The connectors the recall table covers (configs/bug_catalogue.toml): those `nox -s faults`
# injects into, the pull connectors the fault injector wraps.
RECALL: tuple[ConnectorSpec, ...] = (MOONCAKE, NIXL)
# The connector the soak runs over (`nox -s soak`, `pd-sessions soak`: its spec's sweep): restart in
# place works over it; over Mooncake it is a known upstream bug (router-stale-mooncake-engine-id).
SOAK: ConnectorSpec = NIXL

_BY_NAME = {spec.name: spec for spec in ALL}


def names() -> tuple[str, ...]:
    """Every connector's config value."""
    return tuple(_BY_NAME)


def get(name: str) -> ConnectorSpec:
    """The spec of the connector a config names; ConfigError("connector") listing the known ones."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ConfigError(
            "connector",
            f"got {name!r}; allowed: {', '.join(_BY_NAME)}{did_you_mean(str(name), _BY_NAME)}",
        ) from None


def packages(connector_names: Iterable[str] | None = None) -> tuple[Package, ...]:
    """The packages the named connectors (default: all) need, each once, in registry order.
    A package's own name is accepted too (``nox -s <package>_imports``, the canary)."""
    wanted = set(names() if connector_names is None else connector_names)
    out: dict[str, Package] = {}
    for spec in ALL:
        if spec.name in wanted or spec.package.name in wanted:
            out.setdefault(spec.package.name, spec.package)
    unknown = wanted - set(_BY_NAME) - {p.name for p in out.values()}
    if unknown:
        name = sorted(unknown)[0]
        known = sorted({*names(), *(s.package.name for s in ALL)})
        raise ConfigError(
            "connector", f"got {name!r}; allowed: {', '.join(known)}{did_you_mean(name, known)}"
        )
    return tuple(out.values())


def package(name: str) -> Package:
    """One package by its name (or by a connector that needs it)."""
    return packages([name])[0]


def options() -> tuple[Option, ...]:
    """Every connector's own config fields, in registry order."""
    return tuple(o for spec in ALL for o in spec.options)


__all__ = [
    "ALL",
    "DEFAULT",
    "MOONCAKE",
    "NIXL",
    "NIXL_PUSH",
    "ConnectorSpec",
    "Option",
    "Package",
    "get",
    "names",
    "options",
    "package",
    "packages",
]
