"""The shape of a connector spec: everything the harness knows about one KV connector, as frozen
data and small pure functions. Each connector module (``mooncake``, ``nixl``, ``nixl_push``) fills
one in; the rest of the harness reads the spec and never branches on a connector's name.

What a spec holds, and who reads it:

========================  =====================================================================
field                     read by
========================  =====================================================================
``name``, ``title``       the config's ``connector`` value (validated against the registry);
                          messages for people
``vllm_class``            the ``kv_connector`` of ``--kv-transfer-config`` (the planner)
``router_flag``           vllm-router's ``--kv-connector`` (the planner, the router benchmark)
``package``               install (variants per CUDA major and CPU), the import canary (imports,
                          native modules), envfacts, the installed-environment mode, the wheelhouse
``kv_config``             the rest of ``--kv-transfer-config`` per platform (the planner)
``ports``                 the ports each instance takes and the environment naming them (the
                          planner); the router's ``--prefill URL BOOTSTRAP``; the stuck diagnosis
``across_hosts``          what each host adds when prefill and decode run on different hosts,
                          and which variables advertise an address to the other hosts
                          (``core.plan.across_hosts``: loopback there is refused before launch)
``hops``                  the pair warm-up's two hops (``runtime.pairs``), the Python proxy
``evidence``              the KV proof's success evidence and failure lines (``checks.evidence``)
``limits``                what the planner and ``launch`` refuse before anything starts
``cpu_lane``              what the CPU lane adds (environment, warnings, the vLLM plugin's shims)
``options``               the connector's own config fields and their command-line flags
``sweep``                 its built-in sweep (``nox -s <sweep>``, the bench's checks part)
``client_params``         the kv_transfer_params keys a client can forge (the hostile_clients check)
``transfer_op``           the perf check's link probe: the operation its transfers make (READ: the
                          decode pulls; WRITE: the prefill pushes), which the probe times and
                          whose side (prefill-0's or decode-0's device) starts it
========================  =====================================================================

Concerns that later work adds slot in as a field each: per-connector KV
accounting identities beside ``evidence``; a fault-injecting wrapper connector as a spec whose
``kv_config`` wraps another spec's.

Standard library only (``envfacts`` and the noxfile import the registry on bare interpreters).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pd_sessions.core.inventory import Inventory

Role = Literal["prefill", "decode"]
TransferOp = Literal["READ", "WRITE"]
KV_ROLES: Mapping[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}


class ConfigView(Protocol):
    """What a connector's rules read from a cluster config (``ClusterConfig`` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def connector(self) -> str: ...
    @property
    def prefill_tp(self) -> int: ...
    @property
    def decode_tp(self) -> int: ...
    @property
    def num_prefill(self) -> int: ...
    @property
    def num_decode(self) -> int: ...
    @property
    def hybrid(self) -> bool: ...
    @property
    def block_size(self) -> int | None: ...
    @property
    def decode_weights_seed(self) -> int | None: ...
    @property
    def mooncake_protocol(self) -> str: ...
    @property
    def mooncake_device_name(self) -> str: ...


