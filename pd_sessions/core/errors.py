"""The exception family. Each error says what failed, where, and how to fix it.

Exit statuses used by the CLI:
    2  ConfigError / UsageError: nothing was launched.
    1  every other PdError (a process died, a check failed, an install failed).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path


class PdError(Exception):
    """Base class. ``exit_status`` is what the CLI exits with."""

    exit_status = 1


class ConfigError(PdError):
    """A bad config value or flag. Raised before anything is launched."""

    exit_status = 2

    def __init__(self, field: str, message: str, *, source: str | None = None):
        self.field = field
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field}: {message}")


class UsageError(PdError):
    """A bad command-line argument."""

    exit_status = 2


class PlanError(ConfigError):
    """The config cannot be placed on this host (too few GPUs, port taken, ...)."""


class InstallError(PdError):
    """An environment install action failed."""


class ProcessExited(PdError):
    """A process we started exited while it should have been running."""

    def __init__(
        self,
        name: str,
        *,
        pid: int,
        returncode: int | None,
        url: str | None,
        log_path: Path | None,
        log_tail: str,
        when: str,
    ):
        self.name = name
        self.pid = pid
        self.returncode = returncode
        self.url = url
        self.log_path = log_path
        self.log_tail = log_tail
        where = f" ({url})" if url else ""
        super().__init__(
            with_tail(
                f"{name}{where} exited with status {describe_status(returncode)} "
                f"{when}; pid {pid}, log {log_path}",
                log_tail,
            )
        )


class ReadinessTimeout(PdError):
    """A process did not become ready before the deadline."""

    def __init__(
        self, name: str, *, url: str, waited_s: float, last_probe: str, log_path: Path | None, log_tail: str
    ):
        self.name = name
        self.url = url
        self.waited_s = waited_s
        self.log_path = log_path
        self.log_tail = log_tail
        super().__init__(
            with_tail(
                f"{name} ({url}) was not ready after {waited_s:.1f} s "
                f"(last probe: {last_probe}); log {log_path}",
                log_tail,
            )
        )


class StopError(PdError):
    """Processes survived teardown (should never happen; says which)."""


class HostSetupError(PdError):
    """The simulated hosts (``--simulate-hosts``) could not be set up or removed: says which
    step, which namespace or link, and the kernel's answer."""


class RouteError(PdError):
    """A connection to a simulated host's address (198.18.0.0/15) was refused before it was made:
    its route does not go through its run's bridge (the bridge is gone, or the run is). Names the
    address, the bridge and the run (runtime/routeguard.py)."""

    def __init__(self, address: str, message: str, *, bridge: str | None = None, run_id: str | None = None):
        self.address = address
        self.bridge = bridge
        self.run_id = run_id
        super().__init__(f"{address}: {message}")


class UnknownGatherer(PdError):
    """A check's registration names a gatherer that is not there: a defect of the package (the
    check could never run), raised when checks/runner.py is imported."""


class CheckFailed(PdError):
    """A check ran and its verdict is 'fail'."""


class BenchError(PdError):
    """A benchmark measurement could not be made (says which and why)."""


class PerfError(PdError):
    """The perf check could not measure: its bench driver or transport probe failed, or a
    bench result lacks a figure. The check fails with it; the config goes on."""


class HttpError(PdError):
    """A request to one of our own servers failed: connection error, timeout or non-2xx status
    (raised by pd_sessions.runtime.http; ``status`` is the HTTP status when there was one)."""

    def __init__(self, url: str, message: str, status: int | None = None):
        self.url = url
        self.status = status
        self.reason = message
        super().__init__(f"{url}: {message}")


class GuardTimeout(PdError):
    """A call run under ``readiness.guarded(timeout=...)`` did not return in time (the
    processes it watched were alive throughout; the call's thread is abandoned)."""

    def __init__(self, when: str, timeout_s: float):
        self.when = when
        self.timeout_s = timeout_s
        super().__init__(f"{when}: no answer within {timeout_s:.0f} s")


def with_tail(message: str, log_tail: str) -> str:
    """``message`` followed by the process's log tail, when there is one."""
    return message + ("\n--- last lines of its log ---\n" + log_tail if log_tail else "")


def describe_status(returncode: int | None) -> str:
    """Render a Popen returncode: negative numbers are signals."""
    import signal

    if returncode is None:
        return "unknown"
    if returncode < 0:
        try:
            return f"{returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return str(returncode)
    return str(returncode)


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """' (did you mean "x"?)' when a choice is close to ``value``, else ''."""
    close = difflib.get_close_matches(value, list(choices), n=1)
    return f' (did you mean "{close[0]}"?)' if close else ""
