"""pd_sessions: a typed harness that proves vLLM prefill/decode disaggregation works.

Layers (pure core, side effects at the edges):

    config  ->  plan  ->  cluster (process, ports, readiness)  ->  checks  ->  report

Only :mod:`pd_sessions.cli` prints; everything else logs or raises
:class:`pd_sessions.errors.PdError`.
"""

__version__ = "0.1.0"
