"""Benchmark results (pure, but for the chart and the files): summaries, goals, table, chart.

Input: the run records (``RunRecord.to_dict()``), the teardown and router parts
as measured. Output: ``results.json`` (everything, raw samples included),
``results.md`` (the tables) and ``phases.png`` (median phase times per config
and driver). Goals are judged on medians; the spread (min-max) is shown.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pd_sessions.bench import digest_bench, multihost, packing_bench
from pd_sessions.bench.page import PAGE_GOAL_BYTES, PAGE_GOAL_S
from pd_sessions.bench.stats import Goal, ratio, summary
from pd_sessions.core.check_registry import NAMES as CHECK_ORDER

PHASES = ("prepare", "instances", "router", "checks", "teardown")
OVERHEAD_PARTS = ("prepare", "noticing", "router", "teardown", "other")
DRIVER_LABEL = {
    "pd_sessions": "pd_sessions",
    "upstream": "upstream-style bash flow",
    "single": "one instance alone",
}
OVERHEAD_GOAL = 0.02
NOTICE_GOAL_S = 0.25
TEARDOWN_GOAL_S = 5.0
TEARDOWN_SLACK_S = 2.0
# The checks issue 17 added to every config's defaults, and what they ran on top of.
EDGE_CHECKS = ("cache_paths", "too_long", "burst", "abort_frees_kv")
BASE_CHECKS = ("smoke", "parity", "kv_transfer")
EDGE_CHECKS_GOAL_S = 15.0  # what the edge checks may add per config on the CPU lane
REQUEST_FEATURES_GOAL_S = 10.0  # what request_features may add per config on the CPU lane (issue 27)


def _ok(runs: Sequence[dict[str, Any]], driver: str, config: str) -> list[dict[str, Any]]:
    return [r for r in runs if r["driver"] == driver and r["config"] == config and r["ok"]]


def summarize_clusters(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per config: each driver's wall time, phases, overhead; parallel start; upstream ratio."""
    out: dict[str, Any] = {}
    for config in dict.fromkeys(r["config"] for r in runs):
        c: dict[str, Any] = {}
        for driver in ("pd_sessions", "upstream", "single"):
            ok = _ok(runs, driver, config)
            d: dict[str, Any] = {
                "runs": len([r for r in runs if r["driver"] == driver and r["config"] == config]),
                "ok": len(ok),
                "wall_s": summary([r["wall_s"] for r in ok]),
                "phases_s": {p: summary([r["phases"][p] for r in ok if p in r["phases"]]) for p in PHASES},
                "slowest_own_startup_s": summary(
                    [max(r["own_startup_s"].values()) for r in ok if r["own_startup_s"]]
                ),
                "noticed_s": summary([v for r in ok for v in r["noticed_s"].values()]),
            }
            if driver != "single":
                over = [r["overhead"] for r in ok if r["overhead"]]
                d["overhead_s"] = summary([o["overhead_s"] for o in over])
                d["overhead_fraction"] = summary([o["overhead_fraction"] for o in over], digits=4)
                d["overhead_parts_s"] = {
                    k: summary([o[f"{k}_s"] for o in over if f"{k}_s" in o]) for k in OVERHEAD_PARTS
                }
                parted = [o for o in over if "other_s" in o]
                own = [o["prepare_s"] + o["noticing_s"] + o["other_s"] for o in parted]
                d["own_code_s"] = summary(own)
                d["own_code_fraction"] = summary(
                    [v / o["wall_s"] for v, o in zip(own, parted, strict=True)], digits=4
                )
            c[driver] = d
        pair = c["pd_sessions"]["phases_s"]["instances"]["median"]
        single = c["single"]["phases_s"]["instances"]["median"]
        c["parallel_start"] = {
            "pair_ready_s": pair,
            "single_ready_s": single,
            "ratio": _round(ratio(pair, single)),
        }
        up, pd = c["upstream"]["wall_s"]["median"], c["pd_sessions"]["wall_s"]["median"]
        up_o, pd_o = c["upstream"]["overhead_s"]["median"], c["pd_sessions"]["overhead_s"]["median"]
        c["upstream_vs_pd_sessions"] = {
            "upstream_wall_s": up,
            "pd_sessions_wall_s": pd,
            "ratio": _round(ratio(up, pd)),
            # the same comparison without the instances' own startup (noisy on a shared VM)
            "upstream_overhead_s": up_o,
            "pd_sessions_overhead_s": pd_o,
            "overhead_ratio": _round(ratio(up_o, pd_o)),
            "saved_s": None if up_o is None or pd_o is None else round(up_o - pd_o, 2),
        }
        out[config] = c
    return out


