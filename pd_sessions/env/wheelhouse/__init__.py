"""Offline installs: download every wheel a session needs for another machine, and install from them.

    nox -s wheelhouse -- --python 3.12 --cuda 13 --out DIR [--exclude-installed FREEZE_FILE]
    pd-sessions wheelhouse --python 3.12 --cuda none --out DIR

Build side (this package's CLI): the requirements of a GPU (or CPU) session -- vLLM, vllm-router,
the connector wheels in the variant for the target's CUDA major (each connector package's
``variants``, pd_sessions/core/connectors/; versions from ``requirements/kv_connectors.txt``),
lm-eval[api], nox,
pd-sessions' own runtime dependencies -- are resolved for the target interpreter and platform with
``uv pip compile --python-version --python-platform``, then each pinned requirement is downloaded
with one ``pip download --no-deps --python-version --platform ...`` call. Packages with no wheel for
the target (sqlitedict, rouge-score, word2number for lm-eval) come as sdists and are built with
``pip wheel --no-deps`` on a Python of the target's version (``--builder``). What the target
already has (``--exclude-installed``: ``pip freeze`` lines,
``name==version`` or a bare ``name`` when the version is unknown) is kept at its version: those
lines are resolver *overrides* (the target installs with ``--no-deps``, so a pin of another package,
e.g. vLLM's ``numba==0.65.0``, must not replace what is there) and are not downloaded; every
requirement the target's versions do not meet is listed in the manifest and printed.

The result: the wheels, ``manifest.json`` (target, and per wheel: name, version, file, sha256,
size), ``requirements.lock`` (``name==version`` lines) and ``SHA256SUMS``.

Consuming side: the sessions take ``--find-links DIR`` or ``PD_SESSIONS_FIND_LINKS`` and then install
with "no index, only this folder" (:mod:`pd_sessions.env.in_place`).

The package, layered (a contract in pyproject.toml keeps the order):

    cli       the parser and main: options checked, the build run, its summary printed
    download  the edge: uv and pip run (the runner is a parameter), wheels checked and hashed,
              the manifest, lock and checksums written
    resolve   pure: the target, the session's requirements, what is downloaded or left out and
              why, which wheels fit, what stays unmet, the manifest's data
"""

from __future__ import annotations

from pd_sessions.env.wheelhouse.wheelhouse_command import main

__all__ = ["main"]
