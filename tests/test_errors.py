"""The exception family: every error the package raises for a known failure is a PdError."""

from __future__ import annotations

import ast
import builtins
import socket

import pytest
from helpers import ROOT

from pd_sessions.core.errors import HttpError, PdError
from pd_sessions.runtime import http

# Classes that may derive from a builtin exception without going through PdError, and why.
OUTSIDE_THE_FAMILY = {
    "PdError",  # the family's root
    # a stop (SIGTERM/SIGHUP), not an error: it must pass `except Exception` on its way up
    "Stopped",
    # SIGTERM/SIGHUP in nox's interpreter, raised as nox's Ctrl-C so that nox waits for the harness
    "NoxStopped",
    # the same stop passed on to a config running in a worker thread (runtime/cancel.py)
    "Cancelled",
    # an absent metric; every place that reads one catches it next to HttpError
    "MetricMissing",
}
BUILTIN_EXCEPTIONS = {
    n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
}


def _defined_classes():
    for path in sorted((ROOT / "pd_sessions").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                yield path.relative_to(ROOT), node.name, bases


def test_package_exceptions_derive_from_pd_error():
    outside = {
        f"{path}: {name}({', '.join(sorted(bases & BUILTIN_EXCEPTIONS))})"
        for path, name, bases in _defined_classes()
        if bases & BUILTIN_EXCEPTIONS and name not in OUTSIDE_THE_FAMILY
    }
    assert not outside, f"derive these from a PdError (pd_sessions/errors.py): {sorted(outside)}"


def test_no_builtin_timeout_error_is_raised():
    raised = [
        f"{path}:{node.lineno}"
        for path in sorted((ROOT / "pd_sessions").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Raise)
        and isinstance(node.exc, ast.Call)
        and isinstance(node.exc.func, ast.Name)
        and node.exc.func.id == "TimeoutError"
    ]
    assert not raised, f"raise a PdError (e.g. errors.GuardTimeout), not the builtin TimeoutError: {raised}"


def test_http_error_is_a_pd_error_and_one_class():
    assert issubclass(HttpError, PdError)
    assert http.HttpError is HttpError  # callers catch http.HttpError; the family lives in errors.py


def test_a_failed_request_is_caught_as_a_pd_error():
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(PdError, match=rf"127.0.0.1:{port}/health: connection refused") as info:
        http.request(f"http://127.0.0.1:{port}/health", timeout=2)
    assert isinstance(info.value, HttpError) and info.value.exit_status == 1
