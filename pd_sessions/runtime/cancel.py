"""A stop passed on to configs that run in threads of their own (edge, standard library only).

Signals reach the main thread only (runtime/console.py turns them into exceptions there). When a
sweep runs configs side by side (run/sweep.py), each in a worker thread, the main thread passes
the stop on with :func:`cancel`; each worker raises :class:`Cancelled` at its next cancel point
(:func:`check`): every tick of a readiness wait and of a guarded call (runtime/readiness.py),
where a config spends its time between its start and its teardown. The exception then takes
the way a stop takes in the main thread: the cluster's teardown, the config recorded
``cancelled``. Teardown has no cancel point, so a cancel never cuts it short.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class Cancelled(BaseException):
    """Raised in a worker thread the main thread cancelled; its message is the stop's cause
    ("stopped by SIGTERM", "interrupted (SIGINT)"), which the config's record quotes."""


_pending: dict[int, str] = {}
_lock = threading.Lock()


def cancel(threads: Iterable[threading.Thread], cause: str) -> None:
    """Each of ``threads`` raises Cancelled(``cause``) at its next cancel point."""
    with _lock:
        for t in threads:
            if t.ident is not None and t.is_alive():
                _pending[t.ident] = cause


def forget(thread: threading.Thread) -> None:
    """Drop a cancel not yet raised (the thread has ended: its id may be reused)."""
    with _lock:
        if thread.ident is not None:
            _pending.pop(thread.ident, None)


def check() -> None:
    """Raise Cancelled here if this thread was cancelled (once)."""
    if not _pending:  # the common case, without the lock
        return
    with _lock:
        cause = _pending.pop(threading.get_ident(), None)
    if cause is not None:
        raise Cancelled(cause)
