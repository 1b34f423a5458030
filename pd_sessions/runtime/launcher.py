"""Where a planned process runs: the contract every launcher keeps (edge).

A launcher starts a :class:`~pd_sessions.core.plan.ProcessSpec` with its output in the run's
directory and returns a :class:`~pd_sessions.runtime.process.Running` (its ``poll()`` says when
it has exited, its ``log_path`` holds its output), and stops a group of them under one grace:
SIGTERM, the grace, SIGKILL, every process verified gone (StopError naming survivors). The
cluster (runtime/cluster.py) uses only this, so it does not care where its processes run:

- :class:`LocalLauncher`: on this host, each process in a session of its own (runtime/process.py);
- ``runtime.raylaunch.RayLauncher``: each on its Ray node, through that node's agent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pd_sessions.core.errors import PlanError
from pd_sessions.core.plan import ClusterPlan, ProcessSpec
from pd_sessions.runtime import process
from pd_sessions.runtime.process import Running, StopReport


class Launcher(Protocol):
    def spawn(self, spec: ProcessSpec, run_dir: Path, base_env: Mapping[str, str]) -> Running:
        """Start ``spec``, its output going to ``run_dir/<log_name>``."""

    def stop(
        self,
        group: Sequence[Running],
        *,
        grace_s: float,
        early: Mapping[str, float] | None = None,
        freed: Callable[[], None] | None = None,
        after_children: Mapping[str, Callable[[], bool]] | None = None,
    ) -> StopReport:
        """Stop ``group`` together under one grace (process.stop's contract); ``freed`` is
        called once no process but the leaders is left (the devices are free), or at the end;
        ``after_children``: leaders SIGKILLed once their workers are gone (where supported)."""

    def link_counters(self, plan: ClusterPlan) -> dict[str, tuple[int, int]] | None:
        """Across hosts: host -> (rx_bytes, tx_bytes) of the interface of every host the plan runs
        instances on (checks/kv_link.py); None on one host."""

    def link_baseline(self) -> dict[str, tuple[int, int]] | None:
        """Across hosts: the same, as read on each host before its first process started."""

    def on_host(self, host: str, op: str, **kwargs: Any) -> Any:
        """Across hosts: wire operation ``op`` (runtime/wire_apply.py) on ``host``, in its network;
        PlanError on one host (there is no wire between prefill and decode)."""


class LocalLauncher:
    """Every process on this host."""

    def spawn(self, spec: ProcessSpec, run_dir: Path, base_env: Mapping[str, str]) -> Running:
        env = {**base_env, **spec.env_dict()}
        return process.spawn(
            spec.name, spec.argv, env=env, log_path=run_dir / spec.log_name, url=spec.url, private_tmp=True
        )

    def stop(
        self,
        group: Sequence[Running],
        *,
        grace_s: float,
        early: Mapping[str, float] | None = None,
        freed: Callable[[], None] | None = None,
        after_children: Mapping[str, Callable[[], bool]] | None = None,
    ) -> StopReport:
        return process.stop(group, grace_s=grace_s, early=early, freed=freed, after_children=after_children)

    def link_counters(self, plan: ClusterPlan) -> dict[str, tuple[int, int]] | None:
        return None

    def link_baseline(self) -> dict[str, tuple[int, int]] | None:
        return None

    def on_host(self, host: str, op: str, **kwargs: Any) -> Any:
        raise PlanError(
            "wire faults",
            "prefill and decode run on one host: there is no wire between them; run across hosts "
            "(--simulate-hosts 2 on this machine, or --ray ADDRESS)",
        )


LOCAL = LocalLauncher()