@dataclass(frozen=True)
class Package:
    """The wheels that provide a connector, and what the import canary checks of them.

    Two shapes, told apart by ``base``:
    - variants only (``base`` None): exactly one of ``variants`` may be installed (they ship the
      same importable package and overwrite each other); a swap keeps the version;
    - a base distribution plus a backend variant (``base`` set): the base (a meta package) at the
      requirement's version, and the backend variant for torch's CUDA major at the same version.
    """

    name: str  # what `nox -s <name>_imports` and the install plans call it
    title: str  # for people: "the <title> connector"
    module: str  # its top-level import name (envfacts locates it)
    requirement: str  # the distribution requirements/kv_connectors.txt names
    variants: Mapping[int | None, str]  # torch's CUDA major (None: CPU-only torch) -> distribution
    imports: tuple[str, ...]  # what the canary imports
    native_prefixes: tuple[str, ...]  # file-name prefixes of the native modules those imports load
    base: str | None = None
    no_deps: bool = False  # install with --no-deps (the base's dependencies are the backends)

    @property
    def variant_dists(self) -> tuple[str, ...]:
        """Every variant distribution, each once, in the table's order."""
        return tuple(dict.fromkeys(self.variants.values()))

    @property
    def distributions(self) -> tuple[str, ...]:
        """Every distribution of the package (the base first)."""
        return ((self.base,) if self.base else ()) + self.variant_dists

    @property
    def providers(self) -> tuple[str, ...]:
        """The distributions that provide ``module``."""
        return (self.base,) if self.base else self.variant_dists

    def variant_for(self, cuda_major: int | None) -> str | None:
        """The variant for torch's CUDA major (None: CPU), or None when there is none."""
        return self.variants.get(cuda_major)

    def built_for(self, dist: str) -> int | None:
        """The CUDA major a variant is built for (None: built for CPU, or not a CUDA variant)."""
        return next((m for m, d in self.variants.items() if d == dist and m is not None), None)


@dataclass(frozen=True)
class Ports:
    """The ports a connector needs per instance, and the environment that hands them to vLLM.

    bootstrap_env     one port per instance (only prefill instances serve it; the others get their
                      own so none falls back to vLLM's fixed default); vllm-router takes it after
                      the prefill's URL (``--prefill URL PORT``)
    side_channel_env  the first of a block of ports, one per DP rank (vLLM listens on port + rank);
                      ``side_channel_host_env`` names the address it advertises
    """

    bootstrap_env: str | None = None
    side_channel_env: str | None = None
    side_channel_host_env: str | None = None


def _no_host_env(config: ConfigView, platform: str, address: str, interface: str | None) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class AcrossHosts:
    """What the connector needs when its instances run on different hosts (``--ray``,
    ``--simulate-hosts``; core/plan/across_hosts.py reads it).

    advertised_env  variables, besides VLLM_HOST_IP and ``ports.side_channel_host_env``, that give
                    the other hosts an address to dial: a loopback value there is refused
    env             (config, platform, the host's address, its interface or None) -> what every
                    instance on that host adds (e.g. the transport bound to the host's address;
                    on the CPU lane, transports that really cross hosts, not shared memory)
    """

    advertised_env: tuple[str, ...] = ()
    env: Callable[[ConfigView, str, str, str | None], dict[str, str]] = _no_host_env


@dataclass(frozen=True)
class Hops:
    """The two hops of a request aimed at one (prefill, decode) pair, as upstream's toy proxies make
    them: prefill with ``max_tokens`` 1, then decode with what tells it where the KV is."""

    # transfer id -> kv_transfer_params of the prefill hop
    prefill_params: Callable[[str], dict[str, object]]
    # (transfer id, the prefill's answer, bootstrap URL, engine id) -> those of the decode hop;
    # ValueError when the answer lacks what the decode needs
    decode_params: Callable[[str, Mapping[str, object], str | None, str | None], dict[str, object]]
    # a path the prefill's bootstrap server answers with its engines (asked before the hops), and
    # the engine id read from that answer (ValueError when no rank has registered yet)
    bootstrap_query: str | None = None
    engine_id: Callable[[Mapping[str, object]], str] | None = None


