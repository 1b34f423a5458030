"""NixlPushConnector (vLLM's push mode of the NIXL connector): everything the harness knows about it.

vLLM's connector factory lists NixlPullConnector (alias NixlConnector, see :mod:`.nixl`) and
NixlPushConnector. In push mode the decode does not READ: it registers its freshly allocated
blocks with the prefill through a NIXL notification, and the prefill's ``nixl-push-writer`` thread
WRITEs the KV into them (vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_*.py, vLLM 0.32).

What it shares with pull mode: the wheels, the kv-transfer-config's keys (``kv_buffer_device``),
the side-channel ports, the CPU lane's progress-thread delay, vllm-router's ``--kv-connector nixl``
(the router learns push mode from the ``transfer_mode`` the prefill answers with) and the pair
warm-up's two hops (the decode hop carries what the prefill answered).

What differs:
- success evidence: the transfers complete (and are recorded) on the side that WRITEs, so the
  *prefill's* ``vllm:nixl_xfer_time_seconds_count`` must rise by one per router request (and its
  bytes), with the failure counters still on both sides;
- limits: refused on the CPU lane (:func:`refuse`);
- failure lines: push's own (the writer thread's errors, a registration that never reaches the
  prefill or times out waiting for its WRITE), beside NIXL's.
"""

from __future__ import annotations

import dataclasses

from pd_sessions.core.connectors import nixl
from pd_sessions.core.connectors.base import ConfigView, ConnectorSpec, KvAccounting, MetricEvidence, Refusal

FAILURE_LINES = (
    *nixl.FAILURE_LINES,  # push_reg_handshake_failed / push_reg_notif_failed / transfer_failed go there too
    r"nixl-push-writer error",
    r"Failed to decode PUSH_REG notification payload",
    r"PUSH_REG notif missing request_id",
    r"cannot send registration for",  # the decode has no agent of the prefill to notify
    r"registration for request \S+ timed out",  # the decode waited past its lease for the WRITE
)

# The push scheduler (nixl/push_scheduler.py, NixlPushConnectorScheduler.get_num_new_matched_tokens)
# asks the same base class as pull mode: NixlBaseConnectorScheduler._get_remote_prefill_token_count
# and _prefill_backoff (nixl/base_scheduler.py), so the identity is NIXL's.
KV_ACCOUNTING = KvAccounting(
    backoff_ssm=nixl.KV_ACCOUNTING.backoff_ssm,
    backoff_plain=nixl.KV_ACCOUNTING.backoff_plain,
    code="vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_scheduler.py: "
    "NixlPushConnectorScheduler.get_num_new_matched_tokens -> base_scheduler.py: "
    "NixlBaseConnectorScheduler._prefill_backoff",
)


def refuse(config: ConfigView, platform: str) -> Refusal | None:
    """Push mode is refused on the CPU lane (docs/cpu-lane.md, "NIXL push mode"): there both engines
    step busily while a push is due (the prefill while its blocks wait for the WRITE, the decode
    while it waits for it), and on CI's 2 cores they starve the decode's side-channel listener; the
    prefill's handshake to the decode, which push adds before its first WRITE, gives up after
    vLLM's fixed 5 s, and vLLM then leaves the decode's request waiting with no answer (its push
    path posts no WRITE and fails nothing, cf. vllm-project/vllm#50754). Seen in 2 of 3 runs of the
    1x1 on 2 loaded cores (the pair warm-up, or parity after smoke passed)."""
    if platform != "cpu":
        return None
    return Refusal(
        "connector",
        f"{config.name}: NixlPushConnector is refused on the CPU lane: the prefill's handshake to the "
        "decode (push mode's, before its first WRITE) times out after vLLM's fixed 5 s when the two "
        "busily stepping engines starve the decode's side-channel listener, and vLLM then leaves the "
        "request waiting with no answer (see docs/cpu-lane.md, NIXL push mode); run push on a GPU "
        "host, or NIXL's pull mode here (--set connector=nixl)",
    )


SPEC = ConnectorSpec(
    name="nixl_push",
    title="NIXL push",
    vllm_class="NixlPushConnector",
    router_flag="nixl",
    package=nixl.PACKAGE,
    kv_config=nixl.kv_config,
    hops=nixl.HOPS,
    kv_accounting=KV_ACCOUNTING,
    evidence=MetricEvidence(
        count=nixl.XFER_COUNT,
        bytes=nixl.XFER_BYTES,
        failures=nixl.FAILURE_COUNTERS,
        role="prefill",
        what="WRITE transfers",
        time=nixl.XFER_TIME,
        post_time=nixl.POST_TIME,
        descriptors=nixl.DESCRIPTORS,
    ),
    failure_lines=FAILURE_LINES,
    ports=nixl.PORTS,
    across_hosts=nixl.ACROSS_HOSTS,
    limits=dataclasses.replace(nixl.SPEC.limits, refuse=refuse),
    cpu_lane=nixl.CPU_LANE,
    sweep="nixl_push_sweep",
    added_by="vllm-project/vllm#35264",
)
