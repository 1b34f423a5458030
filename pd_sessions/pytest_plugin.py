"""pytest plugin: ``pd_cluster``, a real P/D cluster for your own tests (session-scoped).

Loaded automatically once pd-sessions is installed (entry point ``pytest11``), or with
``-p pd_sessions.pytest_plugin``. It adds options and a fixture; it starts nothing unless a
test asks for ``pd_cluster``.

Which cluster::

    pytest --pd-cluster nixl_sweep:1x1 tests/         # SWEEP:CONFIG (default mooncake_sweep:1x1)
    pytest --pd-ray HEAD:6379 tests/                   # its instances across a Ray cluster's nodes
    @pytest.mark.parametrize("pd_cluster", ["mooncake_sweep:1x1", "nixl_sweep:1x1"], indirect=True)

Tests that share a parameter share one cluster; pytest groups them and stops one cluster
before it starts the next. When ``PD_SESSIONS_CLUSTER`` is set (the test runs under
``pd-sessions sweep --exec/--pytest``, or after sourcing ``serve``'s ``cluster.env``) and no
parameter names a cluster, the fixture attaches to that cluster and starts nothing.

A cluster it starts comes from ``run.lifeline.start_config``, as the sweep's and serve's do (the
sweep's planner, readiness and teardown, inside the lifeline): a server that dies fails the next
test at setup, and is named (with its log tail) in the report of a test that failed meanwhile;
SIGTERM to pytest tears it down like Ctrl-C, and so does the death of pytest's parent; pytest
killed outright (SIGKILL) leaves nothing either: the reaper stops what it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from pd_sessions.core import connectors

DEFAULT_CLUSTER = f"{connectors.DEFAULT.sweep}:1x1"
ENV_CLUSTER = "PD_SESSIONS_CLUSTER"
_LIVE: list[PdCluster] = []  # clusters this process started and has not torn down yet


@dataclass
class KvDelta:
    """Decode instances' external-KV prompt-token counters over a ``with`` block."""

    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)

    @property
    def by_decode(self) -> dict[str, float]:
        return {name: self.after[name] - self.before[name] for name in self.before}

    @property
    def tokens(self) -> float:
        return sum(self.by_decode.values())


@dataclass
class PdCluster:
    """What a test gets: the cluster's URLs and environment, OpenAI clients, KV deltas."""

    info: dict[str, Any]  # the PD_SESSIONS_CLUSTER document (clusterenv.describe)
    env: dict[str, str]  # PREFILL_PORT, PROXY_PORT, TEST_MODEL... as --exec gets them
    cluster: Any = None  # the live cluster.Cluster when this process started it
    _clients: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def model(self) -> str:
        return self.info["served_model_name"]

    @property
    def router_url(self) -> str:
        return self.info["router"]["url"]

    @property
    def prefill_urls(self) -> list[str]:
        return [p["url"] for p in self.info["prefill"]]

    @property
    def decode_urls(self) -> list[str]:
        return [d["url"] for d in self.info["decode"]]

    def client(self, url: str) -> Any:
        """An ``openai.OpenAI`` client for ``url`` (no retries: a failed P/D hop must show)."""
        if url not in self._clients:
            try:
                import openai
            except ImportError as e:
                raise RuntimeError(
                    f"pd_cluster's clients need the openai package ({e}): pip install openai"
                ) from None
            self._clients[url] = openai.OpenAI(
                base_url=f"{url}/v1",
                api_key="EMPTY",
                max_retries=0,
                timeout=300,
                http_client=openai.DefaultHttpxClient(trust_env=False),
            )  # loopback: no proxies
        return self._clients[url]

    @property
    def router(self) -> Any:
        return self.client(self.router_url)

    @property
    def prefill(self) -> Any:
        return self.client(self.prefill_urls[0])

    @property
    def decode(self) -> Any:
        return self.client(self.decode_urls[0])

    def kv_transferred(self) -> dict[str, float]:
        """Decode name -> prompt tokens received by KV transfer so far (its /metrics counter)."""
        from pd_sessions.checks import instances
        from pd_sessions.runtime import http

        return {
            d["name"]: instances.external_tokens(http.get_text(d["metrics_url"])) for d in self.info["decode"]
        }

    @contextlib.contextmanager
    def kv_delta(self) -> Iterator[KvDelta]:
        """``with pd_cluster.kv_delta() as kv: ...`` then ``kv.tokens``, ``kv.by_decode``."""
        delta = KvDelta(before=self.kv_transferred())
        yield delta
        delta.after = self.kv_transferred()

    def check_alive(self, when: str = "while tests ran") -> None:
        """Raise ProcessExited (name, status, log tail) if a process of a cluster we started died."""
        if self.cluster is not None:
            from pd_sessions.runtime.readiness import check_alive

            check_alive(self.cluster.processes, when)


