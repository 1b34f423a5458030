"""hostile_clients: requests whose ``kv_transfer_params`` a client made up, sent through the router
and straight to decode-0 and prefill-0 (any client that reaches an instance's API can send them:
vLLM takes the field from the public request body).

The cases (:data:`DECODE_CASES` go to the router and the decode as a decode hop would carry them,
:data:`PREFILL_CASES` to the prefill as a prefill hop would); each bends a real transfer's parameters
(made by the connector's own two hops, ``Hops``) by one key the connector spec names
(``ClientParams``: core/connectors/):

- ``live_id``: another live request's transfer (its prefill hop done, its decode hop not yet),
  then that victim's own decode hop;
- ``replayed``: a consumed transfer's parameters again;
- ``duplicate_own``: two prefill hops at once with one transfer id the client chose;
- ``unknown_engine``, ``block_ids_out_of_range``, ``oversized`` (a 256 KiB id), ``not_an_object``
  (a string), ``wrong_types`` (a dict where an id goes).

The promise, judged by :func:`evaluate` (pure):

- each victim (the live transfer's owner, the replayed transfer's owner, the twin of a duplicate)
  answers 200, equal to prefill-direct (parity's mode: checks/parity.py);
- each hostile request gets a clear 4xx (with a message) or its own right answer; no answer
  within ``deadline_s`` is a hang;
- afterwards every instance is idle (no running or waiting request, no KV block in use) within
  ``idle_s``: a block that stays held fails, naming the instance; and every process answers
  /health (none died).

A case a connector cannot express (no block ids in Mooncake's decode hop, no client-chosen id in
NIXL's prefill hop) or one its spec says kills an instance of a shared cluster is recorded NOT RUN
with the reason. The table (case, entry point, status, right answer, victim) is in the details, and
``router_params`` says whether the router replaced the client's parameters (every forged request
through it answered right) or not. Runs last: a held block or a stuck request is what it looks for.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from pd_sessions.checks import instances, parity
from pd_sessions.checks.answers import error_message
from pd_sessions.checks.completions import Completion
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import connectors
from pd_sessions.core.connectors.base import ClientParams, Hops
from pd_sessions.core.plan import ClusterPlan
from pd_sessions.core.results import FAIL, NOT_RUN, PASS, CheckResult, Figure, Table, pick, reporting
from pd_sessions.runtime import http

NAME = "hostile_clients"
ENTRIES = ("router", "decode", "prefill")
DECODE_CASES = (
    "live_id",
    "replayed",
    "unknown_engine",
    "block_ids_out_of_range",
    "oversized",
    "not_an_object",
    "wrong_types",
)
PREFILL_CASES = ("live_id", "duplicate_own", "oversized", "not_an_object", "wrong_types")
MAX_TOKENS = 8
OVERSIZED = 256 * 1024  # characters of the oversized id
NO_ENGINE = "pd-sessions-no-such-engine"
OUT_OF_RANGE = [2**31 - 2, 2**31 - 1]
IDLE_POLL_S = 0.25


@dataclass(frozen=True)
class Sent:
    """One request and what came back: a completion (200), an error status with its message, or
    none within the deadline (``status`` None)."""

    status: int | None
    seconds: float
    error: str = ""
    completion: Completion | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.completion is not None


@dataclass(frozen=True)
class Outcome:
    """One case at one entry point: the hostile request, its victim (if the case has one) and
    whether each answer equals prefill-direct's ("" = right; else why not; None = not judged)."""

    case: str
    entry: str
    hostile: Sent | None = None  # None: not sent (``not_sent`` says why)
    victim: Sent | None = None
    hostile_wrong: str | None = None
    victim_wrong: str | None = None
    not_sent: str = ""
    prompts: tuple[str, str] = ("", "")  # (hostile, victim) prompts, for the references


@dataclass(frozen=True)
class Aftermath:
    """The cluster after the cases: /health per process, and whether every instance went idle."""

    health: Mapping[str, str]
    idle_s: float | None  # seconds until every instance was idle; None: not within bound_s
    bound_s: float
    held: Mapping[str, Mapping[str, float]]  # instance -> its non-idle gauges at the end (if not idle)


