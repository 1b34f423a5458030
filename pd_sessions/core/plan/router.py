"""The router: vllm-router in vLLM's P/D mode, in front of the planned instances."""

from __future__ import annotations

from collections.abc import Sequence

from pd_sessions.core import connectors
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.plan.ledger import PortLedger
from pd_sessions.core.plan.specs import ProcessSpec

ROUTER_MODULE = "vllm_router.launch_router"
# The router waits this long for its workers; the harness's readiness deadline governs.
ROUTER_STARTUP_TIMEOUT_S = 86400


def plan_router(
    config: ClusterConfig,
    python: str,
    prefill: Sequence[ProcessSpec],
    decode: Sequence[ProcessSpec],
    ledger: PortLedger,
) -> ProcessSpec:
    """The router's spec: its HTTP port (the config's router_port when set) and metrics port are
    the plan's last; it routes to every prefill (with its bootstrap port, where its connector has
    one) and decode, with the connector's ``--kv-connector``."""
    port = ledger.get("router.http", config.router_port)
    metrics_port = ledger.get("router.prometheus")
    argv = router_argv(
        python,
        [(s.url, s.bootstrap_port) for s in prefill],
        [s.url for s in decode],
        kv_connector=connectors.get(config.connector).router_flag,
        host=config.host,
        port=port,
        metrics_port=metrics_port,
    )
    return ProcessSpec(
        name="router",
        role="router",
        argv=tuple(argv),
        env=(),
        host=config.host,
        port=port,
        log_name="router.log",
    )


def router_argv(
    python: str,
    prefill: Sequence[tuple[str, int | None]],
    decode: Sequence[str],
    *,
    kv_connector: str,
    host: str,
    port: int,
    metrics_port: int,
) -> list[str]:
    """vllm-router in vLLM P/D mode: ``prefill`` is (url, bootstrap port or None); ``kv_connector``
    is the router's name for the connector (a spec's ``router_flag``)."""
    argv = [python, "-m", ROUTER_MODULE, "--vllm-pd-disaggregation"]
    for url, bootstrap in prefill:
        argv += ["--prefill", url] + ([str(bootstrap)] if bootstrap else [])
    for url in decode:
        argv += ["--decode", url]
    return argv + [
        "--kv-connector",
        kv_connector,
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        # it starts with the instances: see them ready within a second, and
        # never give up before the harness's own deadline does
        "--worker-startup-check-interval",
        "1",
        "--worker-startup-timeout-secs",
        str(ROUTER_STARTUP_TIMEOUT_S),
        # a failed P/D hop must surface, not be retried into a pass
        "--disable-retries",
    ]
