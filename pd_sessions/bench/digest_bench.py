"""The digest part: what the KV digest (the ``kv_digest`` check and its vLLM-side observer,
pd_sessions/vllm_side/kv_observer.py) costs a config. Pure, but for nothing: bench_command.py runs
the clusters, this module summarizes them, judges the goal and writes the section.

Each config of the sweep (the clusters part's, ``--sweep``; ``--only`` selects) runs ``--repeats``
times with the KV digest and as often without it, through pd_sessions' own sweep code, same
cluster settings and checks otherwise (without: ``kv_digest`` skipped, so no instance loads the
observer); the two alternate which goes first. Per run with the digest:

- ``digest_s``: the check's own wall time (reading the side files, pairing, comparing) plus the
  observer's (``observer_s``: the seconds every instance spent checksumming blocks, as the side
  files say; inside vLLM's steps, so an upper bound of what it adds to the requests);
- ``fraction``: ``digest_s`` over the run's wall time: the goal (:data:`DIGEST_GOAL`, judged on
  the median) is that the digest costs under 5 % of a config, the condition on which it is a
  default check (issue 41);
- ``per_request_ms``: the observer's seconds per load it digested (each P/D request: one send on
  the prefill, one load on the decode).

The difference of the checks phases (with - without) is shown beside it: what the digest adds to
the checks, measured as a difference of two runs (noisy on a shared host: it can even come out
negative); the goal stands on the direct measure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pd_sessions.bench.stats import Goal, summary

NAME = "kv_digest"
DIGEST_GOAL = 0.05  # of a config's wall time: under it, kv_digest is a default check (issue 41)


def record(checks: Sequence[Any]) -> dict[str, Any]:
    """The kv_digest figures of one run's checks (CheckResult or its dict), for the run record:
    its seconds, verdict, the observer's seconds and how many loads it digested; {} without it."""
    for c in checks:
        d = c if isinstance(c, dict) else c.to_dict()
        if d["name"] != NAME:
            continue
        det = d.get("details") or {}
        return {
            "seconds": d["seconds"],
            "verdict": d["verdict"],
            "observer_s": det.get("observer_s"),
            "loads": det.get("loads"),
            "blocks_compared": det.get("blocks_compared"),
        }
    return {}


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per config: the runs with and without the digest (``digest``: True/False in each record),
    their wall and checks times, the digest's own cost, its fraction and per-request figures.
    Only runs whose config passed count in the times (``ok`` says how many)."""
    out: dict[str, Any] = {}
    for config in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == config]
        on = [r for r in mine if r["digest"] and r["ok"] and r.get("kv_digest")]
        off = [r for r in mine if not r["digest"] and r["ok"]]
        cost = [r["kv_digest"]["seconds"] + (r["kv_digest"]["observer_s"] or 0.0) for r in on]
        per = [r for r in on if r["kv_digest"]["loads"]]
        with_checks, without_checks = (
            summary([r["checks_s"] for r in on]),
            summary([r["checks_s"] for r in off]),
        )
        diff = (
            None
            if with_checks["median"] is None or without_checks["median"] is None
            else round(with_checks["median"] - without_checks["median"], 3)
        )
        out[config] = {
            "connector": mine[0].get("connector"),
            "runs": {
                "with": len([r for r in mine if r["digest"]]),
                "without": len([r for r in mine if not r["digest"]]),
            },
            "ok": {"with": len(on), "without": len(off)},
            "verdicts": sorted({r["kv_digest"].get("verdict", "-") for r in mine if r.get("kv_digest")}),
            "wall_s": {
                "with": summary([r["wall_s"] for r in on]),
                "without": summary([r["wall_s"] for r in off]),
            },
            "checks_s": {"with": with_checks, "without": without_checks},
            "checks_diff_s": diff,
            "check_s": summary([r["kv_digest"]["seconds"] for r in on]),
            "observer_s": summary([r["kv_digest"]["observer_s"] or 0.0 for r in on]),
            "digest_s": summary(cost),
            "fraction": summary(
                [c / r["wall_s"] for c, r in zip(cost, on, strict=True) if r["wall_s"]], digits=5
            ),
            "loads": summary([r["kv_digest"]["loads"] or 0 for r in on]),
            "per_request_ms": summary(
                [1000.0 * (r["kv_digest"]["observer_s"] or 0.0) / r["kv_digest"]["loads"] for r in per]
            ),
        }
    return out


def goals(cost: dict[str, Any]) -> list[Goal]:
    """Per config: the digest's direct cost (check + observer) as a share of the config's wall."""
    return [
        Goal(
            f"{config} over {c['connector']}: the KV digest costs",
            DIGEST_GOAL,
            "fraction of wall time",
            c["fraction"]["median"],
            "(kv_digest's own seconds + its observer's in the instances) / the config's wall time, "
            "with the digest (pd_sessions driver); under it, kv_digest is a default check",
        )
        for config, c in cost.items()
    ]


def _fmt(s: dict[str, Any] | None, scale: float = 1.0, digits: int = 2) -> str:
    if not s or s.get("median") is None:
        return "-"
    f = lambda v: f"{v * scale:.{digits}f}"
    return f(s["median"]) if s["n"] == 1 else f"{f(s['median'])} ({f(s['min'])}-{f(s['max'])})"


def markdown(cost: dict[str, Any] | None) -> list[str]:
    """The section: one row per config, with and without the digest."""
    if not cost:
        return []
    lines = [
        "## What the KV digest costs a config (s, pd_sessions driver)",
        "",
        "Each config with the kv_digest check (its observer in every instance) and without it (skipped: "
        "no observer), same cluster settings and checks otherwise. The digest's cost is its check's "
        "own seconds plus its observer's (checksumming inside vLLM, from the side files); the "
        f"goal: under {DIGEST_GOAL * 100:g} % of the config's wall time (then kv_digest is a default "
        "check). The checks-phase difference (with - without) is a difference of two runs: noisy.",
        "",
        "| connector | config | ok with / without | kv_digest verdict | wall with | wall without "
        "| checks with | checks without | check | observer | **digest, % of wall** | loads "
        "| observer per load (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for config, c in cost.items():
        lines.append(
            f"| {c['connector']} | {config} | {c['ok']['with']}/{c['runs']['with']} / "
            f"{c['ok']['without']}/{c['runs']['without']} | {', '.join(c['verdicts']) or '-'} | "
            f"{_fmt(c['wall_s']['with'])} | {_fmt(c['wall_s']['without'])} | "
            f"{_fmt(c['checks_s']['with'])} | {_fmt(c['checks_s']['without'])} | "
            f"{_fmt(c['check_s'], digits=3)} | {_fmt(c['observer_s'], digits=3)} | "
            f"**{_fmt(c['digest_s'], digits=3)} s, {_fmt(c['fraction'], scale=100)} %** | "
            f"{_fmt(c['loads'], digits=0)} | {_fmt(c['per_request_ms'], digits=2)} |"
        )
    lines += [
        "",
        *[
            f"- {config}: checks phase with - without: {_v(c['checks_diff_s'])} s"
            for config, c in cost.items()
        ],
        "",
    ]
    return lines


def _v(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
