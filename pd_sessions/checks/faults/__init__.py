"""The fault scenarios: one check each, run through pd-sessions' fault-injecting connector
(pd_sessions/vllm_side/fault_connector.py; the modes and the control file: pd_sessions/core/faults.py).

| check | module | fault |
| --- | --- | --- |
| fault_drop | drop.py | every finished KV load reported failed |
| fault_zero, fault_swap | corrupt.py | received KV blocks overwritten (zeros / another request's) |
| fault_mixup | mixup.py | every block of a load replaced by another concurrent request's (another's answer) |
| fault_truncate | truncate.py | the decode ends answers early, HTTP 200 |
| fault_partial_recompute | recompute.py | the decode loads part of the KV and computes the rest |
| fault_stall_abort | stall_abort.py | clients leave while the prefill, then the decode, is stalled |
| fault_peer_death | peer_death.py | the prefill SIGKILLed while the decode waits for its KV |
| fault_restart | restart.py | the killed prefill started again in place |
| wire_loss | wire_loss.py | across hosts: a share of the KV packets dropped (no injector) |
| wire_partition | wire_partition.py | across hosts: every KV packet dropped for a while, then healed |
| wire_cap | wire_cap.py | across hosts: the prefill host's interface capped (tbf) |
| wire_delay | wire_delay.py | across hosts: a delay on the prefill host's interface (netem) |

``promise.py`` is the pure part they share (what a request's outcome is, the recovery);
``scenario.py`` what they do around the fault (the control file, requests, the counters);
``wire_common.py`` what the wire scenarios share (the wire between the hosts, its faults' bounds).
"""
