"""``nox -s bench``: the harness's own overhead, measured next to what users run today.

It measures, it does not gate: every number is written to ``bench/results.json``,
``bench/results.md`` (table) and ``bench/phases.png`` (chart); goals are marked
met or not met, and the exit status is non-zero only when a measurement could
not be made (a run failed). Parts:

- ``clusters``: real P/D clusters on this host's lane, driven by pd_sessions and by
  a faithful reproduction of upstream's bash flow (fixed sleeps, 1 s curl polling),
  plus a single instance started alone; a high-frequency /health prober gives each
  instance's own startup time and how late the harness noticed it.
- ``teardown``: the cluster teardown on throwaway process trees, one child of which
  ignores SIGTERM.
- ``router``: vllm-router versus a minimal aiohttp proxy making the same P/D hop,
  both in front of the same small fake backends (the router is what is measured).
- ``checks``: each check's own wall time per config over each connector (the edge
  checks' sum against issue 17's 15 s goal).
- ``digest``: each config with the KV digest (kv_digest and its vLLM-side observer) and without
  it: what it costs, against issue 41's goal of under 5 % of a config (bench/digest_bench.py).
- ``startup``: from invoking nox to the first instance spawned, the session venv
  rebuilt (``--reuse-venv=never``) versus reused.
"""