# ---------------------------------------------------------------- pure


def hostile_problem(o: Outcome, deadline_s: float) -> str | None:
    """Why the hostile request breaks the promise, or None.

    not sent                          -> None (NOT RUN, recorded)
    no answer within the deadline     -> "hang"
    4xx with a message                -> None (a clear refusal)
    4xx without a message             -> "4xx without a message"
    another non-200 status            -> "HTTP <status>"
    200 and not its own right answer  -> "wrong answer"
    """
    h = o.hostile
    if h is None:
        return None
    if h.status is None:
        return f"hang (no answer within {deadline_s:g} s)"
    if h.status == 0:
        return f"no connection ({h.error[:120]})"
    if 400 <= h.status < 500:
        return None if h.error.strip() else f"HTTP {h.status} without a message"
    if not h.ok:
        return f"HTTP {h.status}"
    return f"wrong answer ({o.hostile_wrong})" if o.hostile_wrong else None


def victim_problem(o: Outcome, deadline_s: float) -> str | None:
    """Why the victim's answer breaks the promise (it must be 200 and right), or None."""
    v = o.victim
    if v is None:
        return None
    if v.status is None:
        return f"victim hang (no answer within {deadline_s:g} s)"
    if v.status == 0:
        return f"victim no connection ({v.error[:120]})"
    if not v.ok:
        return f"victim HTTP {v.status}"
    return f"victim wrong answer ({o.victim_wrong})" if o.victim_wrong else None


def _short(kind: str) -> str:
    """The stable part of a problem (what the known-issues registry matches): no numbers or text."""
    return kind.split(" (")[0]


def router_params(outcomes: Sequence[Outcome], deadline_s: float) -> str:
    """What the router did with the client's kv_transfer_params, as seen: "replaced" when every
    forged request sent through it got its own right answer or a clear 4xx, and its victims
    stayed right; else "not replaced: <cases>"; "not sent" when none went through it."""
    sent = [o for o in outcomes if o.entry == "router" and o.hostile is not None]
    if not sent:
        return "not sent"
    bad = [o.case for o in sent if hostile_problem(o, deadline_s) or victim_problem(o, deadline_s)]
    return f"not replaced: {', '.join(bad)}" if bad else "replaced"


def row(o: Outcome, deadline_s: float) -> dict[str, Any]:
    """One line of the table: the case, the entry point, what each side got."""

    def status(s: Sent | None) -> str:
        if s is None:
            return "-"
        return "no answer" if s.status is None else str(s.status)

    hp, vp = hostile_problem(o, deadline_s), victim_problem(o, deadline_s)
    return {
        "case": o.case,
        "entry": o.entry,
        "status": "not run" if o.hostile is None else status(o.hostile),
        "hostile_right": None if o.hostile is None or not o.hostile.ok else not o.hostile_wrong,
        "victim": status(o.victim),
        "victim_right": None if o.victim is None or not o.victim.ok else not o.victim_wrong,
        "verdict": "not run" if o.hostile is None else ("fail" if hp or vp else "pass"),
        "problem": "; ".join(p for p in (hp, vp) if p) or o.not_sent,
        "error": (o.hostile.error[:160] if o.hostile else ""),
    }


def numbers(details: Mapping[str, Any]) -> list[Figure | Table]:
    """What the report shows: the table per case and entry point, and the aftermath."""
    rows = details.get("table") or []
    return [
        *pick(details, ("router_params", ""), ("idle_s", "s"), ("idle_bound_s", "s"), ("deadline_s", "s")),
        Table(
            "client-made kv_transfer_params per case and entry point",
            ("case", "entry", "status", "hostile right", "victim", "victim right", "verdict", "problem"),
            tuple(
                (
                    r["case"],
                    r["entry"],
                    r["status"],
                    r["hostile_right"],
                    r["victim"],
                    r["victim_right"],
                    r["verdict"],
                    r["problem"],
                )
                for r in rows
            ),
        ),
    ]