@dataclass(frozen=True)
class MetricEvidence:
    """Success shown by connector metrics on one role's ``/metrics`` (sample names as
    prometheus_client's parser gives them: counters end in ``_total``, histograms have
    ``_count``/``_sum``; summed over label sets)."""

    count: str  # one observation per completed transfer: must rise by one per router request
    bytes: str  # must rise
    failures: tuple[str, ...]  # must stay still
    role: Role  # the side that completes (records) the transfers
    what: str  # for the verdict, e.g. "READ transfers"
    # Histograms (names without _sum/_count) the perf check (checks/perf.py) times each transfer
    # with: its time in seconds; optional, the time to post it and its descriptors. Its bytes are
    # ``bytes``' histogram. None: the perf check reports no transfer.
    time: str | None = None
    post_time: str | None = None
    descriptors: str | None = None

    @property
    def samples(self) -> tuple[str, ...]:
        return (self.count, self.bytes, *self.failures)

    @property
    def histograms(self) -> dict[str, str]:
        """The perf check's transfer histograms: "xfer", "bytes", "post", "descs" -> name."""
        named = {"xfer": self.time, "post": self.post_time, "descs": self.descriptors}
        out = {k: v for k, v in named.items() if v}
        if self.time:
            out["bytes"] = self.bytes.removesuffix("_sum")
        return out


@dataclass(frozen=True)
class LogEvidence:
    """Success shown by vLLM's periodic "KV Transfer metrics: Name=N, ..." lines (for connectors
    that expose no Prometheus metrics); summed over the window."""

    success: str  # the field that counts successes: at least one in the window
    failures: tuple[str, ...]  # fields that count failures: none in the window
    # the field giving the mean MiB per success (across hosts, the KV bytes the link must carry)
    mean_mib: str | None = None


@dataclass(frozen=True)
class Refusal:
    """A config that cannot run, said before anything starts: the config field to change and why."""

    field: str
    message: str


@dataclass(frozen=True)
class HybridMlaHeteroTp:
    """A vLLM that cannot feed lower-TP decode ranks from a higher-TP prefill for a hybrid model
    with MLA layers over this connector, before ``fixed_in``."""

    fixed_in: str  # the first vLLM version with the fix
    why: str  # what goes wrong, for the refusal
    fix: str  # the upstream change that fixed it
    known_issue: str = ""  # its entry in configs/known_issues.toml, which the refusal cites


def _no_refusal(config: ConfigView, platform: str) -> Refusal | None:
    return None


def _no_host_refusal(configs: tuple[ConfigView, ...], platform: str, inv: Inventory) -> Refusal | None:
    return None


@dataclass(frozen=True)
class Limits:
    """What the connector cannot do, checked before launch."""

    hetero_tp: bool = True  # maps prefill TP ranks onto decode TP ranks when one size divides the other
    many_per_role: bool = True  # several prefill and decode instances behind one router
    # hybrid models: vLLM derives the block size from the per-GPU state, unequal under different
    # TP; a connector whose handshake compares block sizes needs one explicit block size
    hybrid_needs_block_size: bool = False
    hybrid_mla_hetero_tp: HybridMlaHeteroTp | None = None
    # (config, platform) -> why it cannot run there (e.g. a connector the CPU lane cannot run)
    refuse: Callable[[ConfigView, str], Refusal | None] = _no_refusal
    # (configs, platform, host inventory) -> why this host cannot run them (e.g. no RDMA device)
    host_refusal: Callable[[tuple[ConfigView, ...], str, Inventory], Refusal | None] = _no_host_refusal
    # request shapes (e.g. "n>1") its P/D path does not serve in the vLLM we run, as seen, with
    # the reason: the request_features check sends them over this connector last, each with a
    # short deadline, and the known-issues registry (configs/known_issues.toml) judges the
    # failure (XFAIL; XPASS once it passes: then retire the entry and this limit)
    unserved_requests: tuple[tuple[str, str], ...] = ()


def _no_warnings(config: ConfigView) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class CpuLane:
    """What the CPU lane adds for this connector."""

    env: tuple[tuple[str, str], ...] = ()  # every instance's environment (a config's extra_env wins)
    warnings: Callable[[ConfigView], tuple[str, ...]] = _no_warnings  # config values it replaces
    # what pd-sessions' vLLM plugin must do in every vLLM process for it (docs, the banner)
    shims: tuple[str, ...] = ()


@dataclass(frozen=True)
class Option:
    """A config field of this connector, and its command-line flag (``--set FIELD=V`` works too)."""

    field: str
    flag: str
    help: str
    choices: tuple[str, ...] = ()  # the allowed values; () = any string
    env: str | None = None  # the environment variable the flag's default is read from


