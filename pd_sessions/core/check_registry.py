"""Every check, registered in one place: its name, its gatherer, whether sweeps run it by
default and its options (with defaults). The gatherer is named here as data (its module under
``pd_sessions.checks`` and its function: the core imports no check), and checks/runner.py
resolves each name to its code, failing loudly on a name that does not resolve.

Standard library only (the sweep loader, which the noxfile imports, validates names and
options against this table).

A sweep selects checks with ``checks = [...]`` at the top of its TOML (default: every check
that is a default on the run's platform, :func:`defaults`; the command line's
``--set checks=[...]`` replaces either) and sets options with ``[check_options.<name>]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pd_sessions.core.errors import ConfigError, did_you_mean


@dataclass(frozen=True)
class CheckInfo:
    name: str
    summary: str  # one line for docs and --help
    # The code that gathers it: (module under pd_sessions.checks, function), e.g.
    # ("faults.corrupt", "run_zero"); the function takes (window, options) -> CheckResult.
    # checks/runner.py resolves it (the core may not import the checks).
    gatherer: tuple[str, str]
    default: bool = True  # run when a sweep does not list its checks
    options: Mapping[str, Any] = field(default_factory=dict)  # option -> default value
    # Platforms where ``default`` applies; elsewhere the check runs only when a sweep lists it.
    platforms: tuple[str, ...] = ("cpu", "cuda")
    # It injects faults: its cluster's connectors are then wrapped by the fault injector
    # (pd_sessions/vllm_side/fault_connector.py). Never a default: select it (`checks`, `--check`).
    faults: bool = False
    # Checks that must run after it when it runs (the cluster needs them to be whole again).
    requires: tuple[str, ...] = ()
    # It needs prefill and decode on different hosts (a wire between them): refused before
    # launch on one host (--simulate-hosts N or --ray ADDRESS give the hosts).
    hosts: bool = False
    # Required by a sweep that declares no ``required_checks`` (its NOT RUN then fails the
    # config, unless the check said the config is outside what it judges: an inapplicable NOT
    # RUN, core/results.py, e.g. kv_digest over different TP sizes).
    # perf is not: its baseline part is NOT RUN on every hardware class without a
    # recorded baseline (the GPU lanes today), and a GPU sweep that runs it by default must not
    # fail for that; a sweep that must judge perf names it in required_checks.
    required: bool = True


# In running order.
CHECKS: tuple[CheckInfo, ...] = (
    CheckInfo(
        "smoke",
        "a completion through the router returns the requested tokens",
        gatherer=("smoke", "run"),
    ),
    CheckInfo(
        "parity",
        "greedy output through the router equals prefill-direct, token for token",
        gatherer=("parity", "run"),
    ),
    CheckInfo(
        "kv_transfer",
        "decode instances received the router requests' prompt tokens by KV "
        "transfer; a request straight to decode-0 does not count",
        gatherer=("kv_transfer", "run"),
    ),
    CheckInfo(
        "pd_calls",
        "each request through the router makes exactly one prefill call and one decode call "
        "(up to 1 + declared_retries each where the config declares retries), counted on the "
        "instances around each request",
        gatherer=("pd_calls", "run"),
        options={"requests": 3},
    ),
    CheckInfo(
        "kv_capacity",
        "no P/D instance holds materially less KV (vllm:cache_config_info, in tokens) than prefill-0, "
        "the reference of the same model and settings",
        gatherer=("kv_capacity", "run"),
        options={"min_ratio": 0.9},
        # NOT RUN where no instance shares prefill-0's TP (heterogeneous TP: other amounts by
        # design), which must not fail those configs; a FAIL still does.
        required=False,
    ),
    CheckInfo(
        "request_features",
        "the request paths users send (first-token finish, n=2, logprobs, streaming with usage, "
        "echo, seeds, chat, prompts at block boundaries with exact per-request KV accounting) "
        "through the router equal prefill-direct, or are refused with a clear 4xx",
        gatherer=("request_features", "run"),
    ),
    CheckInfo(
        "cache_paths",
        "parity in the prefix-cache situations: a prompt shorter than a block, "
        "a full hit on the decode side, a partial hit",
        gatherer=("cache_paths", "run"),
    ),
    CheckInfo(
        "too_long",
        "a prompt longer than the model length gets a 4xx through the router within "
        "a bounded time; afterwards every instance is healthy and a normal request succeeds",
        gatherer=("too_long", "run"),
        options={"bound_s": 10.0},
    ),
    CheckInfo(
        "burst",
        "concurrent requests through the router all succeed, each equals prefill-direct "
        "token for token, and the KV proof counts every one",
        gatherer=("burst", "run"),
        options={"requests": 32, "max_tokens": 8},
    ),
    CheckInfo(
        "abort_frees_kv",
        "streaming requests whose client disconnects after the first tokens "
        "leave no running request and no held KV blocks on any instance",
        gatherer=("abort_frees_kv", "run"),
        # first_token_s: how long a stream may wait for its first token. On the 2-core CPU lane
        # NIXL decode hops can each wait out a prefill's 30 s KV lease, one after the other for
        # concurrent streams (docs/cpu-lane.md, "What the 30 s stalls are"): 4 x 30 s + margin.
        options={"requests": 4, "bound_s": 15.0, "first_token_s": 150.0},
    ),
    CheckInfo(
        "accuracy",
        "lm_eval through the router against a recorded baseline (CPU lane: "
        "per-sample identity with prefill-direct)",
        gatherer=("accuracy", "run"),
    ),
    CheckInfo(
        "preemption",
        "a burst onto a decode whose KV cache holds fewer blocks than it needs: the decode "
        "preempts requests, every output still equals prefill-direct and the KV proof holds "
        "(the preemption sweep)",
        gatherer=("preemption", "run"),
        default=False,
        options={"requests": 8, "max_tokens": 48},
    ),
    CheckInfo(
        "perf",
        "vLLM's own `vllm bench serve` through the router and against prefill-0 (colocated): "
        "TTFT, ITL, TPOT and throughput, where TTFT goes, KV bandwidth against the transport "
        "alone, and the perf baseline of this hardware",
        gatherer=("perf", "run"),
        # input_len/output_len: tokens per request (random dataset); requests: per run;
        # concurrency: one run through the router and one against prefill-0 at each level.
        # The defaults keep it within 90 s on the 2-core CPU lane; GPU sweeps may ask for more.
        options={"concurrency": (1, 8), "requests": 8, "input_len": 256, "output_len": 16},
        # On by default where instances have a core each; on the 2-core CPU lane it is opt-in.
        platforms=("cuda",),
        required=False,
    ),
    # The fault scenarios (pd_sessions/checks/faults/): each injects one fault through the
    # wrapped connector and holds the promise: every request equals prefill-direct or fails
    # with a clear HTTP error within the request bound, then the cluster recovers.
    CheckInfo(
        "fault_hop_retry",
        "a fault proxy between a second vllm-router and each decode retries every decode call "
        "whose first attempt it cut: pd_calls must fail naming each extra call (passes where "
        "declared_retries allows it); the proxies and router are stopped, verified gone",
        gatherer=("faults.hop_retry", "run"),
        default=False,
        options={"requests": 3},
        faults=True,
    ),
    CheckInfo(
        "fault_drop",
        "KV loads reported failed: each request is still correct (recompute) or fails with a "
        "clear HTTP error, per kv_load_failure_policy; the cluster recovers",
        gatherer=("faults.drop", "run"),
        default=False,
        options={"requests": 4},
        faults=True,
    ),
    CheckInfo(
        "fault_zero",
        "received KV blocks overwritten with zeros: the burst's comparison with prefill-direct "
        "must fail naming the requests; detection rate recorded; the cluster recovers",
        gatherer=("faults.corrupt", "run_zero"),
        default=False,
        options={"requests": 32, "max_tokens": 8},
        faults=True,
    ),
    CheckInfo(
        "fault_swap",
        "received KV blocks overwritten with another request's: the burst's comparison must "
        "fail naming the requests; detection rate recorded; the cluster recovers",
        gatherer=("faults.corrupt", "run_swap"),
        default=False,
        options={"requests": 32, "max_tokens": 8},
        faults=True,
    ),
    CheckInfo(
        "fault_mixup",
        "under concurrency each request's whole prompt KV replaced with another concurrent "
        "request's (HTTP 200 with another's answer: vllm#52234): parity or the KV digest must catch "
        "every one (N/N); both rates recorded; the cluster recovers",
        gatherer=("faults.mixup", "run"),
        default=False,
        options={"requests": 4, "max_tokens": 8},
        faults=True,
    ),
    CheckInfo(
        "fault_truncate",
        "the decode ends each answer after cut_to tokens and the client gets HTTP 200: smoke's "
        "rule and parity (exact or margin) must fail every truncated answer; the cluster recovers",
        gatherer=("faults.truncate", "run"),
        default=False,
        options={"requests": 2, "max_tokens": 8, "cut_to": 2},
        faults=True,
    ),
    CheckInfo(
        "fault_partial_recompute",
        "the decode loads part of each prompt's KV and computes the rest (tokens of its last "
        "block): the answer is right, the KV accounting (prompt tokens by source) must catch "
        "every request, naming its counts; the cluster recovers",
        gatherer=("faults.recompute", "run"),
        default=False,
        options={"requests": 2, "max_tokens": 4, "tokens": 8},
        faults=True,
    ),
    CheckInfo(
        "fault_stall_abort",
        "clients disconnect before the first token, while the prefill is stalled and while the "
        "decode waits for stalled KV: the abort empties the stalled instance's queues within "
        "abort_bound_s (below stall_s), every block on both sides free within stall_s + free_slack_s",
        gatherer=("faults.stall_abort", "run"),
        default=False,
        options={"requests": 2, "stall_s": 8.0, "abort_bound_s": 4.0, "free_slack_s": 5.0},
        faults=True,
    ),
    CheckInfo(
        "fault_strand",
        "the prefill never frees the blocks of requests whose clients left while the decode waited "
        "for stalled KV (the injector keeps their finished sends from its scheduler): the "
        "conservation invariant must catch the stranded blocks, naming the prefill; then the "
        "blocks are handed back and the cluster recovers",
        gatherer=("faults.strand", "run"),
        default=False,
        options={"requests": 2, "stall_s": 3.0, "free_slack_s": 3.0},
        faults=True,
    ),
    CheckInfo(
        "fault_peer_death",
        "the prefill SIGKILLed while a decode waits for its stalled KV: the decode answers with "
        "an error or a correct recompute, stays healthy and frees its blocks",
        gatherer=("faults.peer_death", "run"),
        default=False,
        options={"stall_s": 5.0, "bound_s": 60.0},
        faults=True,
        requires=("fault_restart",),
    ),
    CheckInfo(
        "fault_restart",
        "the killed prefill started again with the same ports and role: time until P/D answers "
        "correctly again",
        gatherer=("faults.restart", "run"),
        default=False,
        options={"deadline_s": 600.0, "bound_s": 120.0},
        faults=True,
    ),
    # Faults on the wire between the prefill and decode hosts (pd_sessions/checks/faults/wire_*.py):
    # nftables rules on the KV ports, a tbf qdisc; each proves its fault bit from the kernel's
    # counters and holds the same promise. Only across hosts.
    CheckInfo(
        "wire_loss",
        "a share of the KV packets between the prefill and decode hosts dropped (each rate of "
        "`rates`, in %): every request correct or failed clearly; where requests start to slow "
        "or fail; the cluster recovers",
        gatherer=("faults.wire_loss", "run"),
        default=False,
        options={"rates": (2, 20), "requests": 3, "bound_s": 60.0},
        hosts=True,
    ),
    CheckInfo(
        "wire_partition",
        "every KV packet between the prefill and decode hosts dropped for partition_s in the "
        "middle of a burst, then healed: what the requests got, the time to serve correctly again",
        gatherer=("faults.wire_partition", "run"),
        default=False,
        options={"requests": 4, "partition_s": 3.0, "bound_s": 60.0},
        hosts=True,
    ),
    CheckInfo(
        "wire_cap",
        "the prefill host's interface capped (tbf, rate_kbit): a burst still passes, every "
        "request correct, slower by what the cap costs",
        gatherer=("faults.wire_cap", "run"),
        default=False,
        options={"requests": 3, "rate_kbit": 4000, "bound_s": 60.0},
        hosts=True,
    ),
    CheckInfo(
        "wire_delay",
        "a delay (netem, delay_ms) on the prefill host's interface: every request correct; "
        "recorded as not run where the kernel has no netem",
        gatherer=("faults.wire_delay", "run"),
        default=False,
        options={"requests": 3, "delay_ms": 20, "bound_s": 60.0},
        hosts=True,
    ),
    # Restarts in place, cycle after cycle (checks/soak.py): after the faults, so that it leaves the
    # cluster whole; before kv_digest, which then also compares the KV of every request it sent.
    CheckInfo(
        "soak",
        "leaks across restarts: `cycles` times, the prefill then the decode SIGKILLed and started again "
        "in place; after each restart P/D answers correctly, parity and the KV digest pass; the growth "
        "per cycle of each process's fds, threads, RSS and KV blocks in use stays within its bound",
        gatherer=("soak", "run"),
        default=False,
        # the bounds on the growth per cycle (the mean over the cycles) of a process that lives
        # through a peer's restart (KV blocks: 0, not an option). Measured (docs/soak.md, NIXL 1x1,
        # CPU lane): processes that leak nothing moved by a mean of -0.7..+0.7 fds, 0 threads,
        # at most 1.9 MiB RSS a cycle; the NIXL decode gains 3-4 sockets per prefill restart
        # (known issue nixl-remove-remote-agent-keeps-endpoints). bound_s: once the restarted
        # instance is ready, how long P/D may answer a clear error before a correct answer (one of
        # 24 restarts measured: vllm-router answered 503 for 108 s, its health checks every 60 s)
        options={
            "cycles": 3,
            "fds_per_cycle": 2.0,
            "threads_per_cycle": 0.5,
            "rss_mib_per_cycle": 8.0,
            "deadline_s": 600.0,
            "bound_s": 240.0,
        },
        requires=("kv_digest",),
    ),
    # Last: it compares the KV of every request the checks before it sent. A default on the CPU
    # lane, where `nox -s bench` measures what it costs a config (its digest part: under 5 %; the
    # observer's own time, 0.5-3 ms per record). Not on cuda: the observer's GPU path (a torch
    # reduction on the device) has never run inside vLLM on a GPU; GPU sweeps select it
    # (`--check kv_digest`). Where it has nothing to compare (prefill and decode of different
    # TP sizes or block layouts, a hybrid model, a connector whose sends it cannot pair, NIXL
    # push) it is NOT RUN, inapplicable: its config does not fail for it (results.inapplicable);
    # where it should have looked and could not (an instance without its observer, side files
    # it cannot read), its NOT RUN fails the config as every required check's does.
    CheckInfo(
        "kv_digest",
        "every KV block a decode loaded equals, byte for byte (a checksum per layer), the block the "
        "prefill sent, for every request of every check (vLLM-side observer; NOT RUN, failing "
        "nothing, where the layouts differ or the model is hybrid)",
        gatherer=("kv_digest", "run"),
        platforms=("cpu",),
    ),
    # Last: it judges the probes the runner takes after every check before it.
    CheckInfo(
        "conservation",
        "after every check, every instance idle again within idle_bound_s (no request, no KV block "
        "in use: no send left in flight) and its open fds, threads and RSS within a bound of their "
        "values after the first check; transfer counts NOT RUN where vLLM exposes no counter",
        gatherer=("conservation", "run"),
        options={"idle_bound_s": 10.0, "fds_bound": 64, "threads_bound": 32, "rss_bound_mib": 512},
        required=False,
    ),
    # After every other check, kv_digest and conservation included: it looks for a request left
    # stuck, a KV block left held or a process killed by a client's request, none of which a check
    # after it could stand (a held block or a stuck request stays until its connector's timeout);
    # what it leaves held is its own verdict (its idle wait), not conservation's.
    CheckInfo(
        "hostile_clients",
        "client-made kv_transfer_params (another live request's transfer, a replayed or duplicate "
        "one, an unknown engine, out-of-range block ids, oversized or malformed values) through the "
        "router and straight to decode-0 and prefill-0: each gets a clear 4xx or its own right "
        "answer, every victim stays right, nothing hangs, dies or keeps a KV block",
        gatherer=("hostile_clients", "run"),
        default=False,
        # deadline_s: each request's bound (a tiny model answers in well under a second on the CPU
        # lane); idle_s: how long after the cases every instance may take to be idle again
        options={"deadline_s": 6.0, "idle_s": 4.0},
    ),
)
BY_NAME = {c.name: c for c in CHECKS}
NAMES = tuple(BY_NAME)
# The checks that run everywhere unless a sweep lists its own (see defaults() per platform: perf is
# a default on cuda only, kv_digest on cpu only).
DEFAULTS = tuple(c.name for c in CHECKS if c.default and len(c.platforms) == 2)
FAULTS = tuple(c.name for c in CHECKS if c.faults)
WIRE = tuple(c.name for c in CHECKS if c.hosts)
# The check whose selection loads the KV digest's observer into every instance's connector.
KV_DIGEST = "kv_digest"


def defaults(platform: str) -> tuple[str, ...]:
    """The checks a sweep that lists none runs on ``platform`` ("cpu" or "cuda"), in order."""
    return tuple(c.name for c in CHECKS if c.default and platform in c.platforms)


def injects_faults(names: Sequence[str]) -> bool:
    """Whether any of ``names`` (checks, or other names such as exec[0]) injects faults."""
    return any(BY_NAME[n].faults for n in names if n in BY_NAME)


def across_hosts_only(names: Sequence[str], *, across_hosts: bool) -> None:
    """ConfigError when one of ``names`` needs prefill and decode on different hosts and the
    run has one host: it names them and the fix (before anything is launched)."""
    need = [n for n in names if n in BY_NAME and BY_NAME[n].hosts]
    if need and not across_hosts:
        raise ConfigError(
            "--check",
            f"{', '.join(need)} inject(s) faults on the wire between the prefill and decode hosts, "
            "and this run has one host (no wire between them): add --simulate-hosts 2 (two "
            "simulated hosts on this machine) or --ray ADDRESS (a Ray cluster's hosts)",
        )


def resolve(
    selected: Sequence[str] | None, *, field_name: str = "checks", source: str | None = None
) -> tuple[str, ...]:
    """Validate a selection and put it in running order (None = the defaults).

    None                    -> DEFAULTS
    [] (empty list)         -> ConfigError: a sweep must run at least one check
    an unknown name         -> ConfigError naming it, with a did-you-mean and the known names
    a name twice            -> ConfigError
    a check whose ``requires`` are not all selected (fault_peer_death without
    fault_restart: the cluster would stay without its prefill) -> ConfigError naming them
    known names             -> those names, in the registry's running order
    """
    if selected is None:
        return DEFAULTS
    if not isinstance(selected, (list, tuple)) or not all(isinstance(s, str) for s in selected):
        raise ConfigError(
            field_name,
            f"got {selected!r}; allowed: a list of check names from {', '.join(NAMES)}",
            source=source,
        )
    if not selected:
        raise ConfigError(
            field_name,
            f"an empty list runs no check; allowed: names from "
            f"{', '.join(NAMES)} (leave the key out for the defaults)",
            source=source,
        )
    for s in selected:
        if s not in BY_NAME:
            raise ConfigError(
                field_name,
                f"unknown check {s!r}{did_you_mean(s, NAMES)}; known: {', '.join(NAMES)}",
                source=source,
            )
    dupes = sorted({s for s in selected if list(selected).count(s) > 1})
    if dupes:
        raise ConfigError(field_name, f"check(s) {dupes} listed more than once", source=source)
    for s in selected:
        missing = [r for r in BY_NAME[s].requires if r not in selected]
        if missing:
            raise ConfigError(
                field_name,
                f"{s} needs {', '.join(missing)} after it (the cluster is not whole again "
                f"without it); add it",
                source=source,
            )
    return tuple(n for n in NAMES if n in selected)


def resolve_options(raw: Mapping[str, Any] | None, *, source: str | None = None) -> dict[str, dict[str, Any]]:
    """``[check_options.<check>]`` tables -> check -> full options (defaults filled in).

    Unknown checks and options are errors with a did-you-mean; a value must have the
    default's type (an int where a float is expected is accepted) and be above 0; where the
    default is a list (perf's concurrency levels), a non-empty list of such values, kept
    as a tuple.
    """
    out = {c.name: dict(c.options) for c in CHECKS if c.options}
    for check, opts in (raw or {}).items():
        where = f"check_options.{check}"
        if check not in BY_NAME:
            raise ConfigError(
                where, f"unknown check{did_you_mean(check, NAMES)}; known: {', '.join(NAMES)}", source=source
            )
        known = BY_NAME[check].options
        if not isinstance(opts, Mapping):
            raise ConfigError(where, f"got {opts!r}; allowed: a table of options", source=source)
        for key, value in opts.items():
            if key not in known:
                allowed = ", ".join(known) or "none (this check has no options)"
                raise ConfigError(
                    f"{where}.{key}",
                    f"unknown option{did_you_mean(key, known)}; allowed: {allowed}",
                    source=source,
                )
            default = known[key]
            if isinstance(default, tuple):
                items = value if isinstance(value, (list, tuple)) else [None]
                if not items or not all(_positive(v, type(default[0])) for v in items):
                    raise ConfigError(
                        f"{where}.{key}",
                        f"got {value!r}; allowed: a list of positive {type(default[0]).__name__}s "
                        f"(default {list(default)!r})",
                        source=source,
                    )
                out[check][key] = tuple(items)
                continue
            if not _positive(value, type(default)):
                raise ConfigError(
                    f"{where}.{key}",
                    f"got {value!r}; allowed: a positive {type(default).__name__} (default {default!r})",
                    source=source,
                )
            out[check][key] = value
    return out


def _positive(value: Any, want: type) -> bool:
    """``value`` is a number of type ``want`` (an int where a float is wanted) above 0."""
    ok = isinstance(value, want) or (want is float and isinstance(value, int))
    return ok and not isinstance(value, bool) and value > 0
