"""pd_sessions: a typed harness that proves vLLM prefill/decode disaggregation works.

Layers (pure core, side effects at the edges):

    config  ->  plan  ->  cluster (process, ports, readiness)  ->  checks  ->  report

Only the entry points print (:mod:`pd_sessions.cli`, the one way in, and what it hands a command
to); everything else logs, reports through callbacks, or raises :class:`pd_sessions.core.errors.PdError`.
"""

__version__ = "0.1.0"
