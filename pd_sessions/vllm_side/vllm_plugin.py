"""vLLM general plugin (entry point ``vllm.general_plugins``): three shims for the CPU lane.

vLLM loads general plugins in every process it starts (API server, engine core, workers).

- **The Mooncake CPU shim.** Upstream's MooncakeConnector worker calls
  ``torch.accelerator.current_device_index()``, which raises "Cannot access accelerator device
  when none is available" on CPU-only torch. When, and only when, no accelerator exists, this
  makes that call return device 0 (what CPU torch means anyway). With an accelerator present it
  changes nothing.
- **NIXL's progress thread** (only where ``PD_SESSIONS_NIXL_PROGRESS_DELAY_US`` is set; the
  planner sets it for NIXL instances on the CPU lane). NIXL's Python API creates every agent
  with ``pthrDelay = 0``, so its UCX progress thread polls with a zero timeout: one core spun
  at 100 % per vLLM instance, forever, idle or not. On a 2-core host two instances take both
  cores; the API servers, engine cores and the KV transfers themselves run in what is left,
  and requests stalled for up to 30 s (docs/cpu-lane.md). With the variable set, agents are created with
  that delay instead: the thread wakes on its event fds, and at least every delay otherwise.
  A config that sets ``pthrDelay`` itself keeps it.
- **NIXL's worker keeps its instance's cores** (only where ``PD_SESSIONS_NIXL_KEEP_CORES=1``; the
  planner sets it for NIXL instances on the CPU lane). On a CPU host vLLM's NIXL worker moves the
  thread that builds it, the engine's own, to the last core of each NUMA node: every NIXL
  instance, prefill and decode, then computed on the machine's last core, and across simulated
  hosts on another host's core. With the variable the thread's cores before the worker's
  ``__init__`` are its cores after it.
- **NIXL's handshake waits longer for its answer** (only where ``PD_SESSIONS_NIXL_HANDSHAKE_TIMEOUT_S``
  is set; the planner sets it for NIXL push instances on the CPU lane). vLLM's worker asks the
  peer's side-channel listener for its metadata and gives up after a fixed 5 s
  (``sock.setsockopt(zmq.RCVTIMEO, 5000)`` in ``_nixl_handshake``, nixl/base_worker.py); on two
  loaded cores the listener, a thread of the busily stepping peer engine, answers later, and push
  mode then leaves the request waiting for ever (docs/cpu-lane.md, "NIXL push mode"). With the
  variable the handshake's socket takes that many seconds instead, and every handshake query says
  on stderr how long its answer took; every query a listener answers says when it read it. A CPU-lane
  accommodation: the handshake still completes, only later; a peer that never answers still fails
  it, after the longer wait. ``PD_SESSIONS_NIXL_DECODE_LISTENER_DELAY_S`` (a fault, never set by the
  planner) makes a decode's listener answer that many seconds late: the known issue's reproducer.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pd_sessions.core.connectors import MOONCAKE, NIXL
from pd_sessions.core.connectors.nixl import HANDSHAKE, KEEP_CORES, PROGRESS

# The variable the planner sets for the CPU lane (the NIXL spec's cpu_lane.env names it).
NIXL_DELAY_ENV = PROGRESS.env

log = logging.getLogger(__name__)


def _say(line: str) -> None:
    """One line on the vLLM process's stderr (its log): what a shim did, or why it did not."""
    print(line, file=sys.stderr, flush=True)


def shim_needed(accelerator_available: bool, already_applied: bool) -> bool:
    """Apply the shim only on hosts without an accelerator, once per process."""
    return not accelerator_available and not already_applied