def summarize_checks(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What each check costs, per sweep and config, from the pd_sessions driver's runs.

    Only runs that carry per-check times (``check_s``) count; a run whose config did not
    pass is counted in ``runs`` but left out of the times (a check that timed out would
    say nothing about what the checks cost). Per run, ``base_s`` sums the BASE_CHECKS
    that ran and ``edge_s`` the EDGE_CHECKS that ran; their medians are over runs.

    key ``SWEEP:CONFIG`` -> {sweep, config, connector, runs, ok, check_s: name -> summary,
                            base_s, edge_s (summaries), edge_checks (the ones that ran)}
    """
    out: dict[str, Any] = {}
    timed = [r for r in runs if r["driver"] == "pd_sessions" and "check_s" in r]
    for key in dict.fromkeys(f"{r.get('sweep', '-')}:{r['config']}" for r in timed):
        mine = [r for r in timed if f"{r.get('sweep', '-')}:{r['config']}" == key]
        ok = [r for r in mine if r["ok"]]
        names = [n for n in CHECK_ORDER if any(n in r["check_s"] for r in mine)]
        names += sorted({n for r in mine for n in r["check_s"]} - set(names))
        out[key] = {
            "sweep": mine[0].get("sweep"),
            "config": mine[0]["config"],
            "connector": mine[0].get("connector"),
            "runs": len(mine),
            "ok": len(ok),
            "check_s": {n: summary([r["check_s"][n] for r in ok if n in r["check_s"]]) for n in names},
            "base_s": summary([sum(r["check_s"].get(n, 0.0) for n in BASE_CHECKS) for r in ok]),
            "edge_s": summary([sum(r["check_s"].get(n, 0.0) for n in EDGE_CHECKS) for r in ok]),
            "edge_checks": [n for n in EDGE_CHECKS if n in names],
        }
    return out


def _round(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


def goals(doc: dict[str, Any]) -> list[Goal]:
    """The issue's goals, each judged on a median of this run's measurements."""
    return [
        *_cluster_goals(doc),
        *_check_goals(doc),
        *digest_bench.goals(doc.get("digest_cost") or {}),
        *_part_goals(doc),
    ]


def _cluster_goals(doc: dict[str, Any]) -> list[Goal]:
    """Per config of the clusters part: the harness's overhead, readiness noticed, teardown."""
    gs: list[Goal] = []
    for name, c in doc.get("clusters", {}).items():
        pd = c["pd_sessions"]
        gs.append(
            Goal(
                f"{name}: harness overhead",
                OVERHEAD_GOAL,
                "fraction of wall time",
                pd["overhead_fraction"]["median"],
                "(wall - slowest instance's own startup - checks) / wall",
            )
        )
        gs.append(
            Goal(
                f"{name}: readiness noticed after /health 200",
                NOTICE_GOAL_S,
                "s",
                pd["noticed_s"]["median"],
                "harness marks an instance ready minus its /health first 200 (prober)",
            )
        )
        gs.append(
            Goal(
                f"{name}: teardown, healthy cluster",
                TEARDOWN_GOAL_S,
                "s",
                pd["phases_s"]["teardown"]["median"],
                "router + instances stopped and every PID verified gone",
            )
        )
    return gs


def _check_goals(doc: dict[str, Any]) -> list[Goal]:
    """Per config whose checks were timed: what the edge checks add, then request_features."""
    gs: list[Goal] = []
    for c in doc.get("checks_cost", {}).values():
        gs.append(
            Goal(
                f"{c['config']} over {c['connector']}: the edge checks add",
                EDGE_CHECKS_GOAL_S,
                "s",
                c["edge_s"]["median"],
                f"wall time of {' + '.join(c['edge_checks']) or 'no edge check'} per config "
                "(pd_sessions driver), on top of " + " + ".join(BASE_CHECKS),
            )
        )
    for c in doc.get("checks_cost", {}).values():
        rf = c["check_s"].get("request_features")
        if rf:
            gs.append(
                Goal(
                    f"{c['config']} over {c['connector']}: request_features adds",
                    REQUEST_FEATURES_GOAL_S,
                    "s",
                    rf["median"],
                    "wall time of the request_features check per config (pd_sessions driver)",
                )
            )
    return gs


def _part_goals(doc: dict[str, Any]) -> list[Goal]:
    """The report page's cost and size, the packing ratio, teardown past the grace."""
    gs: list[Goal] = []
    rp = doc.get("report_page")
    if rp:
        gs.append(
            Goal(
                "report.html: rendering adds to a run",
                PAGE_GOAL_S,
                "s",
                rp["cold_s"]["median"],
                f"a fresh process imports the writer and Jinja2 and writes the page of {rp['configs']} "
                "configs (the first write of a run; later ones are the warm figure)",
            )
        )
        gs.append(
            Goal(
                f"report.html: size for {rp['configs']} configs",
                PAGE_GOAL_BYTES / 2**20,
                "MiB",
                rp["page_bytes"] / 2**20,
                "every config failed, so every log's tail is on the page (tails capped)",
            )
        )
    pk = doc.get("packing")
    if pk and pk["ratio"]["median"] is not None:
        gs.append(
            Goal(
                "packing: sweep wall, packed / one after another",
                packing_bench.RATIO_GOAL,
                "ratio",
                pk["ratio"]["median"],
                "the GPU sweep's default configs on a fake 8-GPU host (fake stack)",
            )
        )
    td = doc.get("teardown")
    if td:
        gs.append(
            Goal(
                "teardown, a child ignores SIGTERM",
                td["grace_s"] + TEARDOWN_SLACK_S,
                "s",
                td["ignores_sigterm"]["median"],
                f"grace {td['grace_s']:g} s + {TEARDOWN_SLACK_S:g} s; SIGKILL after the grace, verified gone",
            )
        )
    return gs


def _fmt(s: dict[str, Any] | None, unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
    """'median (min-max)' of a summary."""
    if not s or s.get("median") is None:
        return "-"
    f = lambda v: f"{v * scale:.{digits}f}"
    if s["n"] == 1:
        return f"{f(s['median'])}{unit}"
    return f"{f(s['median'])}{unit} ({f(s['min'])}-{f(s['max'])})"


def _v(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def markdown(doc: dict[str, Any]) -> str:
    """The whole results.md: a header, then each section that has data, in a fixed order."""
    lines = header_markdown(doc)
    lines += goals_markdown(doc.get("goals", []))
    for name, c in doc.get("clusters", {}).items():
        lines += cluster_markdown(name, c)
    lines += checks_markdown(doc.get("checks_cost", {}))
    lines += digest_bench.markdown(doc.get("digest_cost"))
    lines += startup_markdown(doc.get("startup"))
    lines += page_markdown(doc.get("report_page"))
    lines += multihost.markdown(doc.get("multihost"))
    lines += packing_bench.markdown(doc.get("packing"))
    lines += teardown_markdown(doc.get("teardown"))
    lines += router_markdown(doc.get("router"))
    lines += failed_markdown(doc.get("runs", []) + doc.get("check_runs", []))
    return "\n".join(lines)


def header_markdown(doc: dict[str, Any]) -> list[str]:
    """Title, the interrupted mark if any, the machine and the run's settings."""
    m = doc["machine"]
    st = doc["settings"]
    return [
        f"# pd-sessions benchmark ({doc['started_at']})",
        "",
        *(
            [f"**INTERRUPTED** ({doc['interrupted']}): partial results.", ""]
            if doc.get("interrupted")
            else []
        ),
        f"Machine: {m['cpu_model']}, {m['cores']} cores, {m['memory_gib']} GiB, "
        f"{m['platform']}, Python {m['python']}, lane **{st['platform']}**, "
        f"vLLM {m.get('vllm') or '-'}, vllm-router {m.get('vllm_router') or '-'}; "
        f"load average {m['load_before']} before, {m['load_after']} after. "
        f"Whole run: {doc['duration_s'] / 60:.1f} min.",
        "",
        f"Each value: median (min-max) of {st['repeats']} runs unless said otherwise. "
        f"Checks run per config: {', '.join(st['checks'])}.",
        "",
    ]


def goals_markdown(gs: Sequence[dict[str, Any]]) -> list[str]:
    """The goals table: limit, measured median, met (yes / no / - when not measured)."""
    if not gs:
        return []
    lines = ["## Goals", "", "| goal | limit | measured (median) | met |", "| --- | --- | --- | --- |"]
    for g in gs:
        lines.append(
            f"| {g['name']} | <= {_goal_limit(g)} | {_goal_measured(g)} | "
            f"{'yes' if g['met'] else 'no' if g['met'] is False else '-'} |"
        )
    lines.append("")
    return lines


def _goal_limit(g: dict[str, Any]) -> str:
    """A goal's limit: a percentage for a fraction, else in its unit."""
    return f"{g['limit'] * 100:g} %" if g["unit"].startswith("fraction") else f"{g['limit']:g} {g['unit']}"


def _goal_measured(g: dict[str, Any]) -> str:
    """A goal's measured median: '-' when not measured, a percentage for a fraction, else in its unit."""
    if g["measured"] is None:
        return "-"
    if g["unit"].startswith("fraction"):
        return f"{g['measured'] * 100:.2f} %"
    return f"{g['measured']:.3f} {g['unit']}"


def cluster_markdown(name: str, c: dict[str, Any]) -> list[str]:
    """One config's section: the phases table per driver, then the overhead and ratio notes."""
    lines = [
        f"## Config {name}: phases (s)",
        "",
        "| driver | ok | prepare | instances ready | router ready | checks | teardown "
        "| wall | slowest own startup | overhead | overhead % |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for driver in ("pd_sessions", "upstream", "single"):
        d = c[driver]
        ph = d["phases_s"]
        lines.append(
            f"| {DRIVER_LABEL[driver]} | {d['ok']}/{d['runs']} | "
            + " | ".join(_fmt(ph[p]) for p in PHASES)
            + f" | {_fmt(d['wall_s'])} | "
            f"{_fmt(d['slowest_own_startup_s'])} | {_fmt(d.get('overhead_s'))} | "
            f"{_fmt(d.get('overhead_fraction'), scale=100)} |"
        )
    lines.append("")
    return lines + _cluster_notes(c)


def _cluster_notes(c: dict[str, Any]) -> list[str]:
    """The bullets under a config's table: overhead by part, own code, noticing, the two ratios."""
    ps, uv = c["parallel_start"], c["upstream_vs_pd_sessions"]
    lines = []
    for driver in ("pd_sessions", "upstream"):
        parts = c[driver].get("overhead_parts_s", {})
        lines.append(
            f"- overhead of {DRIVER_LABEL[driver]}, by part (median s): "
            + ", ".join(f"{k} {_fmt(parts.get(k), digits=3)}" for k in OVERHEAD_PARTS)
        )
    own = c["pd_sessions"].get("own_code_s", {})
    lines.append(
        f"- of which pd_sessions' own code (prepare + noticing + other; the router part is "
        f"vllm-router's first look at its workers once let go (runtime/gate.py) and the first "
        f"P/D request, teardown is the processes' own exit after SIGTERM): {_fmt(own, ' s', digits=3)}, "
        f"{_fmt(c['pd_sessions'].get('own_code_fraction'), ' %', scale=100)} of wall"
    )
    return lines + [
        f"- readiness noticed after /health 200 (all instances, pd_sessions): "
        f"{_fmt(c['pd_sessions']['noticed_s'], ' s', digits=3)}; upstream's 1 s curl "
        f"loop: {_fmt(c['upstream']['noticed_s'], ' s', digits=3)}",
        f"- parallel start: pair ready {_v(ps['pair_ready_s'])} s / one instance alone "
        f"{_v(ps['single_ready_s'])} s = **{_v(ps['ratio'])}** (1.0: no cost for starting "
        f"them together; 2.0: as slow as one after the other)",
        f"- upstream-style flow / pd_sessions: wall time **{_v(uv['ratio'])}**; "
        f"overhead (what the driver adds) {_v(uv['upstream_overhead_s'])} s / "
        f"{_v(uv['pd_sessions_overhead_s'])} s = **{_v(uv['overhead_ratio'])}**, "
        f"{_v(uv['saved_s'])} s saved per config",
        "",
    ]


def teardown_markdown(td: dict[str, Any] | None) -> list[str]:
    """Teardown times on throwaway process trees: healthy, and with a child that ignores SIGTERM."""
    if not td:
        return []
    return [
        "## Teardown on throwaway process trees (s)",
        "",
        f"{td['what']}; grace {td['grace_s']:g} s.",
        "",
        f"- healthy: {_fmt(td['healthy'], digits=3)}",
        f"- a child ignores SIGTERM: {_fmt(td['ignores_sigterm'], digits=3)}",
        "",
    ]


def router_markdown(rb: dict[str, Any] | None) -> list[str]:
    """vllm-router against a minimal Python proxy: latency, added latency, throughput, errors."""
    if not rb:
        return []
    lines = [
        "## vllm-router vs a minimal Python proxy",
        "",
        f"Backends: {rb['backend']}. Hop: {rb['hop']}. max_tokens {rb['max_tokens']}. "
        f"Latency: all single requests of {rb['rounds']} rounds; throughput: median "
        f"(min-max) of the rounds at concurrency {rb['concurrency']}. Client, proxies and "
        "backends share this host's cores.",
        "",
        "| target | p50 ms | p99 ms | added p50 ms | added p99 ms | req/s at "
        f"{rb['concurrency']} concurrent | errors |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t, r in rb["targets"].items():
        lines.append(
            f"| {t} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
            f"{r.get('added_p50_ms', '-')} | {r.get('added_p99_ms', '-')} | "
            f"{_fmt(r['throughput_rps'], digits=0)} | {r['errors']} |"
        )
    lines.append("")
    return lines


def failed_markdown(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The runs that failed, each with its error: listed, since the medians leave them out."""
    failed = [r for r in runs if not r["ok"]]
    if not failed:
        return []
    lines = ["## Runs that failed (not in the medians)", ""]
    lines += [f"- {r['driver']} {r['config']} #{r['repeat']}: {r['error']}" for r in failed]
    lines.append("")
    return lines


def checks_markdown(cost: dict[str, Any]) -> list[str]:
    """The per-check table: one row per sweep and config, one column per check that ran."""
    if not cost:
        return []
    names = [n for n in CHECK_ORDER if any(n in c["check_s"] for c in cost.values())]
    names += sorted({n for c in cost.values() for n in c["check_s"]} - set(names))
    lines = [
        "## What each check costs (s, pd_sessions driver)",
        "",
        "Each check's own wall time as the runner timed it, per config; the edge checks ("
        + ", ".join(EDGE_CHECKS)
        + ") are what issue 17 added on top of "
        + ", ".join(BASE_CHECKS)
        + f" (goal: they add under {EDGE_CHECKS_GOAL_S:g} s per config on the CPU lane).",
        "",
        "| connector | config | ok | "
        + " | ".join(names)
        + " | "
        + " + ".join(BASE_CHECKS)
        + " | edge checks |",
        "| --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- | --- |",
    ]
    for c in cost.values():
        lines.append(
            f"| {c['connector']} | {c['config']} | {c['ok']}/{c['runs']} | "
            + " | ".join(_fmt(c["check_s"].get(n)) for n in names)
            + f" | {_fmt(c['base_s'])} | **{_fmt(c['edge_s'])}** |"
        )
    lines.append("")
    return lines


def page_markdown(rp: dict[str, Any] | None) -> list[str]:
    """What report.html costs: a cold write (fresh process), a warm one, its size."""
    if not rp:
        return []
    return [
        f"## report.html of {rp['configs']} configs (from {rp['source']})",
        "",
        "| first write, fresh process (s) | later writes (s) | size |",
        "| --- | --- | --- |",
        f"| **{_fmt(rp['cold_s'])}** | {_fmt(rp['warm_s'])} | **{rp['page_bytes'] / 1024:.0f} KiB** |",
        "",
    ]


def startup_markdown(su: dict[str, Any] | None) -> list[str]:
    """nox -> first instance spawned, venv rebuilt vs reused, with the milestones on the way."""
    if not su:
        return []
    lines = [
        "## Second-run start-up: `nox` to the first instance spawned (s)",
        "",
        f"`{su['command']}`: {su['what']}.",
        "",
        "Seconds after invoking nox at which each step began; the last column is the figure.",
        "",
        "| venv | ok | session | venv created / reused | import canary | sweep CLI "
        "| first instance spawned |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, label in (("rebuild", "rebuilt (--reuse-venv=never): before"), ("reuse", "reused: now")):
        m = su[mode]
        ms = m["milestones_s"]
        venv = ms.get("venv_created") or ms.get("venv_reused")
        lines.append(
            f"| {label} | {m['ok']}/{m['runs']} | {_fmt(ms.get('session'))} | {_fmt(venv)} | "
            f"{_fmt(ms.get('canary'))} | {_fmt(ms.get('cli'))} | **{_fmt(m['to_spawn_s'])}** |"
        )
    lines += [
        "",
        f"- a reused venv saves {_v(su['saved_s'])} s per call (rebuilt / reused = **{_v(su['ratio'])}**); "
        "(the venv step includes installing the lane; a reused venv's installs find everything in place)",
        "",
    ]
    bad = [r for r in su["runs"] if not r["ok"]]
    lines += [f"- FAILED {r['mode']} #{r['repeat']}: {r['error']}" for r in bad]
    return lines + ([""] if bad else [])


def chart(doc: dict[str, Any], path: Path) -> None:
    """Horizontal stacked bars: median phase times per config and driver."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        (f"{name}\n{DRIVER_LABEL[d]}", c[d]["phases_s"], c[d]["wall_s"]["median"])
        for name, c in doc.get("clusters", {}).items()
        for d in ("pd_sessions", "upstream", "single")
    ]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.9 * max(1, len(rows))))
    colors = dict(zip(PHASES, ("#9e9e9e", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"), strict=True))
    for i, (_label, phases, wall) in enumerate(rows):
        left = 0.0
        for p in PHASES:
            v = phases[p]["median"] or 0.0
            ax.barh(i, v, left=left, color=colors[p], label=p if i == 0 else None)
            left += v
        if wall:
            ax.text(left + 0.5, i, f"wall {wall:.1f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (medians)")
    ax.set_title(
        f"P/D cluster phases, {doc['settings']['platform']} lane, "
        f"{doc['machine']['cores']} cores ({doc['started_at'][:10]})"
    )
    ax.set_xlim(0, ax.get_xlim()[1] * 1.12)  # room for the wall-time labels
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(PHASES), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(doc: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    paths["json"].write_text(json.dumps(doc, indent=2) + "\n")
    paths["markdown"].write_text(markdown(doc) + "\n")
    if doc.get("clusters"):
        paths["chart"] = out_dir / "phases.png"
        chart(doc, paths["chart"])
    return paths


def rerender(results_json: Path) -> dict[str, Path]:
    """Summaries, goals, table and chart again from a results.json's raw samples."""
    doc = json.loads(results_json.read_text())
    if doc.get("runs"):
        doc["clusters"] = summarize_clusters(doc["runs"])
    if doc.get("runs") or doc.get("check_runs"):
        doc["checks_cost"] = summarize_checks(doc.get("runs", []) + doc.get("check_runs", []))
    if doc.get("digest_runs"):
        doc["digest_cost"] = digest_bench.summarize(doc["digest_runs"])
    doc["goals"] = [g.to_dict() for g in goals(doc)]
    return write(doc, results_json.parent)