def aftermath_problems(after: Aftermath) -> list[str]:
    """A process that does not answer /health (died or sick), an instance not idle within the bound."""
    out = [f"{n} /health: {h}" for n, h in after.health.items() if h != "ok"]
    if after.idle_s is None:
        out += [
            f"{n} not idle {after.bound_s:g} s after the cases (KV block held): "
            + ", ".join(f"{k.split(':')[-1]} {v:g}" for k, v in g.items())
            for n, g in after.held.items()
        ]
    return out


@reporting(numbers)
def evaluate(outcomes: Sequence[Outcome], after: Aftermath, *, deadline_s: float) -> CheckResult:
    """Verdict.

    a hostile request hung, got a 5xx, a 4xx without a message or a wrong 200 -> FAIL naming
        the case and entry point
    a victim hung, failed or answered wrong                                 -> FAIL naming them
    a process unhealthy afterwards (died), an instance not idle in bound    -> FAIL naming it
    no case sent                                                            -> NOT RUN (reasons)
    otherwise                                                               -> PASS (cases not
        sent are named in the message and the table)

    ``details["failures"]``: the sorted problems without their numbers ("case@entry: kind", "KV
    held on NAME", "NAME unhealthy"); ``details["failed_cases"]``: the same without the kind
    ("case@entry"), what a known issue's ``fails_when`` matches: how a case fails straight at an
    instance may vary from run to run (the same oversized Mooncake pull hung in one run and was
    answered wrong in the next, 2026-12-05), that it fails does not.
    """
    table = [row(o, deadline_s) for o in outcomes]
    problems, failures = [], []
    for o in outcomes:
        for p in (hostile_problem(o, deadline_s), victim_problem(o, deadline_s)):
            if p:
                problems.append(f"{o.case} via {o.entry}: {p}")
                failures.append(f"{o.case}@{o.entry}: {_short(p)}")
    after_problems = aftermath_problems(after)
    failures += [f"KV held on {n}" for n in after.held] if after.idle_s is None else []
    failures += [f"{n} unhealthy" for n, h in after.health.items() if h != "ok"]
    details: dict[str, Any] = {
        "table": table,
        "failures": sorted(set(failures)),
        "failed_cases": sorted({f.split(": ")[0] for f in failures}),
        "router_params": router_params(outcomes, deadline_s),
        "deadline_s": deadline_s,
        "idle_s": None if after.idle_s is None else round(after.idle_s, 2),
        "idle_bound_s": after.bound_s,
        "health_after": dict(after.health),
        "held": {n: dict(g) for n, g in after.held.items()},
    }
    sent = [o for o in outcomes if o.hostile is not None]
    unsent = [f"{o.case} via {o.entry}" for o in outcomes if o.hostile is None]
    if problems or after_problems:
        return CheckResult(NAME, FAIL, "; ".join(problems + after_problems), details)
    if not sent:
        return CheckResult(NAME, NOT_RUN, "no case could be sent: " + "; ".join(o.not_sent for o in outcomes))
    skipped = f"; not sent: {', '.join(unsent)} (reasons in the table)" if unsent else ""
    return CheckResult(
        NAME,
        PASS,
        f"{len(sent)} forged requests (router, decode, prefill): each refused with a 4xx or answered "
        f"right, every victim right, every process healthy and every instance idle "
        f"{after.idle_s or 0:.1f} s after; router {details['router_params']}{skipped}",
        details,
    )


# ---------------------------------------------------------------- sending (edge)

Params = Any  # what goes in kv_transfer_params: a dict, or something else on purpose


