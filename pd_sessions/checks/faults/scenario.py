"""What every fault scenario does around its fault (edge): switch the injector through the
cluster's control file, send requests and judge them against a reference, count what the
injector did, and wait for the cluster to be whole again.

The control file is named in each instance's kv-transfer-config (the planner puts it there
when a fault scenario is selected): :func:`control_file` reads it from the plan, so a cluster
started without the injector is said, not guessed.
"""

from __future__ import annotations

import functools
import json
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_sessions.checks import instances, parity
from pd_sessions.checks.completions import Completion
from pd_sessions.checks.faults.promise import (
    CORRECT,
    KEPT,
    PROOF,
    REQUEST_BOUND_S,
    Outcome,
    Proof,
    Recovery,
    classify,
    guard,
)

# re-exported: the scenarios and their tests read them here
from pd_sessions.checks.kv_held import BLOCKS as BLOCKS
from pd_sessions.checks.kv_held import holds as holds
from pd_sessions.checks.kv_held import state as state
from pd_sessions.checks.window import CheckWindow
from pd_sessions.core import faults
from pd_sessions.core.errors import PdError, StopError
from pd_sessions.core.plan import ClusterPlan, ProcessSpec
from pd_sessions.core.results import FAIL, CheckResult, unrun
from pd_sessions.runtime import http

POLL_S = 0.2
# How long the cluster may take to be whole again after a scenario's fault ends.
RECOVER_S = 30.0


class NotWrapped(PdError):
    """The cluster's connectors are not wrapped by the fault injector: no scenario can run."""


Gatherer = Callable[[CheckWindow, Mapping[str, Any]], CheckResult]


def gatherer(name: str) -> Callable[[Gatherer], Gatherer]:
    """A scenario's gatherer, the rule every fault scenario runs under: what it returns must
    prove that its fault fired (promise.guard: each scenario's ``evaluate`` declares its proofs
    with promise.proven; a PASS or FAIL without them, or with one that did not fire, is NOT RUN
    "invalid"). Instead of raising (which would end the config) it fails on a cluster without
    the injector ("could not run": a config whose decode has no kv-transfer-config, say), and is
    NOT RUN "invalid" when an instance killed on purpose outlives its SIGKILL (the killed
    instance's processes gone is that fault's proof)."""

    def wrap(run: Gatherer) -> Gatherer:
        @functools.wraps(run)
        def gather(window: CheckWindow, options: Mapping[str, Any]) -> CheckResult:
            try:
                return guard(run(window, options))
            except NotWrapped as e:
                return CheckResult(name, FAIL, f"could not run: {e}")
            except StopError as e:
                return killed_undead(name, str(e))

        return gather

    return wrap


def killed_undead(name: str, survivors: str) -> CheckResult:
    """``name`` NOT RUN "invalid": the instance it killed on purpose did not die (``survivors``:
    StopError's words), so the death it was to judge never happened."""
    proof = Proof("the processes of the instance killed on purpose gone", survivors, False)
    return unrun(name, f"invalid: the fault did not fire ({proof.said()})", {PROOF: [proof.to_dict()]})


def control_file(plan: ClusterPlan) -> str:
    """The control file named in decode-0's kv-transfer-config; NotWrapped saying why not."""
    spec = plan.decode[0]
    argv = list(spec.argv)
    if "--kv-transfer-config" not in argv:
        raise NotWrapped(f"{spec.name} has no --kv-transfer-config: no KV connector to inject faults into")
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    got = faults.settings(kv.get("kv_connector_extra_config") or {})
    if kv.get("kv_connector_module_path") != faults.CONNECTOR_MODULE or not got or not got.get("control"):
        raise NotWrapped(
            f"{spec.name}'s connector is not wrapped by the fault injector (its kv-transfer-config has "
            f"no kv_connector_module_path {faults.CONNECTOR_MODULE!r}): the planner wraps it when a "
            "fault scenario is among the config's checks"
        )
    return str(got["control"])


@dataclass
class Answer:
    """One request's raw answer: the completion, or the error and its HTTP status."""

    prompt: str
    seconds: float
    completion: Completion | None = None
    status: int | None = None
    error: str | None = None


