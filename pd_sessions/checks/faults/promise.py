"""The promise under a fault, and what each scenario counts (pure).

Each request made under a fault is one :class:`Outcome`, of one kind:

| kind           | what the client saw |
| -------------- | ------------------- |
| correct        | HTTP 200, equal to the reference (layout-aware, as parity judges) |
| failed clearly | an HTTP error status (4xx/5xx) within the request bound |
| wrong          | HTTP 200 with other text than the reference |
| hung           | no answer within the request bound |
| broken         | the connection ended without an HTTP answer |

The promise: every request is correct or failed clearly. Afterwards the cluster recovers
(:class:`Recovery`): every process answers /health, no instance holds a request or KV blocks
(read as abort_frees_kv does), and a normal request through the router is correct.

Every scenario also proves that its fault fired (:class:`Proof`: the injector's counts, the
killed instance's processes gone, the kernel's counters on the KV path): :func:`proven` declares
a scenario's proofs on its ``evaluate``, and a fault that did not fire makes the scenario NOT RUN
("invalid"), never PASS (:func:`invalid`; the gatherers apply :func:`guard` to what they return).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec

from pd_sessions.core.results import FAIL, NOT_RUN, PASS, CheckResult, Table

P = ParamSpec("P")

CORRECT, FAILED_CLEARLY, WRONG, HUNG, BROKEN = "correct", "failed clearly", "wrong", "hung", "broken"
KINDS = (CORRECT, FAILED_CLEARLY, WRONG, HUNG, BROKEN)
KEPT = (CORRECT, FAILED_CLEARLY)  # the kinds that keep the promise
# How long a request may take before it counts as hung (the checks' request bound).
REQUEST_BOUND_S = 60.0


@dataclass(frozen=True)
class Outcome:
    """One request under a fault, as the client saw it."""

    label: str  # the prompt, shortened
    kind: str  # one of KINDS
    seconds: float
    status: int | None = None  # the HTTP status, when there was one
    detail: str = ""  # the text, or the error

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "kind": self.kind,
            "seconds": round(self.seconds, 3),
            "status": self.status,
            "detail": self.detail[:300],
        }


def classify(
    label: str,
    *,
    seconds: float,
    status: int | None,
    error: str | None = None,
    same: bool | None = None,
    text: str = "",
    bound_s: float = REQUEST_BOUND_S,
) -> Outcome:
    """One request's kind.

    an answer after bound_s, or "no answer within"   -> hung
    an error with an HTTP status >= 400               -> failed clearly
    an error without one (reset, closed)              -> broken
    HTTP 200, same as the reference                   -> correct
    HTTP 200, not the same (or not comparable: None)  -> wrong
    """
    if seconds > bound_s or (error is not None and "no answer within" in error):
        return Outcome(label, HUNG, seconds, status, error or text)
    if error is not None:
        kind = FAILED_CLEARLY if status is not None and status >= 400 else BROKEN
        return Outcome(label, kind, seconds, status, error)
    return Outcome(label, CORRECT if same else WRONG, seconds, status or 200, text)


def counts(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """kind -> how many, every kind present (0 when none)."""
    return {k: sum(1 for o in outcomes if o.kind == k) for k in KINDS}


def said(c: Mapping[str, int]) -> str:
    """'4 requests: 3 correct, 1 failed clearly, 0 wrong, 0 hung' (+ ', N broken' when any)."""
    n = sum(c.values())
    shown = [f"{c.get(k, 0)} {k}" for k in KINDS if k != BROKEN or c.get(BROKEN)]
    return f"{n} request{'s' if n != 1 else ''}: " + ", ".join(shown)


def broken_promise(outcomes: Sequence[Outcome]) -> str | None:
    """None when every request kept the promise, else which did not (the first three)."""
    bad = [o for o in outcomes if o.kind not in KEPT]
    if not bad:
        return None
    shown = "; ".join(
        f"{o.label!r}: {o.kind} after {o.seconds:.1f} s"
        + (f" (HTTP {o.status})" if o.status else "")
        + (f": {o.detail[:120]!r}" if o.detail else "")
        for o in bad[:3]
    )
    more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
    return (
        f"{len(bad)} request(s) broke the promise (a 200 with other text, a hang or no HTTP "
        f"answer): {shown}{more}"
    )


@dataclass(frozen=True)
class Recovery:
    """The cluster after a scenario: polled until it was whole again, or the bound ran out."""

    health: Mapping[str, str]  # process -> "ok" or why not
    held: Mapping[str, str | None]  # instance -> what it still held (None: idle)
    probe: Outcome | None  # a normal request through the router (None: not sent)
    seconds: float  # from the fault's end until whole again (or until the bound)
    bound_s: float
    down: Sequence[str] = field(default_factory=tuple)  # instances stopped on purpose
    # the probes sent before ``probe`` while the cluster came back, every one kept and judged: a
    # clear error is the promise kept while it recovers; a wrong, hung or broken one fails (a
    # wrong answer before a right one is a failure, not a retry)
    earlier: Sequence[Outcome] = field(default_factory=tuple)

    def problems(self) -> list[str]:
        """What is not whole again, each naming the instance and the value; and every probe that
        broke the promise on the way."""
        out = [f"{n}: /health {h}" for n, h in self.health.items() if h != "ok"]
        out += [f"{n}: {h}" for n, h in self.held.items() if h is not None]
        out += [
            f"probe {i + 1} through the router was {o.kind}"
            + (f" (HTTP {o.status})" if o.status else "")
            + (f": {o.detail[:120]!r}" if o.detail else "")
            + " before the last one"
            for i, o in enumerate(self.earlier)
            if o.kind not in KEPT
        ]
        if self.probe is not None and self.probe.kind != CORRECT:
            out.append(
                f"a normal request through the router: {self.probe.kind}"
                + (f" (HTTP {self.probe.status})" if self.probe.status else "")
                + (f": {self.probe.detail[:120]!r}" if self.probe.detail else "")
            )
        return out

    @property
    def ok(self) -> bool:
        return not self.problems()

    def line(self) -> str:
        if self.ok:
            probe = ", a normal request through the router correct" if self.probe else ""
            return (
                f"recovered in {self.seconds:.1f} s (every process healthy, no request running, "
                f"KV usage at idle{probe})"
            )
        return f"not recovered {self.bound_s:g} s after the fault: " + "; ".join(self.problems())

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "bound_s": self.bound_s,
            "health": dict(self.health),
            "held": dict(self.held),
            "probe": self.probe.to_dict() if self.probe else None,
            "earlier_probes": [o.to_dict() for o in self.earlier],
            "down": list(self.down),
        }


# The details key of a scenario's proofs (a list of Proof.to_dict()).
PROOF = "proof"


@dataclass(frozen=True)
class Proof:
    """What shows that a scenario's fault fired: ``what`` was read and showed ``value``;
    ``fired`` whether that value proves it (a fault that did not happen proves nothing)."""

    what: str  # "the injector's drop count"
    value: Any  # what it read: 0, "dropped 0, seen 12", ...
    fired: bool

    def said(self) -> str:
        return f"{self.what} read {self.value}"

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "value": self.value, "fired": self.fired}


def counted(what: str, value: int, *, want: int = 1) -> Proof:
    """A proof from a count: fired when ``value`` >= ``want``."""
    return Proof(what, value, value >= want)


def injector_count(injected: Mapping[str, int], mode: str, *, want: int = 1) -> Proof:
    """The injector's count of ``mode`` (applied, in this scenario's epoch, from the instance
    logs) as the proof: fired when >= ``want``."""
    return counted(f"the injector's {mode} count", int(injected.get(mode, 0)), want=want)


def invalid(result: CheckResult, proofs: Sequence[Proof]) -> CheckResult:
    """The rule of every fault scenario: ``result`` stands only when each of its ``proofs`` fired.

    a proof that did not fire, or none declared -> NOT RUN "invalid: the fault did not fire
                                                   (<what> read <value>)"; the verdict the
                                                   scenario reached without its fault is kept
                                                   (details "without_fault") and, a FAIL, said
    every proof fired                           -> ``result``, its proofs in details "proof"
    ``result`` already NOT RUN (it could not look) -> ``result``, as it is

    A sweep that requires the scenario (required_checks, or --strict) then fails the config
    (ConfigResult.decide): a fault that did not fire never makes a green run.
    """
    if result.not_run:
        return result
    details = {**result.details, PROOF: [p.to_dict() for p in proofs]}
    unfired = [p for p in proofs if not p.fired]
    if proofs and not unfired:
        result.details = details
        return result
    why = (
        "; ".join(p.said() for p in unfired)
        if unfired
        else "the scenario declared no proof that its fault fired"
    )
    saw = f"; without its fault the scenario saw: FAIL: {result.message[:300]}" if result.failed else ""
    details["without_fault"] = {"verdict": result.verdict, "message": result.message}
    return CheckResult(
        result.name,
        NOT_RUN,
        f"invalid: the fault did not fire ({why}){saw}",
        details,
        result.seconds,
        list(result.figures),
        list(result.tables),
        result.started_at,
    )


def proven(
    proofs: Callable[[Mapping[str, Any]], Sequence[Proof]],
) -> Callable[[Callable[P, CheckResult]], Callable[P, CheckResult]]:
    """Decorates a scenario's pure ``evaluate`` with the proofs that its fault fired, read by
    ``proofs`` from the result's details (as :func:`~pd_sessions.core.results.reporting` reads
    its numbers): every result it returns passes through :func:`invalid`."""

    def wrap(evaluate: Callable[P, CheckResult]) -> Callable[P, CheckResult]:
        @functools.wraps(evaluate)
        def evaluated(*args: P.args, **kwargs: P.kwargs) -> CheckResult:
            r = evaluate(*args, **kwargs)
            return invalid(r, proofs(r.details))

        return evaluated

    return wrap


def guard(result: CheckResult) -> CheckResult:
    """What a scenario's gatherer returns, held to the rule once more: a PASS or FAIL without
    proofs (an ``evaluate`` not :func:`proven`) or with one that did not fire is NOT RUN
    (:func:`invalid`); proofs recorded by :func:`invalid` are read back from the details."""
    if result.not_run:
        return result
    recorded = result.details.get(PROOF)
    proofs = [Proof(p["what"], p["value"], bool(p["fired"])) for p in recorded] if recorded else []
    return invalid(result, proofs)


def counts_table(c: Mapping[str, Any], title: str = "requests under the fault") -> Table:
    """How the requests ended, one column per kind (a missing count is 0)."""
    return Table(title, KINDS, (tuple(int(c.get(k, 0)) for k in KINDS),))


def not_passing(outcomes: Sequence[Outcome], why: str, *, shown: int = 3) -> str | None:
    """None when every request was correct, else how many were not, ``why`` they had to be,
    and the first ``shown`` of them (label, how it ended, its HTTP status)."""
    wrong = [o for o in outcomes if o.kind != CORRECT]
    if not wrong:
        return None
    return f"{len(wrong)} request(s) did not pass ({why}): " + "; ".join(
        f"{o.label!r}: {o.kind}" + (f" (HTTP {o.status})" if o.status else "") for o in wrong[:shown]
    )


def recovery_details(recovery: Recovery) -> dict[str, Any]:
    """A scenario's recovery in its details: the seconds, and the whole record."""
    return {"recovery_s": round(recovery.seconds, 3), "recovery": recovery.to_dict()}


def verdict(
    name: str,
    problems: Sequence[str | None],
    recovery: Recovery | None,
    details: Mapping[str, Any],
    *,
    failed: str,
    passed: Callable[[], str],
) -> CheckResult:
    """The promise's verdict of one scenario: FAIL with ``failed`` and every problem found
    (``problems``' non-None entries, then the recovery's when the cluster is not whole again),
    else PASS with ``passed()``."""
    found = [p for p in problems if p]
    if recovery is not None and not recovery.ok:
        found.append(recovery.line())
    if found:
        return CheckResult(name, FAIL, failed + "; ".join(found), dict(details))
    return CheckResult(name, PASS, passed(), dict(details))
