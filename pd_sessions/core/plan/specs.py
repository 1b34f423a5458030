"""What the planner produces: one frozen spec per process, and the plan that holds them."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from pd_sessions.core.config import TINY_MODELS, ClusterConfig, Platform


@dataclass(frozen=True)
class ProcessSpec:
    """Everything needed to start and probe one process."""

    name: str  # "prefill-0", "decode-1", "router"
    role: str  # "prefill" | "decode" | "router"
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # added to the inherited environment
    host: str  # the address it advertises: its URL's host
    port: int  # HTTP port
    log_name: str
    gpus: tuple[str, ...] = ()
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND value on the CPU lane
    bootstrap_port: int | None = None
    internal_ports: tuple[int, int] | None = None  # [first, last] of the VLLM_PORT block
    bind: str | None = None  # the address it binds (--host); None: ``host``
    node: str | None = None  # across hosts: the host it runs on ("host1"); None: the driver's

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


@dataclass(frozen=True)
class ClusterPlan:
    config: ClusterConfig
    platform: Platform
    model: str  # what --model gets (path or hub id)
    served_model_name: str  # what requests name
    prefill: tuple[ProcessSpec, ...]
    decode: tuple[ProcessSpec, ...]
    router: ProcessSpec
    warnings: tuple[str, ...] = ()
    ports: tuple[tuple[str, int], ...] = field(default=())
    # The command line's overrides, described; the config above already has them.
    overrides: tuple[str, ...] = ()
    # Facts worth reading in the plan that are not warnings (where passed-through env came from...).
    notes: tuple[str, ...] = ()
    # Across hosts: host name -> its address, in plan order (the router's host first); () on one host.
    hosts: tuple[tuple[str, str], ...] = ()

    @property
    def instances(self) -> tuple[ProcessSpec, ...]:
        return self.prefill + self.decode

    @property
    def processes(self) -> tuple[ProcessSpec, ...]:
        return self.instances + (self.router,)

    def render(self) -> str:
        """Human-readable plan for --dry-run and logs."""
        lines = self._header_lines()
        for p in self.processes:
            lines += _process_lines(p)
        if not self.hosts:
            lines.append(_ports_line("  ports: all", self.ports))
        for name, address in self.hosts:
            mine = [(label.split("/", 1)[1], p) for label, p in self.ports if label.startswith(name + "/")]
            lines.append(_ports_line(f"  ports on {name} ({address}): all", mine))
        return "\n".join(lines)

    def _header_lines(self) -> list[str]:
        """The plan's first lines: the config, the model, overrides, remote code, warnings, notes."""
        c = self.config
        lines = [
            f"plan {c.name}: {c.shape}, connector {c.connector}, platform {self.platform}",
            f"  model: {self.model} (served as {self.served_model_name})",
        ]
        for o in self.overrides:
            lines.append(f"  override (command line): {o}")
        if c.trust_remote_code:
            pin = (
                "generated locally (pd_sessions.runtime.tiny_model), no hub revision"
                if c.model in TINY_MODELS and not c.revision
                else f"revision {c.revision or 'UNPINNED'}"
            )
            lines.append(f"  remote code: trusted, {pin}")
        for w in self.warnings:
            lines.append(f"  WARNING: {w}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        return lines


def _ports_line(head: str, ports: Sequence[tuple[str, int]]) -> str:
    named = [(label, port) for label, port in ports if "+" not in label]
    return f"{head} {len(ports)} distinct; " + ", ".join(f"{label}={port}" for label, port in named)


def _process_lines(p: ProcessSpec) -> list[str]:
    """One process in the rendered plan: where it runs, its ports, env and argv."""
    place = f"GPUs {','.join(p.gpus)}" if p.gpus else f"cores {p.cpu_bind}" if p.cpu_bind else "no device"
    extra = f", bootstrap port {p.bootstrap_port}" if p.bootstrap_port else ""
    if p.internal_ports:
        extra += f", internal ports {p.internal_ports[0]}-{p.internal_ports[1]}"
    on = f" on {p.node}" if p.node else ""
    lines = [f"  {p.name}: {p.url}{on} ({place}{extra})"]
    for k, v in p.env:
        lines.append(f"      env {k}={v}")
    lines.append(f"      argv {shlex.join(p.argv)}")
    return lines