class Scenario:
    """One fault scenario on a window's cluster; ``name`` names it in the injector's epochs."""

    def __init__(self, window: CheckWindow, name: str, *, injector: bool = True):
        """``injector``: the scenario switches the fault injector (NotWrapped at once on a cluster
        without it); the wire faults (wire_*.py) need none."""
        self.window = window
        self.cluster = window.cluster
        self.plan: ClusterPlan = window.plan
        self.model = self.plan.served_model_name
        self.control_path = Path(control_file(self.plan)) if injector else Path()
        self.name = name
        self.epoch = f"{name}-{uuid.uuid4().hex[:8]}"
        self.judge = parity.Judge.for_config(self.plan.config)
        self.logs = {s.name: self.cluster.run_dir / s.log_name for s in self.plan.instances}
        self.offsets = {n: _size(p) for n, p in self.logs.items()}

    # ------------------------------------------------------------ the injector

    def inject(self, mode: str, **fields: Any) -> None:
        """Switch the injector to ``mode`` for this scenario's epoch (written whole, atomically)."""
        self._write(faults.Control(epoch=self.epoch, mode=mode, **fields))

    def off(self) -> None:
        self._write(faults.Control(epoch=f"{self.epoch}-off"))

    def _write(self, control: faults.Control) -> None:
        self.control_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.control_path.with_name(self.control_path.name + ".tmp")
        tmp.write_text(control.to_json() + "\n")
        os.replace(tmp, self.control_path)

    def injected(self, side: str | None = None) -> dict[str, int]:
        """What the injector says it did in this epoch (on ``side`` only, when given), from what
        every instance logged since the scenario began."""
        return faults.count_events(e for e in self.events() if side is None or e.get("side") == side)

    def requests_held(self, mode: str, side: str) -> int:
        """How many distinct requests the injector says it applied ``mode`` to on ``side`` in this
        epoch (each TP rank's worker logs its own line for the same request)."""
        return len({e.get("req") for e in self.events() if e.get("side") == side and e.get("mode") == mode
                    and e.get("applied", True)})  # fmt: skip

    def events(self) -> list[dict[str, Any]]:
        """The injector's events of this epoch (each instance's in order), from what every
        instance logged since the scenario began."""
        text = ""
        for n, path in self.logs.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[n])
                    text += f.read().decode("utf-8", errors="replace")
            except FileNotFoundError:
                continue
        return faults.parse_events(text, self.epoch)

    # ------------------------------------------------------------ requests

    def ask(self, url: str, prompt: str, *, max_tokens: int, bound_s: float = REQUEST_BOUND_S) -> Answer:
        t0 = time.monotonic()
        try:
            resp = http.completion(url, self.model, prompt, max_tokens=max_tokens, timeout=bound_s)
            return Answer(prompt, time.monotonic() - t0, Completion.from_response(resp))
        except http.HttpError as e:
            return Answer(prompt, time.monotonic() - t0, status=e.status, error=e.reason)

    def judged(self, a: Answer, *, reference: ProcessSpec, max_tokens: int, bound_s: float) -> Outcome:
        """``a`` as an Outcome: a 200 is compared with ``reference`` served directly (the parity
        check's judge: token for token, or within the margin where the layouts differ)."""
        same = None
        text = ""
        if a.completion is not None:
            text = a.completion.text
            try:
                ref = parity.reference(
                    self.judge,
                    reference.url,
                    self.model,
                    a.prompt,
                    a.completion,
                    max_tokens=max_tokens,
                    timeout=60.0,
                )
                same = parity.judge(
                    self.judge,
                    [(a.prompt, a.completion, ref)],
                    baseline=reference.name,
                    max_tokens=max_tokens,
                ).passed
            except (ValueError, http.HttpError) as e:
                text = f"{text!r} (not compared: {e})"
        return classify(
            a.prompt[:60],
            seconds=a.seconds,
            status=a.status,
            error=a.error,
            same=same,
            text=text,
            bound_s=bound_s,
        )

    # ------------------------------------------------------------ the cluster's state

    def live(self) -> list[ProcessSpec]:
        """The planned instances not stopped on purpose."""
        return [s for s in self.plan.instances if s.name not in self.cluster.down]

    def gauges(self, specs: Sequence[ProcessSpec] | None = None) -> dict[str, dict[str, float]]:
        """Each live instance's :func:`state` (or of ``specs``)."""
        return {
            s.name: state(http.get_text(f"{s.url}/metrics", timeout=5.0))
            for s in (specs if specs is not None else self.live())
        }

    def recover(
        self, idle: Mapping[str, Mapping[str, float]], *, probe: bool = True, bound_s: float = RECOVER_S
    ) -> Recovery:
        """Poll until every live process (the router too) answers /health, every live instance is idle again
        (no running or waiting request, KV usage at ``idle``) and, with ``probe``, a normal
        request through the router equals prefill-0 direct; or until ``bound_s``."""
        t0 = time.monotonic()
        n = 0
        probes: list[Outcome] = []  # every probe is kept and judged (Recovery.earlier)
        while True:
            specs = self.live()
            health = instances.health([*specs, self.plan.router])
            held: dict[str, str | None] = {}
            for s in specs:
                try:
                    held[s.name] = holds(idle.get(s.name, {}), self.gauges([s])[s.name])
                except http.HttpError as e:
                    held[s.name] = f"/metrics: {e.reason}"
            got = None
            if all(h == "ok" for h in health.values()) and all(h is None for h in held.values()) and probe:
                n += 1
                a = self.ask(
                    self.plan.router.url, f"Recovered after {self.name} ({n}): the kettle", max_tokens=8
                )
                got = self.judged(a, reference=self.plan.prefill[0], max_tokens=8, bound_s=REQUEST_BOUND_S)
                probes.append(got)
            waited = time.monotonic() - t0
            whole = all(h == "ok" for h in health.values()) and all(h is None for h in held.values())
            done = whole and (not probe or (got is not None and got.kind == CORRECT))
            # a probe that broke the promise (wrong, hung, broken) ends it: no retry undoes it
            broke = got is not None and got.kind not in KEPT
            if done or broke or waited >= bound_s:
                last = probes[-1] if probes else None
                earlier = tuple(probes[:-1])
                return Recovery(health, held, last, waited, bound_s, tuple(self.cluster.down), earlier)
            time.sleep(POLL_S)


def _size(path: Path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
