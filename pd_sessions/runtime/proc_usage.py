"""What a process pd-sessions started holds, with its whole tree: open file descriptors, threads and
resident memory, summed over the leader and every descendant (an instance's API server, its engine
core, its workers), read with psutil from /proc. The soak (checks/soak.py) reads it after each cycle.

A figure that cannot be read is said, never guessed: :class:`Unreadable` names the process and why
(on another host, gone, access denied).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from pd_sessions.core.errors import PdError
from pd_sessions.runtime.process import Running

FDS, THREADS, RSS = "fds", "threads", "rss_mib"


class Unreadable(PdError):
    """A process tree's usage could not be read; the message says which process and why."""


@dataclass(frozen=True)
class Usage:
    fds: int  # open file descriptors, summed over the tree
    threads: int  # threads, summed over the tree
    rss_mib: float  # resident set size in MiB, summed over the tree (shared pages counted in each)
    processes: int  # how many processes the tree had

    def as_dict(self) -> dict[str, float]:
        return {FDS: float(self.fds), THREADS: float(self.threads), RSS: round(self.rss_mib, 1)}


def tree_usage(r: Running) -> Usage:
    """``r``'s process and its descendants, summed; Unreadable naming why not."""
    if r.node is not None:
        raise Unreadable(f"{r.name} runs on {r.node}: its /proc is not readable from this host")
    try:
        leader = psutil.Process(r.pid)
        tree = [leader, *leader.children(recursive=True)]
    except psutil.Error as e:
        raise Unreadable(f"{r.name} (pid {r.pid}): {type(e).__name__}: {e}") from e
    fds = threads = 0
    rss = 0
    counted = 0
    for p in tree:
        try:
            with p.oneshot():
                fds += p.num_fds()
                threads += p.num_threads()
                rss += p.memory_info().rss
            counted += 1
        except psutil.NoSuchProcess:
            continue  # a child that exited between the listing and the read holds nothing
        except psutil.Error as e:
            raise Unreadable(f"{r.name} (pid {p.pid}): {type(e).__name__}: {e}") from e
    if counted == 0:
        raise Unreadable(f"{r.name} (pid {r.pid}): no process of its tree is alive")
    return Usage(fds, threads, rss / 2**20, counted)
