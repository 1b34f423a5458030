"""Names of the environment variables pd-sessions itself defines (standard library only).

They cross process boundaries: the planner sets them, and code running inside vLLM's processes
(the vLLM plugin) reads them, so both take the name from here.
"""

from __future__ import annotations

# NIXL's progress-thread poll delay, in microseconds, that pd-sessions' vLLM plugin creates
# NIXL agents with (the planner sets it for every NIXL instance on the CPU lane).
NIXL_DELAY_ENV = "PD_SESSIONS_NIXL_PROGRESS_DELAY_US"
