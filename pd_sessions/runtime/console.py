"""What every entry point shares (standard library only): timestamped progress lines, signals
turned into exceptions so teardown runs, and our errors turned into exit statuses.

The CLI (pd_sessions.cli) and its bench subcommand (pd_sessions.bench.bench_command) both use these; they
live here so that neither reaches into the other.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from pd_sessions.core.errors import ConfigError, PdError
from pd_sessions.runtime import parentwatch


class Stopped(BaseException):
    """Raised in the main thread when SIGTERM arrives (SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}{parentwatch.parent_note()}")


_T0 = time.monotonic()


_SAY = threading.Lock()  # configs side by side (run/packed.py) say from threads of their own


def say(msg: str) -> None:
    with _SAY:
        print(f"[pd-sessions {time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def install_signal_handlers() -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        # Later signals are ignored so they cannot cut the teardown short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGHUP, handler)  # the terminal closed


def run_command(command: Callable[[], int], *, prog: str) -> int:
    """Run an entry point's command: our errors and signals become exit statuses
    (2 config/usage, 1 other errors, 128+N on signal N after teardown)."""
    try:
        return command()
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        return e.exit_status
    except PdError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_status
    except Stopped as e:
        say(f"{e}: teardown done")
        return 128 + e.signum
    except KeyboardInterrupt:
        say("interrupted (SIGINT): teardown done")
        return 128 + signal.SIGINT