class Sender:
    """The requests of one run: each bounded by ``deadline_s``, with the pair's bootstrap facts
    (Mooncake's engine id) asked once, as the pair warm-up does (runtime/pairs.py)."""

    def __init__(self, plan: ClusterPlan, hops: Hops, deadline_s: float):
        self.plan, self.hops, self.deadline_s = plan, hops, deadline_s
        self.model = plan.served_model_name
        self.urls = {"router": plan.router.url, "decode": plan.decode[0].url, "prefill": plan.prefill[0].url}
        self.bootstrap = self.engine = None
        p0 = plan.prefill[0]
        if hops.bootstrap_query and hops.engine_id:
            self.bootstrap = f"http://{p0.host}:{p0.bootstrap_port}"
            query = f"{self.bootstrap}{hops.bootstrap_query}"
            try:
                self.engine = hops.engine_id(json.loads(http.get_text(query, timeout=deadline_s)))
            except ValueError as e:
                raise http.HttpError(query, str(e)) from None

    def post(
        self,
        entry: str,
        prompt: str,
        params: Params = None,
        *,
        tid: str | None = None,
    ) -> Sent:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "seed": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if params is not None:
            body["kv_transfer_params"] = params
        t0 = time.monotonic()
        headers = {"X-Request-Id": tid} if tid else None
        try:
            resp = http.post_json(
                f"{self.urls[entry]}/v1/completions", body, timeout=self.deadline_s, headers=headers
            )
        except http.HttpError as e:
            took = time.monotonic() - t0
            if e.status is None:
                timed_out = "no answer within" in e.reason
                return Sent(None if timed_out else 0, took, e.reason[:300])
            return Sent(e.status, took, _message(e.reason))
        return Sent(200, time.monotonic() - t0, completion=Completion.from_response(resp))

    def prefill_hop(self, prompt: str, tid: str) -> tuple[Sent, dict[str, object] | None]:
        """A victim's prefill hop; the decode hop's parameters (None when the hop failed)."""
        sent = self._raw_prefill(prompt, tid, self.hops.prefill_params(tid))
        if not isinstance(sent, tuple):
            return sent, None
        s, answer = sent
        try:
            return s, self.hops.decode_params(tid, answer, self.bootstrap, self.engine)
        except ValueError as e:
            return Sent(s.status, s.seconds, f"the prefill's answer lacks the decode's parameters: {e}"), None

    def _raw_prefill(self, prompt: str, tid: str, params: Params) -> Sent | tuple[Sent, Mapping[str, Any]]:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": params,
        }
        t0 = time.monotonic()
        try:
            answer = http.post_json(
                f"{self.urls['prefill']}/v1/completions",
                body,
                timeout=self.deadline_s,
                headers={"X-Request-Id": tid},
            )
        except http.HttpError as e:
            return Sent(e.status, time.monotonic() - t0, e.reason[:300])
        return Sent(200, time.monotonic() - t0), answer


def _message(reason: str) -> str:
    """An HttpError's reason "HTTP 400: {body}" -> the body's message (answers.error_message)."""
    return error_message(
        reason.split(": ", 1)[1] if reason.startswith("HTTP ") and ": " in reason else reason
    )


def _tid() -> str:
    return f"pd-hostile-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Cannot:
    """A case the connector cannot express, and why."""

    why: str


def _bent(case: str, base: Mapping[str, object], cp: ClientParams) -> Params:
    """A decode hop's parameters bent for ``case`` (:class:`Cannot` when the connector cannot
    express it)."""
    if case == "unknown_engine":
        return {**base, cp.engine_key: NO_ENGINE}
    if case == "block_ids_out_of_range":
        if cp.block_key is None:
            return Cannot("the connector's decode hop names no block ids (the decode asks the prefill by id)")
        return {**base, cp.block_key: OUT_OF_RANGE}
    if case == "oversized":
        return {**base, cp.decode_id_key: "x" * OVERSIZED}
    if case == "not_an_object":
        return "not-an-object"
    if case == "wrong_types":
        return {**base, "do_remote_prefill": "yes", cp.engine_key: {"not": "a string"}, cp.decode_id_key: [1]}
    return dict(base)  # replayed


# A hostile request's prompt and its victim's share no words, so that an answer computed on the
# other's KV is far from its own (in margin mode too: prompts that differed only in their first word
# gave a hostile answer 1.02 nats off, at the margin's edge, 2026-12-05).
PROMPTS = {
    "hostile": "A cat sat on the warm windowsill and watched small birds flying south ({})",
    "victim": "Seven ships sailed past an old lighthouse before the winter storm arrived ({})",
}


