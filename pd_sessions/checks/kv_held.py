"""What an instance holds against its idle state, from its /metrics: requests running or
waiting and the exact count of KV blocks in use. The fault scenarios (checks/faults/) judge
"every block freed" with it, and the conservation invariant (checks/conservation.py) after every
check."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

from pd_sessions.checks import instances
from pd_sessions.checks.abort_frees_kv import settled

# The exact count of KV blocks in use, derived: vllm:kv_cache_usage_perc is a fraction of
# (num_gpu_blocks - 1) (vLLM's block pool leaves out its null block), and num_gpu_blocks is a
# label of vllm:cache_config_info. On the CPU lane one block is 1/2047 of the cache: below
# abort_frees_kv's slack on the fraction, so a few stranded blocks would pass unseen there.
BLOCKS = "kv_blocks_in_use"
CACHE_INFO = "vllm:cache_config_info"
STATE = (instances.RUNNING, instances.WAITING, instances.KV_USAGE)


def state(metrics_text: str) -> dict[str, float]:
    """An instance's requests and KV usage from one /metrics scrape (summed over engines), with
    BLOCKS when each engine's cache size is exposed."""
    samples = [smp for f in text_string_to_metric_families(metrics_text) for smp in f.samples]
    out: dict[str, float] = {}
    for smp in samples:
        if smp.name in STATE:
            out[smp.name] = out.get(smp.name, 0.0) + smp.value
    usage = {smp.labels.get("engine", ""): smp.value for smp in samples if smp.name == instances.KV_USAGE}
    sizes = {
        smp.labels.get("engine", ""): int(smp.labels["num_gpu_blocks"]) - 1
        for smp in samples
        if smp.name == CACHE_INFO and smp.labels.get("num_gpu_blocks", "").isdigit()
    }
    if usage and set(usage) <= set(sizes):
        out[BLOCKS] = float(sum(round(u * sizes[e]) for e, u in usage.items()))
    return out


def holds(idle: Mapping[str, float], now: Mapping[str, float]) -> str | None:
    """What an instance still holds compared with ``idle``, or None.

    a request running                      -> "N requests still running (vllm:num_requests_running)"
    a request waiting                      -> "N requests still waiting (...)"
    more KV blocks in use than when idle   -> "N KV blocks in use (idle M; ...)"  (exact, when
                                              the cache size is exposed; else abort_frees_kv's
                                              rule on the usage fraction)
    """
    if now.get(BLOCKS) is not None and idle.get(BLOCKS) is not None:
        if now.get(instances.RUNNING, 0.0) > 0:
            return f"{now[instances.RUNNING]:g} requests still running ({instances.RUNNING})"
        if now.get(instances.WAITING, 0.0) > 0:
            return f"{now[instances.WAITING]:g} requests still waiting ({instances.WAITING})"
        if now[BLOCKS] > idle[BLOCKS]:
            return (
                f"{now[BLOCKS]:g} KV blocks in use (idle {idle[BLOCKS]:g}; "
                f"{instances.KV_USAGE} x num_gpu_blocks of {CACHE_INFO})"
            )
        return None
    held = settled(idle, now)
    if held is None and now.get(instances.WAITING, 0.0) > 0:
        return f"{now[instances.WAITING]:g} requests still waiting ({instances.WAITING})"
    return held
