"""Configs side by side: each in a worker thread of its own, started in the packing's order
(core/plan/packing.py) as soon as its GPUs or cores are free.

- **Start**: a config starts once no running config holds any of its GPUs (cores on the CPU lane)
  and fewer than ``max_parallel`` configs hold resources. A config's resources are free as soon
  as its engine cores and workers are gone (cluster.teardown's ``freed``), while the rest of its
  teardown (the API servers, the router: ports only) goes on: the next config starts meanwhile.
- **Console**: every line of a config is prefixed by its name (``2x2 | ...``); the start and end
  lines keep the serial sweep's ``[i/n] name: ...``.
- **Lifeline**: spawns from any thread reach the one reaper (process.observed); children spawned
  by a worker thread get no parent-death signal (the kernel ties it to the spawning thread), so
  the reaper alone stops them if the harness is SIGKILLed.
- **Cancel** (SIGINT, SIGTERM, the parent gone: an exception in this, the main, thread): every
  running config is cancelled (runtime/cancel.py: it tears its cluster down and records itself
  ``cancelled``), this thread waits for all of them, and the stop goes on up; configs never
  started are ``not run`` (unfinished.complete).
- **Results**: in the sweep's order, whatever order the configs ended in.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan.packing import Packing, Placed
from pd_sessions.core.results import ERROR, ConfigResult
from pd_sessions.report import unfinished
from pd_sessions.runtime import cancel

log = logging.getLogger(__name__)

# run_one(config, its share of the inventory, progress, its record, freed) -> its record
RunOne = Callable[
    [ClusterConfig, Inventory, Callable[[str], None], ConfigResult, Callable[[], None]], ConfigResult
]
# start(config, i, n, progress) -> its record, outcome running (said as it starts)
Start = Callable[[ClusterConfig, int, int, Callable[[str], None]], ConfigResult]


class Board:
    """Which running config holds which resources; who may start."""

    def __init__(self, platform: str, limit: int):
        self.platform = platform
        self.limit = limit
        self.holding: dict[int, frozenset[str]] = {}
        self.cond = threading.Condition()

    def fits(self, p: Placed) -> bool:
        want = p.holds(self.platform)
        return len(self.holding) < self.limit and all(not (want & h) for h in self.holding.values())

    def take(self, p: Placed, *, tick: float = 0.2) -> None:
        """Wait until ``p`` fits, then hold its resources (waits in ticks: a signal to this thread
        is raised here at once)."""
        with self.cond:
            while not self.fits(p):
                self.cond.wait(tick)
            self.holding[p.index] = p.holds(self.platform)

    def free(self, p: Placed) -> None:
        with self.cond:
            if self.holding.pop(p.index, None) is not None:
                self.cond.notify_all()


def run_packed(
    configs: Sequence[ClusterConfig],
    packing: Packing,
    progress: Callable[[str], None],
    results: list[ConfigResult],
    on_change: Callable[[list[ConfigResult]], None] | None,
    *,
    start: Start,
    run_one: RunOne,
) -> list[ConfigResult]:
    """Run every config of ``packing`` (see the module's docstring); ``results`` in the sweep's order."""
    board = Board(packing.platform, packing.max_parallel)
    lock = threading.Lock()  # results and on_change
    threads: list[threading.Thread] = []
    n = len(configs)

    def changed() -> None:
        if on_change is not None:
            with lock:
                on_change(results)

    def work(p: Placed, res: ConfigResult) -> None:
        name = p.name
        try:
            run_one(
                configs[p.index],
                p.inventory,
                lambda msg: progress(f"{name} | {msg}"),
                res,
                lambda: board.free(p),
            )
        except cancel.Cancelled:
            pass  # recorded as cancelled by run_one; the main thread re-raises the stop itself
        except BaseException:  # run_one records every error; this is a bug: say it, keep the sweep going
            log.exception("%s: the config's thread failed", name)
            res.outcome, res.error = ERROR, res.error or f"{name}: its thread failed (see the log)"
        finally:
            board.free(p)
            progress(f"[{p.index + 1}/{n}] {name}: {res.outcome.upper()}")
            changed()

    try:
        for p in packing.order:
            board.take(p)
            res = start(configs[p.index], p.index + 1, n, progress)
            with lock:
                results.append(res)
            changed()
            t = threading.Thread(target=work, args=(p, res), name=f"pd-config-{p.name}", daemon=True)
            threads.append(t)
            t.start()
        _join(threads)
    except BaseException as e:  # a stop: every running config is cancelled; wait for their teardowns
        cause = unfinished.stop_cause(e)
        running = [t for t in threads if t.is_alive()]
        progress(f"{cause}: cancelling {len(running)} running config(s), waiting for their teardown")
        cancel.cancel(running, cause)
        _join(threads)
        raise
    finally:
        for t in threads:
            cancel.forget(t)
        order = {c.name: i for i, c in enumerate(configs)}
        with lock:
            results.sort(key=lambda r: order.get(r.name, len(order)))
    return results


def _join(threads: Iterable[threading.Thread], tick: float = 0.2) -> None:
    """Wait for every thread, in ticks (a signal to this thread is raised here at once)."""
    for t in threads:
        while t.is_alive():
            t.join(tick)