@dataclass(frozen=True)
class KvAccounting:
    """What the connector's code says a decode loads for a P/D request (read by
    core/kv_identity.py, which states the identity): the trailing prompt tokens it leaves to the
    decode to recompute (its *backoff*), with and without SSM (Mamba) layers, and where in vLLM
    that comes from. A prompt no longer than the backoff is loaded whole."""

    backoff_ssm: int  # the model has SSM layers (a config's ``hybrid = true``)
    backoff_plain: int  # attention layers only
    code: str  # vLLM file: function


@dataclass(frozen=True)
class DetectionRate:
    """How many of the loads the fault injector corrupts (``fault_zero``, ``fault_swap``) the
    harness's checks must catch over this connector in one parity mode: at least ``needed`` of
    ``of``; ``measured`` says what was seen (the figure the requirement stands on)."""

    fault: str  # "zero" | "swap"
    parity_mode: str  # "exact" | "margin" (checks/parity.py choose_mode)
    needed: int
    of: int
    measured: str


@dataclass(frozen=True)
class SendLayout:
    """How the KV digest (pd_sessions/vllm_side/kv_observer.py, checks/kv_digest.py) pairs what a
    prefill sent with what a decode loaded, read from vLLM's connector code.

    ``key``: what both sides know a transfer by. "request_id": the prefill's own request id
    (``request_finished``'s ``request.request_id``), which the decode's load meta carries as
    ``remote.request_id``; "transfer_id": the id the router gives both hops
    (``kv_transfer_params["transfer_id"]`` on the prefill, the load meta's ``transfer_id``).
    ``recv_blocks``: what the decode's load meta lists in ``local_block_ids``. "all": its first
    ``local_num_computed_blocks`` hit in its own prefix cache (not loaded), then the ones it loads;
    "tail": only the blocks it loads. Either way the loaded blocks pair with the END of the
    prefill's list (vLLM trims the prefill's from the front to their count)."""

    key: str  # "request_id" | "transfer_id"
    recv_blocks: str  # "all" | "tail"
    code: str  # where in vLLM this comes from


@dataclass(frozen=True)
class ClientParams:
    """The ``kv_transfer_params`` keys a client can forge for this connector, read from vLLM's
    connector code (``code``) by the hostile_clients check (checks/hostile_clients.py), which bends
    a real transfer's parameters one key at a time.

    ``engine_key``: the decode hop's key naming the prefill engine to load from. ``decode_id_key``:
    the decode hop's key a transfer is known by on the prefill (Mooncake's ``transfer_id``, NIXL's
    ``remote_request_id``). ``prefill_id_key``: the prefill hop's key that names the transfer (None:
    the prefill names it itself and answers with it, so a client cannot choose it). ``block_key``:
    the decode hop's list of the prefill's block ids (None: the decode asks the prefill by id).
    ``not_sent``: (case, entry point, why) the check does not send to a shared cluster because it
    kills an instance there; ``why`` cites the known issue (configs/known_issues.toml) and what
    was seen, and the check records the case NOT RUN with it."""

    engine_key: str
    decode_id_key: str
    prefill_id_key: str | None
    block_key: str | None
    code: str
    not_sent: tuple[tuple[str, str, str], ...] = ()

    def why_not_sent(self, case: str, entry: str) -> str | None:
        """Why ``case`` is not sent to ``entry`` ("router", "decode", "prefill"), or None."""
        return next((why for c, e, why in self.not_sent if (c, e) == (case, entry)), None)