def _prompt(case: str, entry: str, who: str) -> str:
    return PROMPTS[who].format(f"{case} via {entry}")


def decode_case(
    s: Sender, cp: ClientParams, case: str, entry: str, consumed: Mapping[str, object]
) -> Outcome:
    """One decode-hop case sent to ``entry`` (router or decode). ``consumed``: the parameters of a
    transfer already completed (the base every bent case starts from; ``replayed`` sends it as is).
    ``live_id`` makes its own victim: its prefill hop, the hostile request with the victim's
    parameters, then the victim's decode hop."""
    hp, vp = _prompt(case, entry, "hostile"), _prompt(case, entry, "victim")
    why = cp.why_not_sent(case, entry)
    if why:
        return Outcome(case, entry, not_sent=why)
    if case == "live_id":
        tid = _tid()
        first, params = s.prefill_hop(vp, tid)
        if params is None:
            return Outcome(
                case, entry, not_sent=f"the victim's prefill hop failed: HTTP {first.status} {first.error}"
            )
        hostile = s.post(entry, hp, params)
        victim = s.post("decode", vp, params, tid=tid)
        return Outcome(case, entry, hostile, victim, prompts=(hp, vp))
    bent = _bent(case, consumed, cp)
    if isinstance(bent, Cannot):
        return Outcome(case, entry, not_sent=bent.why)
    return Outcome(case, entry, s.post(entry, hp, bent), prompts=(hp, vp))


def prefill_case(s: Sender, cp: ClientParams, case: str) -> Outcome:
    """One prefill-hop case sent straight to prefill-0 (8 tokens, as a client would ask).
    ``live_id``: a victim's prefill hop, a hostile prefill request carrying the victim's transfer
    id, then the victim's decode hop; ``duplicate_own``: two requests at once with one fresh id,
    the second the first's victim."""
    entry = "prefill"
    hp, vp = _prompt(case, entry, "hostile"), _prompt(case, entry, "victim")
    why = cp.why_not_sent(case, entry)
    if why:
        return Outcome(case, entry, not_sent=why)
    key = cp.prefill_id_key
    if case in ("live_id", "duplicate_own", "oversized") and key is None:
        return Outcome(
            case, entry, not_sent="the connector's prefill hop names no transfer id (the prefill names it)"
        )
    base = dict(s.hops.prefill_params(_tid()))
    if case == "live_id":
        assert key is not None
        tid = _tid()
        first, params = s.prefill_hop(vp, tid)
        if params is None:
            return Outcome(
                case, entry, not_sent=f"the victim's prefill hop failed: HTTP {first.status} {first.error}"
            )
        hostile = s.post(entry, hp, {**base, key: tid})
        return Outcome(case, entry, hostile, s.post("decode", vp, params, tid=tid), prompts=(hp, vp))
    if case == "duplicate_own":
        assert key is not None
        same = {**base, key: _tid()}
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.submit(s.post, entry, hp, same), pool.submit(s.post, entry, vp, same)
            return Outcome(case, entry, a.result(), b.result(), prompts=(hp, vp))
    if case == "oversized":
        assert key is not None
        return Outcome(case, entry, s.post(entry, hp, {**base, key: "x" * OVERSIZED}), prompts=(hp, vp))
    if case == "not_an_object":
        return Outcome(case, entry, s.post(entry, hp, "not-an-object"), prompts=(hp, vp))
    wrong = {
        **base,
        "do_remote_decode": "yes",
        cp.engine_key: {"not": "a string"},
        key or cp.decode_id_key: [1],
    }
    return Outcome(case, entry, s.post(entry, hp, wrong), prompts=(hp, vp))