def parse_spec(spec: Any) -> tuple[str, str]:
    """``"SWEEP:CONFIG"`` or ``(SWEEP, CONFIG)`` -> (sweep, config)."""
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        return str(spec[0]), str(spec[1])
    if isinstance(spec, str) and ":" in spec:
        sweep, _, config = spec.rpartition(":")
        if sweep and config:
            return sweep, config
    raise pytest.UsageError(f"pd_cluster: got {spec!r}; give SWEEP:CONFIG, e.g. {DEFAULT_CLUSTER!r}")


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("pd_sessions", "pd_cluster fixture (pd-sessions)")
    g.addoption(
        "--pd-cluster",
        default=None,
        metavar="SWEEP:CONFIG",
        help=f"cluster the pd_cluster fixture starts (default {DEFAULT_CLUSTER}; with "
        f"${ENV_CLUSTER} set and no option, it attaches to that cluster instead)",
    )
    g.addoption(
        "--pd-platform",
        default=None,
        choices=["cpu", "cuda"],
        help="force the lane (default: cuda when a GPU is visible, else cpu)",
    )
    g.addoption(
        "--pd-results-dir",
        default=None,
        type=Path,
        help="where clusters' plans and logs go, as DIR/SWEEP/CONFIG/ (default: pytest's tmp dir)",
    )
    g.addoption(
        "--pd-deadline", default=None, type=float, metavar="SECONDS", help="readiness deadline (default 1200)"
    )
    g.addoption(
        "--pd-ray",
        default=None,
        metavar="ADDRESS",
        help="start the cluster across the nodes of this Ray cluster (as `pd-sessions sweep --ray`; "
        "needs pip install 'pd-sessions[ray]')",
    )


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While a cluster is up, SIGTERM ends pytest the way Ctrl-C does (fixtures torn down)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _attach(path: str) -> PdCluster:
    """The cluster described by ``path`` (written by the sweep or serve), started elsewhere."""
    from pd_sessions.runtime.clusterenv import ENV_NAMES

    info = json.loads(Path(path).read_text())
    return PdCluster(info=info, env={k: os.environ[k] for k in ENV_NAMES if k in os.environ})


@pytest.fixture(scope="session")
def pd_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PdCluster]:
    """A ready P/D cluster (see the module docstring); torn down after the last test using it."""
    spec = getattr(request, "param", None) or request.config.getoption("--pd-cluster")
    if spec is None and os.environ.get(ENV_CLUSTER):
        yield _attach(os.environ[ENV_CLUSTER])
        return
    from pd_sessions.core.config import load, select
    from pd_sessions.core.preflight import preflight
    from pd_sessions.run.lifeline import start_config
    from pd_sessions.run.sweep_options import SweepOptions
    from pd_sessions.runtime import clusterenv, machine

    sweep_name, config_name = parse_spec(spec or DEFAULT_CLUSTER)
    sweep = load(sweep_name)
    platform, inv, _ = preflight(sweep, request.config.getoption("--pd-platform"), machine.detect())
    (entry,), _ = select(sweep.entries(platform), platform, only=(config_name,))
    base = request.config.getoption("--pd-results-dir") or tmp_path_factory.mktemp("pd_cluster")
    deadline = request.config.getoption("--pd-deadline")
    # <base>/<sweep>/<config>/: clusters of one session (parameters) keep their logs apart
    opts = SweepOptions(
        platform=platform,
        results_dir=(Path(base) / Path(sweep_name).stem).resolve(),
        ray=request.config.getoption("--pd-ray"),
        **({"deadline_s": deadline} if deadline else {}),
    )
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def say(msg: str) -> None:  # progress shown live, past pytest's output capture
        if reporter is None:
            return
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            reporter.write_line(f"[pd_cluster] {msg}")

    with _sigterm_as_interrupt(), start_config(entry.config, inv, opts, progress=say) as cluster:
        plan = cluster.plan
        env = clusterenv.cluster_env(plan, clusterenv.write_cluster_file(plan, cluster.run_dir))
        pd = PdCluster(info=clusterenv.describe(plan, cluster.run_dir), env=env, cluster=cluster)
        _LIVE.append(pd)
        try:
            yield pd
        finally:
            _LIVE.remove(pd)
            say(f"{sweep_name}:{config_name}: tearing down")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that uses the cluster does not start against a dead one."""
    if "pd_cluster" in getattr(item, "fixturenames", ()):
        for pd in _LIVE:
            pd.check_alive("before " + item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    """A test that failed while a cluster process died says which one (with its log tail)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "pd_cluster" in getattr(item, "fixturenames", ()):
        from pd_sessions.core.errors import ProcessExited

        for pd in _LIVE:
            try:
                pd.check_alive(f"while {item.nodeid} ran")
            except ProcessExited as e:
                report.sections.append(("pd_cluster: a cluster process died", str(e)))
