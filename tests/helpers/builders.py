"""One builder each for the values tests compute with: configs (:func:`cfg`), plans
(:func:`plan`, :func:`live_plan`), an argv's value (:func:`arg`), completions, ports, bench
documents."""

from __future__ import annotations

import sys
from typing import Any

from pd_sessions.checks.completions import Completion
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan import ClusterPlan, plan_cluster

GPUS4 = Inventory(gpus=("0", "1", "2", "3"), cpus=tuple(range(16)), gpu_source="nvidia-smi")
CPU2 = Inventory(gpus=(), cpus=(0, 1))


def cfg(name: str = "c", model: str = "m", **kw: Any) -> ClusterConfig:
    """A config ``name`` of ``model`` (default "m": a path-like name that is neither a hub id
    nor a model the harness generates), with the fields ``kw`` set."""
    return ClusterConfig(**{"name": name, "model": model, **kw})


def arg(argv: Any, flag: str) -> str:
    """The value after ``flag`` in ``argv`` (a list, or a planned process: its ``argv``)."""
    argv = getattr(argv, "argv", argv)
    return argv[argv.index(flag) + 1]


def plan(
    c: ClusterConfig | None = None,
    inv: Inventory | None = None,
    *,
    platform: str = "cuda",
    ports: Any = None,
    python: str = "/py",
    **kw: Any,
) -> ClusterPlan:
    """``plan_cluster`` of ``c`` (default :func:`cfg`) on ``inv`` (default GPUS4 on cuda, CPU2
    on cpu) with :class:`FakePorts` (and, given a ``layout``, FakePorts for each of its hosts),
    the interpreter "/py"; ``kw``: plan_cluster's other options."""
    if kw.get("layout") is not None:
        kw.setdefault("host_ports", {h.name: FakePorts() for h in kw["layout"].hosts})
    inv = inv or (CPU2 if platform == "cpu" else GPUS4)
    return plan_cluster(c or cfg(), inv, ports or FakePorts(), platform=platform, python=python, **kw)


def live_plan(**fields: Any) -> ClusterPlan:
    """A CPU plan of ``cfg(**fields)`` that a runtime test starts (on the fake stack): real free
    ports (taken, then released for the spawn), this interpreter, two cores."""
    from pd_sessions.runtime.ports import PortAllocator

    with PortAllocator() as ports:
        return plan(cfg(**fields), CPU2, platform="cpu", ports=ports, python=sys.executable)


def comp(ids=(1, 2, 3), text="abc", prompt_tokens=7, *, prompt_ids=None) -> Completion:
    """A /v1/completions answer that generated ``ids`` (None: the server returned no token ids)
    for a prompt of ``prompt_tokens`` tokens, or of the tokens ``prompt_ids`` when given."""
    return Completion(
        text=text,
        token_ids=tuple(ids) if ids is not None else None,
        prompt_tokens=len(prompt_ids) if prompt_ids is not None else prompt_tokens,
        completion_tokens=len(ids or ()),
        finish_reason="length",
        prompt_token_ids=tuple(prompt_ids) if prompt_ids is not None else None,
    )


class FakePorts:
    """Deterministic PortSource: sequential ports, blocks from 20000; can be told to repeat."""

    def __init__(self, repeat: int | None = None):
        self.next = 40000
        self.block = 20000
        self.repeat = repeat
        self.claimed: list[int] = []

    def take(self, label):
        if self.repeat is not None:
            return self.repeat
        self.next += 1
        return self.next

    def take_block(self, label, size):
        self.block += 100
        return self.block

    def claim(self, label, port):
        self.claimed.append(port)
        return port


def bench_doc(runs, **parts) -> dict:
    """A bench results.json document of ``runs`` (and the ``parts`` given) on a made-up machine."""
    from pd_sessions.bench import bench_results

    return {
        "started_at": "2026-11-29T00:00:00+00:00",
        "duration_s": 60.0,
        "machine": {
            "cpu_model": "cpu",
            "cores": 2,
            "memory_gib": 24,
            "platform": "linux",
            "python": "3.11",
            "load_before": "0",
            "load_after": "0",
        },
        "settings": {"platform": "cpu", "repeats": 3, "checks": ["smoke"]},
        "runs": runs,
        "clusters": bench_results.summarize_clusters(runs) if runs else {},
        **parts,
    }
