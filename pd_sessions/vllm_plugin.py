"""vLLM general plugin (entry point ``vllm.general_plugins``): the Mooncake CPU shim.

vLLM loads general plugins in every process it starts (API server, engine core,
workers). Upstream's MooncakeConnector worker calls
``torch.accelerator.current_device_index()``, which raises "Cannot access
accelerator device when none is available" on CPU-only torch. When, and only
when, no accelerator exists, this makes that call return device 0 (what CPU
torch means anyway). With an accelerator present it changes nothing.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def shim_needed(accelerator_available: bool, already_applied: bool) -> bool:
    """Apply the shim only on hosts without an accelerator, once per process."""
    return not accelerator_available and not already_applied


def register() -> None:
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
    log.info("pd_sessions: no accelerator: torch.accelerator.current_device_index() -> 0 (Mooncake CPU shim)")