def nixl_delay_us(environ: Mapping[str, str]) -> int | None:
    """The NIXL progress-thread delay asked for in ``environ`` (microseconds), None when
    unset; ValueError naming the variable for anything but a whole number above 0."""
    raw = environ.get(NIXL_DELAY_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(
            f"{NIXL_DELAY_ENV}={raw!r}: give a whole number of microseconds above 0 "
            f"(e.g. 1000), or leave it unset for {NIXL.title}'s own busy polling"
        )
    return value


def with_progress_delay(create: Callable[..., Any], delay_us: int) -> Callable[..., Any]:
    """``create`` (NIXL's ``nixlAgent(name, config)``) with ``config.pthrDelay`` set to
    ``delay_us`` where the config asks for a progress thread and leaves the delay at 0."""

    def nixlAgent(name: str, config: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(config, "useProgThread", False) and getattr(config, "pthrDelay", None) == 0:
            config.pthrDelay = delay_us
            _say(
                f"pd_sessions: {NIXL.title} agent {name}: progress thread polls every {delay_us} us "
                f"instead of spinning ({NIXL_DELAY_ENV})"
            )
        return create(name, config, *args, **kwargs)

    nixlAgent._pd_sessions_delay_us = delay_us  # type: ignore[attr-defined]
    return nixlAgent


def apply_nixl_progress_delay(environ: Mapping[str, str]) -> bool:
    """Wrap the installed NIXL's agent constructor when ``environ`` asks for a delay; whether
    it was wrapped now (not when unset, already wrapped, or NIXL is not installed). Where to wrap
    is the NIXL spec's :data:`~pd_sessions.core.connectors.nixl.PROGRESS`."""
    try:
        delay = nixl_delay_us(environ)
    except ValueError as e:
        _say(f"pd_sessions: ignored: {e}")
        return False
    if delay is None:
        return False
    try:
        # the front package; it re-exports the backend built for this host
        api = importlib.import_module(PROGRESS.api_module)
    except ImportError:
        return False
    front = getattr(api, PROGRESS.agent_class).__module__
    bind = getattr(sys.modules[front], PROGRESS.bindings, None)
    create = getattr(bind, PROGRESS.constructor, None)
    if create is None:
        _say(
            f"pd_sessions: {NIXL_DELAY_ENV} not applied: this {NIXL.title} Python API ({front}) has no "
            f"{PROGRESS.bindings}.{PROGRESS.constructor} to wrap; its progress thread keeps its own setting"
        )
        return False
    if hasattr(create, "_pd_sessions_delay_us"):
        return False
    setattr(bind, PROGRESS.constructor, with_progress_delay(create, delay))
    return True


def keeping_cores(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` (NIXL's worker ``__init__``) with the calling thread's cores (its CPU affinity)
    put back as they were when ``init`` changed them, said once on stderr."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        before = os.sched_getaffinity(0)
        try:
            init(self, *args, **kwargs)
        finally:
            after = os.sched_getaffinity(0)
            if after != before:
                os.sched_setaffinity(0, before)
                _say(
                    f"pd_sessions: {NIXL.title} worker: this thread stays on cores {sorted(before)} "
                    f"(the worker moved it to {sorted(after)}; {KEEP_CORES.env})"
                )

    __init__._pd_sessions_keeps_cores = True  # type: ignore[attr-defined]
    return __init__


def apply_nixl_keep_cores(environ: Mapping[str, str]) -> bool:
    """Wrap vLLM's NIXL worker's ``__init__`` when ``environ`` asks for it (KEEP_CORES); whether
    it was wrapped now (not when unset, already wrapped, or that vLLM has no such worker)."""
    if environ.get(KEEP_CORES.env, "").strip() != "1" or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        module = importlib.import_module(KEEP_CORES.module)
    except ImportError:
        return False
    cls = getattr(module, KEEP_CORES.worker_class, None)
    if cls is None:
        _say(
            f"pd_sessions: {KEEP_CORES.env} not applied: {KEEP_CORES.module} has no {KEEP_CORES.worker_class}"
        )
        return False
    if getattr(cls.__init__, "_pd_sessions_keeps_cores", False):
        return False
    cls.__init__ = keeping_cores(cls.__init__)
    return True


def handshake_timeout_s(environ: Mapping[str, str]) -> float | None:
    """The handshake answer timeout asked for in ``environ`` (seconds), None when unset;
    ValueError naming the variable for anything but a number of seconds above vLLM's own."""
    raw = environ.get(HANDSHAKE.env, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value * 1000 > HANDSHAKE.vllm_ms:
        raise ValueError(
            f"{HANDSHAKE.env}={raw!r}: give a number of seconds above vLLM's own "
            f"{HANDSHAKE.vllm_ms / 1000:g} (e.g. {HANDSHAKE.cpu_s}), or leave it unset for vLLM's"
        )
    return value


def _clock() -> str:
    """Wall-clock time with milliseconds, comparable across the instances' logs of one host."""
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"


class HandshakeQuery:
    """The handshake's REQ socket (a pyzmq socket) with a longer answer timeout: the timeout vLLM
    sets (``opt``, its ``vllm_ms``) becomes ``timeout_s``; each answer's wait is said on stderr."""

    def __init__(self, sock: Any, opt: int, timeout_s: float, path: str) -> None:
        self._sock, self._opt, self._timeout_s, self._path = sock, opt, timeout_s, path

    def setsockopt(self, opt: int, value: Any) -> None:
        if opt == self._opt and value == HANDSHAKE.vllm_ms:
            value = int(self._timeout_s * 1000)
        self._sock.setsockopt(opt, value)

    def recv_multipart(self, *args: Any, **kwargs: Any) -> Any:
        sent, start = _clock(), time.monotonic()
        try:
            answer = self._sock.recv_multipart(*args, **kwargs)
        except Exception:
            _say(
                f"pd_sessions: {NIXL.title} handshake query to {self._path} (sent by {sent}): no answer "
                f"within {time.monotonic() - start:.1f} s (timeout {self._timeout_s:g} s)"
            )
            raise
        took = time.monotonic() - start
        late = f", past vLLM's {HANDSHAKE.vllm_ms / 1000:g} s" if took * 1000 > HANDSHAKE.vllm_ms else ""
        _say(
            f"pd_sessions: {NIXL.title} handshake query to {self._path} (sent by {sent}): answered after "
            f"{took:.2f} s{late} (timeout {self._timeout_s:g} s)"
        )
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


# Seconds this process's side-channel listener holds each query before answering: set (by
# answering_late) only in a decode's engine process, only where HANDSHAKE.decode_delay_env asks.
_LISTENER = {"delay_s": 0.0}


class ListenerSocket:
    """The side-channel listener's ROUTER socket: each query it reads is said on stderr with the
    time the listener thread read it (compare with the asking instance's "sent by"); held
    ``delay_s`` before it is answered when a fault asks for it."""

    def __init__(self, sock: Any, delay_s: float = 0.0) -> None:
        self._sock, self._delay_s = sock, delay_s

    def recv_multipart(self, *args: Any, **kwargs: Any) -> Any:
        parts = self._sock.recv_multipart(*args, **kwargs)
        _say(f"pd_sessions: {NIXL.title} side-channel listener read a handshake query at {_clock()}")
        if self._delay_s:
            _say(
                f"pd_sessions: {NIXL.title} side-channel listener: answers it {self._delay_s:g} s late "
                f"(a fault: {HANDSHAKE.decode_delay_env})"
            )
            time.sleep(self._delay_s)
        return parts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def with_handshake_timeout(open_socket: Callable[..., Any], req: int, opt: int, timeout_s: float) -> Any:
    """``open_socket`` (vLLM's NIXL ``zmq_ctx(socket_type, addr)``, a context manager) whose REQ
    sockets are :class:`HandshakeQuery` and whose others (the listener's ROUTER) :class:`ListenerSocket`."""

    @contextlib.contextmanager
    def zmq_ctx(socket_type: Any, addr: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        with open_socket(socket_type, addr, *args, **kwargs) as sock:
            if socket_type == req:
                yield HandshakeQuery(sock, opt, timeout_s, addr)
            else:
                yield ListenerSocket(sock, _LISTENER["delay_s"])

    zmq_ctx._pd_sessions_handshake_s = timeout_s  # type: ignore[attr-defined]
    return zmq_ctx


def listener_delay_s(environ: Mapping[str, str]) -> float:
    """The decode listener's delay a fault asks for in ``environ`` (seconds, 0 when unset);
    ValueError naming the variable for anything but a number of seconds of 0 or more."""
    raw = environ.get(HANDSHAKE.decode_delay_env, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(
            f"{HANDSHAKE.decode_delay_env}={raw!r}: give a number of seconds (0 or more), or leave it unset"
        )
    return value


def answering_late(set_metadata: Callable[..., Any], delay_s: float) -> Callable[..., Any]:
    """``set_metadata`` (vLLM's NIXL scheduler's ``set_xfer_handshake_metadata``, which starts the
    side-channel listener) that first makes this process's listener answer ``delay_s`` late when
    the scheduler is a decode's (a KV consumer only)."""

    def set_xfer_handshake_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        kv = self.vllm_config.kv_transfer_config
        if kv.is_kv_consumer and not kv.is_kv_producer:
            _LISTENER["delay_s"] = delay_s
        return set_metadata(self, *args, **kwargs)

    set_xfer_handshake_metadata._pd_sessions_delay_s = delay_s  # type: ignore[attr-defined]
    return set_xfer_handshake_metadata


def _wrap_handshake_sockets(timeout_s: float) -> bool:
    """Wrap the ``zmq_ctx`` of vLLM's NIXL worker and scheduler modules; whether both are wrapped
    (now or before)."""
    for name in (HANDSHAKE.module, HANDSHAKE.listener_module):
        try:
            module = importlib.import_module(name)
        except ImportError:
            return False
        open_socket, zmq = getattr(module, HANDSHAKE.socket_factory, None), getattr(module, "zmq", None)
        if open_socket is None or zmq is None:
            _say(f"pd_sessions: {HANDSHAKE.env} not applied: {name} has no {HANDSHAKE.socket_factory} or zmq")
            return False
        if not hasattr(open_socket, "_pd_sessions_handshake_s"):
            wrapped = with_handshake_timeout(open_socket, zmq.REQ, zmq.RCVTIMEO, timeout_s)
            setattr(module, HANDSHAKE.socket_factory, wrapped)
    return True


def apply_nixl_handshake_timeout(environ: Mapping[str, str]) -> bool:
    """Wrap the ``zmq_ctx`` of vLLM's NIXL worker and scheduler modules when ``environ`` asks for
    a handshake timeout (HANDSHAKE) or the decode listener's delay (a fault; then the timeout is
    vLLM's unless asked too); whether it was wrapped now (not when unset, already wrapped, or that
    vLLM has no such module or name: said on stderr)."""
    try:
        timeout_s, delay_s = handshake_timeout_s(environ), listener_delay_s(environ)
    except ValueError as e:
        _say(f"pd_sessions: ignored: {e}")
        return False
    if timeout_s is None and not delay_s:
        return False
    worker = sys.modules.get(HANDSHAKE.module)
    if worker is not None and hasattr(
        getattr(worker, HANDSHAKE.socket_factory, None), "_pd_sessions_handshake_s"
    ):
        return False
    if not _wrap_handshake_sockets(timeout_s or HANDSHAKE.vllm_ms / 1000):
        return False
    if timeout_s is not None:
        _say(
            f"pd_sessions: {NIXL.title} handshake: waits up to {timeout_s:g} s for the peer's answer "
            f"instead of vLLM's fixed {HANDSHAKE.vllm_ms / 1000:g} s ({HANDSHAKE.env})"
        )
    if delay_s:
        cls = getattr(sys.modules[HANDSHAKE.listener_module], HANDSHAKE.scheduler_class, None)
        if cls is None:
            _say(f"pd_sessions: {HANDSHAKE.decode_delay_env} not applied: no {HANDSHAKE.scheduler_class}")
        else:
            cls.set_xfer_handshake_metadata = answering_late(cls.set_xfer_handshake_metadata, delay_s)
    return True


def register() -> None:
    apply_nixl_progress_delay(os.environ)
    apply_nixl_keep_cores(os.environ)
    apply_nixl_handshake_timeout(os.environ)

    import torch

    acc = torch.accelerator
    if not shim_needed(acc.is_available(), getattr(acc, "_pd_sessions_cpu_shim", False)):
        return
    original = acc.current_device_index

    def current_device_index() -> int:
        if not torch.accelerator.is_available():
            return 0
        return original()

    acc.current_device_index = current_device_index
    acc._pd_sessions_cpu_shim = True
    log.info(
        "pd_sessions: no accelerator: torch.accelerator.current_device_index() -> 0 (%s CPU shim)",
        MOONCAKE.title,
    )
