"""The fault scenarios: one check each, run through pd-sessions' fault-injecting connector
(pd_sessions/vllm_side/fault_connector.py; the modes and the control file: pd_sessions/core/faults.py).

| check | module | fault |
| --- | --- | --- |
| fault_drop | drop.py | every finished KV load reported failed |
| fault_zero, fault_swap | corrupt.py | received KV blocks overwritten (zeros / another request's) |
| fault_stall_abort | stall_abort.py | clients leave while the prefill, then the decode, is stalled |
| fault_peer_death | peer_death.py | the prefill SIGKILLed while the decode waits for its KV |
| fault_restart | restart.py | the killed prefill started again in place |
| wire_loss, wire_partition, wire_cap, wire_delay | wire_scenarios.py | across hosts, on the wire: loss, |
| | | a partition, a bandwidth cap, a delay (no injector) |

``promise.py`` is the pure part they share (what a request's outcome is, the recovery);
``scenario.py`` what they do around the fault (the control file, requests, the counters).
"""