@dataclass(frozen=True)
class ConnectorSpec:
    """One KV connector: see the module docstring for who reads what."""

    name: str  # the config's `connector` value
    title: str  # for people
    vllm_class: str  # --kv-transfer-config's kv_connector
    router_flag: str  # vllm-router --kv-connector
    package: Package
    # (config, platform) -> --kv-transfer-config's keys beyond kv_connector and kv_role
    kv_config: Callable[[ConfigView, str], dict[str, object]]
    hops: Hops
    evidence: MetricEvidence | LogEvidence
    # the KV accounting identity's numbers (core/kv_identity.py): no slack without a named reason
    kv_accounting: KvAccounting
    # regular expressions (case-sensitive, anywhere in a line) of an instance log line that means
    # a transfer failed; any such line fails the KV proof
    failure_lines: tuple[str, ...]
    # the one-sided operation that moves its KV, named from the side that starts it: "READ" (the
    # decode reads the prefill's blocks) or "WRITE" (the prefill writes into the decode's); the
    # perf check's link probe times the same operation in the same direction (checks/perf.py)
    transfer_op: TransferOp
    ports: Ports = field(default_factory=Ports)
    across_hosts: AcrossHosts = field(default_factory=AcrossHosts)
    limits: Limits = field(default_factory=Limits)
    cpu_lane: CpuLane = field(default_factory=CpuLane)
    options: tuple[Option, ...] = ()
    sweep: str = ""  # its built-in sweep (configs/<sweep>.toml)
    # where vLLM added the class, for a vLLM that lacks it (e.g. "vllm-project/vllm#35264")
    added_by: str = ""
    # how its decode worker's connector metadata lists the loads to start (reqs_to_recv), for
    # pd-sessions' fault injector (pd_sessions/vllm_side/fault_connector.py): "flat" {req: meta},
    # "by_engine" {remote engine: {req: meta}}; None (unknown): the injector's zero, swap and
    # decode stall are logged as skipped
    recv_layout: str | None = None
    # how the KV digest pairs a prefill's send with a decode's load (SendLayout); None (unknown):
    # the kv_digest check is NOT RUN over it, saying so
    send_layout: SendLayout | None = None
    # the corruption detection rates the fault scenarios require, per fault and parity mode
    # (checks/faults/corrupt.py); a pair not listed requires at least one detection, and says so
    detection: tuple[DetectionRate, ...] = ()
    # the kv_transfer_params keys a client can forge (ClientParams); None (unknown): the
    # hostile_clients check is NOT RUN over it, saying so
    client_params: ClientParams | None = None
    # how long a prefill keeps a sent request's blocks for a read that never comes (NIXL's KV
    # lease, kv_lease_duration); None: no bounded lease. The conservation check, finding blocks
    # still held at its last probe, waits this long (and a little) before it calls them leaked
    kv_lease_s: float | None = None

    def detection_rate(self, fault: str, parity_mode: str) -> DetectionRate | None:
        """The rate written for ``fault`` in ``parity_mode``, or None."""
        return next((d for d in self.detection if (d.fault, d.parity_mode) == (fault, parity_mode)), None)

    def kv_transfer_config(self, config: ConfigView, role: str, platform: str) -> dict[str, object]:
        """The ``--kv-transfer-config`` value for an instance of ``role`` on ``platform``."""
        return {
            "kv_connector": self.vllm_class,
            "kv_role": KV_ROLES[role],
            **self.kv_config(config, platform),
        }

    def advertised_env(self) -> tuple[str, ...]:
        """The connector's variables that give the other hosts an address to dial."""
        side = (self.ports.side_channel_host_env,) if self.ports.side_channel_host_env else ()
        return (*side, *self.across_hosts.advertised_env)

    def port_env(self, host: str, bootstrap: int | None, side_channel: int | None) -> dict[str, str]:
        """The environment that hands an instance its connector ports (and the host it advertises)."""
        env: dict[str, str] = {}
        if self.ports.bootstrap_env and bootstrap is not None:
            env[self.ports.bootstrap_env] = str(bootstrap)
        if self.ports.side_channel_host_env and side_channel is not None:
            env[self.ports.side_channel_host_env] = host
        if self.ports.side_channel_env and side_channel is not None:
            env[self.ports.side_channel_env] = str(side_channel)
        return env
