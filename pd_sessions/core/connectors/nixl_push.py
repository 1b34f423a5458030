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
- limits: pull mode's; on the CPU lane a longer handshake answer timeout (:data:`CPU_LANE`);
- failure lines: push's own (the writer thread's errors, a registration that never reaches the
  prefill or times out waiting for its WRITE), beside NIXL's.
"""

from __future__ import annotations

from pd_sessions.core.connectors import nixl
from pd_sessions.core.connectors.base import ConnectorSpec, CpuLane, KvAccounting, MetricEvidence

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


# The CPU lane's: pull mode's (the progress-thread delay, the worker's cores) and a longer handshake
# answer timeout. Push adds a handshake pull mode does not have: the prefill asks the *decode's*
# side-channel listener for its metadata before its first WRITE, while both engines step busily;
# on two loaded cores that answer came after vLLM's fixed 5 s, and vLLM then left the decode's
# request waiting with no answer (docs/cpu-lane.md, "NIXL push mode", which says why a longer wait
# hides no bug, and the known issue it leaves).
CPU_LANE = CpuLane(
    env=(*nixl.CPU_LANE.env, (nixl.HANDSHAKE.env, str(nixl.HANDSHAKE.cpu_s))),
    shims=(
        *nixl.CPU_LANE.shims,
        f"NIXL's handshake waits up to {nixl.HANDSHAKE.cpu_s} s for the peer's answer instead of vLLM's "
        f"fixed {nixl.HANDSHAKE.vllm_ms / 1000:g} s ({nixl.HANDSHAKE.env})",
    ),
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
    transfer_op="WRITE",  # the prefill's nixl-push-writer WRITEs into the decode's blocks
    ports=nixl.PORTS,
    across_hosts=nixl.ACROSS_HOSTS,
    limits=nixl.SPEC.limits,
    cpu_lane=CPU_LANE,
    sweep="nixl_push_sweep",
    added_by="vllm-project/vllm#35264",
    # push's decode hop carries what the prefill answered, as pull's does (nixl/push_scheduler.py)
    client_params=nixl.CLIENT_PARAMS,
)