def send_all(s: Sender, cp: ClientParams, consumed: Mapping[str, object]) -> list[Outcome]:
    """Every case at every entry point, in the table's order: first every case through the router
    at once, then every case straight to decode-0 and prefill-0 at once (each bounded by the
    deadline, so each phase takes about one deadline when something hangs). The router's phase
    comes first on its own: a forged pull straight to a Mooncake decode can hold the prefill's
    sender for every pull after it, the router's included (seen once, 2026-12-05: every router
    case then hung), which would charge the router with what the direct cases did."""
    router: list[tuple[Callable[..., Outcome], tuple[Any, ...]]] = [
        (decode_case, (s, cp, c, "router", consumed)) for c in DECODE_CASES
    ]
    direct: list[tuple[Callable[..., Outcome], tuple[Any, ...]]] = [
        (decode_case, (s, cp, c, e, consumed))
        for e in ENTRIES
        if e not in ("router", "prefill")
        for c in DECODE_CASES
    ]
    direct += [(prefill_case, (s, cp, c)) for c in PREFILL_CASES]
    out: list[Outcome] = []
    for jobs in (router, direct):
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(f, *args) for f, args in jobs]
            out += [f.result() for f in futures]
    return out


def judged(s: Sender, j: parity.Judge, outcomes: Sequence[Outcome]) -> list[Outcome]:
    """Each 200 answer compared with prefill-0 served directly, in parity's mode."""
    p0 = s.plan.prefill[0]

    def wrong(sent: Sent | None, prompt: str) -> str | None:
        if sent is None or not sent.ok or sent.completion is None:
            return None
        c = sent.completion
        try:
            ref = parity.reference(j, p0.url, s.model, prompt, c, max_tokens=MAX_TOKENS, timeout=s.deadline_s)
        except ValueError as e:
            return f"could not be judged: {e}"
        r = parity.judge(j, [(prompt[:40], c, ref)], baseline=f"{p0.name} direct", max_tokens=MAX_TOKENS)
        return None if r.passed else r.message[:300]

    return [
        replace(o, hostile_wrong=wrong(o.hostile, o.prompts[0]), victim_wrong=wrong(o.victim, o.prompts[1]))
        for o in outcomes
    ]


def wait_idle(plan: ClusterPlan, bound_s: float) -> Aftermath:
    """Poll every instance's running/waiting/KV-usage gauges until all are 0 or ``bound_s``; then
    /health of every process."""
    names = (instances.RUNNING, instances.WAITING, instances.KV_USAGE)
    t0 = time.monotonic()
    held: dict[str, dict[str, float]] = {}
    while True:
        held = {}
        for spec in plan.instances:
            try:
                g = instances.scrape_gauges(spec, names)
            except http.HttpError as e:
                held[spec.name] = {f"unreachable ({e.reason[:60]})": 1.0}
                continue
            busy = {k: v for k, v in g.items() if v > 0}
            if busy:
                held[spec.name] = busy
        took = time.monotonic() - t0
        if not held or took >= bound_s:
            break
        time.sleep(IDLE_POLL_S)
    return Aftermath(instances.health(plan.processes), None if held else took, bound_s, held)


def run(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
    """Gatherer: one complete transfer over the pair's hops (the consumed parameters every bent case
    starts from, and the replay's victim), every case at once, the answers judged, then the wait
    for idle and /health."""
    plan = window.plan
    spec = connectors.get(plan.config.connector)
    if spec.client_params is None:
        return CheckResult(
            NAME,
            NOT_RUN,
            f"no client parameters known for {spec.title} (its spec's client_params): add them to its "
            "module in pd_sessions/core/connectors/",
        )
    deadline, bound = float(options["deadline_s"]), float(options["idle_s"])
    s = Sender(plan, spec.hops, deadline)
    tid, prompt = _tid(), _prompt("replayed", "decode", "victim")
    first, consumed = s.prefill_hop(prompt, tid)
    if consumed is None:
        return CheckResult(NAME, FAIL, f"could not run: a P/D transfer over the hops failed: {first.error}")
    victim = s.post("decode", prompt, consumed, tid=tid)
    outcomes = send_all(s, spec.client_params, consumed)
    # the replayed transfer's owner is the victim of both replays
    outcomes = [
        replace(o, victim=victim, prompts=(o.prompts[0], prompt))
        if o.case == "replayed" and o.hostile is not None
        else o
        for o in outcomes
    ]
    outcomes = judged(s, parity.Judge.for_config(plan.config), outcomes)
    return evaluate(outcomes, wait_idle(plan, bound), deadline_s=deadline)
