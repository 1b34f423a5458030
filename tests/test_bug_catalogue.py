"""The bug catalogue (pd_sessions/core/bug_catalogue.py, configs/bug_catalogue.toml), the recall
table (core/recall_table.py) fed bad cases, `pd-sessions recall --results` (run/recall.py), and
the drift between the catalogue and the check registry. Pure: results are written by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pd_sessions.core import bug_catalogue, check_registry, recall_table
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import ConfigError, UsageError
from pd_sessions.run import recall

ZERO = """
[[bug]]
id = "kv-zeroed"
title = "received KV blocks are zeros"
links = ["docs/failure-modes.md row 31"]
caught_by = ["burst"]
connectors = ["mooncake", "nixl"]
detection = "{detected}/{corrupted} detected"
[bug.injection]
how = "zeros"
check = "fault_zero"
"""
WEIGHTS = """
[[bug]]
id = "other-weights"
title = "another model"
links = ["https://github.com/x/y/issues/1"]
caught_by = ["parity", "kv_transfer"]
connectors = ["mooncake", "nixl"]
detection = "{message}"
[bug.injection]
how = "seed 1"
settings = { decode_weights_seed = 1 }
[bug.ci_not_run]
nixl = "one cluster more"
"""
PEER = """
[[bug]]
id = "peer-death"
title = "the prefill dies"
links = ["docs/failure-modes.md row 34"]
caught_by = ["fault_peer_death"]
connectors = ["mooncake", "nixl"]
detection = "{outcome}"
[bug.injection]
how = "SIGKILL"
check = "fault_peer_death"
"""


def catalogue(*entries: str, complete: bool = True) -> bug_catalogue.Catalogue:
    """A catalogue of ``entries``; ``complete``: every other injecting check declared no class
    (so that the table judges only the entries)."""
    text = "".join(entries)
    if complete:
        named = set(re.findall(r'check = "(\w+)"', text))
        for c in bug_catalogue.injecting_checks():
            text += "" if c in named else f'[[not_a_class]]\ncheck = "{c}"\nreason = "not under test"\n'
    return bug_catalogue.parse(text, "t.toml")


def check(name: str, verdict: str, message: str = "", **details) -> dict:
    return {"name": name, "verdict": verdict, "message": message, "details": details}


def result(
    connector: str, *checks: dict, injected: dict | None = None, source: str = "r"
) -> recall_table.Result:
    data = {"connector": connector, "checks": list(checks), "injected": injected or {}}
    return recall_table.Result(f"{source}/{connector}/result.json", data)


def zero_caught(connector: str, detected: int = 32) -> recall_table.Result:
    return result(connector, check("fault_zero", "pass", "caught", detected=detected, corrupted=32))


# ---------------------------------------------------------------- the loader


def test_the_shipped_catalogue_loads_every_class_injected_today():
    c = bug_catalogue.load()
    assert set(c.ids()) >= {
        "other-weights", "silent-recompute", "kv-load-dropped", "kv-zeroed", "kv-swapped",
        "kv-stalled-abort", "peer-death", "restart-in-place", "wire-loss", "wire-partition",
        "wire-bandwidth-cap",
    }  # fmt: skip
    swapped = next(b for b in c.bugs if b.id == "kv-swapped")
    assert "https://github.com/vllm-project/vllm/issues/52234" in swapped.links
    assert swapped.injection.check == "fault_swap" and swapped.expected(ci=True) == ("mooncake", "nixl")
    peer = next(b for b in c.bugs if b.id == "peer-death")
    assert peer.expected(ci=True) == ("nixl",) and peer.expected(ci=False) == ("mooncake", "nixl")


def test_the_docs_rows_a_class_links_exist():
    root = Path(__file__).resolve().parent.parent
    for bug in bug_catalogue.load().bugs:
        for link in bug.links:
            if link.startswith("docs/"):
                page, _, row = link.partition(" row ")
                text = (root / page).read_text()
                assert f"\n| {row} |" in text, f"{bug.id}: {link}: no row {row} in {page}"


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        (('id = "kv-zeroed"', 'id = "Kv Zeroed"'), "id", "lower-case"),
        (('caught_by = ["burst"]', 'caught_by = ["brust"]'), "caught_by", 'did you mean "burst"'),
        (
            ('connectors = ["mooncake", "nixl"]', 'connectors = ["mooncake"]'),
            "not_run_reason",
            "nixl left out",
        ),
        (
            ('connectors = ["mooncake", "nixl"]', 'connectors = ["mooncake", "lmcache"]'),
            "connectors",
            "unknown",
        ),
        (('check = "fault_zero"', 'check = "parity"'), "injection.check", "no injecting check"),
        (
            ('check = "fault_zero"', 'check = "fault_zero"\nsettings = { decode_kv_transfer = false }'),
            "injection",
            "exactly one of",
        ),
        (
            ('check = "fault_zero"', "settings = { decode_weights_seed = true }"),
            "injection.settings.decode_weights_seed",
            "must be a int",
        ),
        (
            ('check = "fault_zero"', "settings = { max_model_len = 8 }"),
            "injection.settings.max_model_len",
            "not a setting that injects",
        ),
        (('links = ["docs/failure-modes.md row 31"]', 'links = ["vllm#52234"]'), "links", "https://"),
        (('links = ["docs/failure-modes.md row 31"]', "links = []"), "links", "users' reports"),
        (
            ('detection = "{detected}/{corrupted} detected"', 'detection = "32/32"'),
            "detection",
            "from the results",
        ),
        (('title = "received KV blocks are zeros"', 'titel = "x"'), "titel", 'did you mean "title"'),
        (('how = "zeros"\n', ""), "how", "non-empty string"),
        (('[bug.injection]\nhow = "zeros"\ncheck = "fault_zero"\n', ""), "injection", "[bug.injection]"),
        (("", '[bug.ci_not_run]\nmooncake = "x"\nnixl = "y"\n'), "ci_not_run", "at least one connector"),
        (("", '[bug.ci_not_run]\nmoon = "x"\n'), "ci_not_run.moon", "unknown connector"),
    ],
)
def test_a_bad_entry_names_the_entry_the_field_and_the_fix(change, field, says):
    old, new = change
    text = ZERO.replace(old, new) if old else ZERO + new
    assert text != ZERO
    with pytest.raises(ConfigError) as e:
        catalogue(text)
    assert e.value.field == field, str(e.value)
    assert "kv-zeroed" in str(e.value.source) or field == "id", str(e.value)  # the entry, by id
    assert says in str(e.value), str(e.value)


def test_a_repeated_id_a_check_given_twice_and_an_empty_catalogue_are_refused():
    with pytest.raises(ConfigError, match="'kv-zeroed' appears twice"):
        catalogue(ZERO, ZERO)
    with pytest.raises(ConfigError, match="fault_zero injects more than one entry"):
        catalogue(ZERO, ZERO.replace('id = "kv-zeroed"', 'id = "kv-zeroed-2"'))
    with pytest.raises(ConfigError, match="no \\[\\[bug\\]\\] entry"):
        catalogue("")
    with pytest.raises(ConfigError, match="unknown top-level key"):
        catalogue(ZERO, "[[bugs]]\nid = 'x'\n")
    with pytest.raises(ConfigError, match="no injecting check"):
        catalogue(ZERO, '[[not_a_class]]\ncheck = "smoke"\nreason = "x"\n')


# ---------------------------------------------------------------- drift against the check registry


def test_every_injecting_check_of_the_registry_is_catalogued():
    """A new injection (a fault check, a wire fault) without a catalogue entry fails here."""
    assert bug_catalogue.uncatalogued(bug_catalogue.load()) == []


def test_a_new_injecting_check_without_an_entry_is_named(monkeypatch):
    monkeypatch.setattr(check_registry, "FAULTS", (*check_registry.FAULTS, "fault_new"))
    assert bug_catalogue.uncatalogued(bug_catalogue.load()) == ["fault_new"]
    t = recall_table.build(catalogue(ZERO, complete=False), [zero_caught("mooncake"), zero_caught("nixl")])
    assert not t.ok and any(p.startswith("fault_new: injects a fault but has no entry") for p in t.problems())


def test_every_check_the_catalogue_names_exists_in_the_registry():
    c = bug_catalogue.load()
    named = {b.injection.check for b in c.bugs if b.injection.check} | {n.check for n in c.not_classes}
    named |= {name for b in c.bugs for name in b.caught_by}
    assert named <= set(check_registry.NAMES), named - set(check_registry.NAMES)
    assert {b.injection.check for b in c.bugs if b.injection.check} <= set(bug_catalogue.injecting_checks())


# ---------------------------------------------------------------- the recall table


def test_caught_on_both_connectors_is_100_percent_with_the_detection_figure():
    t = recall_table.build(catalogue(ZERO), [zero_caught("mooncake"), zero_caught("nixl", 26)])
    assert t.ok and t.recall("nixl") == (1, 1) and t.problems() == []
    assert t.at("kv-zeroed", "nixl").detail == "26/32 detected"
    assert t.summary() == "recall PASS: mooncake 1/1 (100 %), nixl 1/1 (100 %)"


def test_a_missed_injection_fails_naming_the_class_and_the_connector():
    missed = result("nixl", check("fault_zero", "fail", "only 1/32 detected, 22 required"))
    t = recall_table.build(catalogue(ZERO), [zero_caught("mooncake"), missed])
    assert not t.ok and t.recall("nixl") == (0, 1) and t.recall("mooncake") == (1, 1)
    assert t.problems() == ["kv-zeroed on nixl: MISSED: fault_zero fail: only 1/32 detected, 22 required"]
    assert t.summary().startswith("recall FAIL")


def test_one_run_that_missed_it_is_a_miss_whatever_another_caught():
    missed = result("nixl", check("fault_zero", "xpass", "passed"), source="later")
    t = recall_table.build(catalogue(ZERO), [zero_caught("mooncake"), zero_caught("nixl"), missed])
    assert t.at("kv-zeroed", "nixl").status == recall_table.MISSED and not t.ok


def test_a_class_without_any_result_is_not_run_and_never_100_percent():
    t = recall_table.build(catalogue(ZERO, PEER), [zero_caught("mooncake"), zero_caught("nixl")])
    assert not t.ok and t.recall("mooncake") == (1, 2)
    cell = t.at("peer-death", "mooncake")
    assert cell.status == recall_table.UNRUN and "no result of fault_peer_death on mooncake" in cell.detail
    assert "peer-death on mooncake: NOT RUN" in t.problems()[0]
    # an empty run (no result at all) is no pass either
    assert not recall_table.build(catalogue(ZERO), []).ok


def test_a_check_that_could_not_look_is_not_run_with_its_reason():
    unrun = result("nixl", check("fault_zero", "not run", "the injector was not loaded"))
    t = recall_table.build(catalogue(ZERO), [zero_caught("mooncake"), unrun])
    assert t.at("kv-zeroed", "nixl").detail == "fault_zero not run: the injector was not loaded" and not t.ok


def test_xfail_counts_as_covered_through_its_known_issue_naming_it():
    known = {"id": "mooncake-dead-prefill-pull", "link": "https://github.com/vllm-project/vllm/issues/35943"}
    xf = result("mooncake", check("fault_peer_death", "xfail", "still broken upstream", known_issue=known))
    ok = result("nixl", check("fault_peer_death", "pass", "recomputed", outcome="correct"))
    t = recall_table.build(catalogue(PEER), [xf, ok])
    assert t.ok and t.recall("mooncake") == (1, 1)
    cell = t.at("peer-death", "mooncake")
    assert cell.status == recall_table.XFAILED
    assert (
        cell.detail
        == "known issue mooncake-dead-prefill-pull: https://github.com/vllm-project/vllm/issues/35943"
    )
    # an XFAIL that names no known issue is not covered
    bare = result("mooncake", check("fault_peer_death", "xfail", "?"))
    assert recall_table.build(catalogue(PEER), [bare, ok]).at("peer-death", "mooncake").status == "missed"


def test_a_class_injected_by_settings_is_caught_when_every_check_of_caught_by_fails():
    inj = {"decode_weights_seed": 1, "decode_kv_transfer": False}
    caught = result(
        "mooncake",
        check("smoke", "pass"),
        check("parity", "fail", "4/4 prompts diverge"),
        check("kv_transfer", "fail", "0 tokens"),
        injected=inj,
    )
    t = recall_table.build(catalogue(WEIGHTS), [caught], ci=True)
    assert t.ok and t.at("other-weights", "mooncake").detail == "4/4 prompts diverge"
    assert t.at("other-weights", "nixl").status == recall_table.OUT and t.recall("nixl") == (0, 0)
    # outside CI's scope nixl counts, and has no result
    assert not recall_table.build(catalogue(WEIGHTS), [caught]).ok
    # the same checks on a config that injects nothing say nothing of the class
    plain = result("mooncake", check("parity", "fail", "x"), check("kv_transfer", "fail", "y"))
    assert (
        recall_table.build(catalogue(WEIGHTS), [plain], ci=True).at("other-weights", "mooncake").status
        == "not run"
    )


def test_a_check_of_caught_by_that_passes_under_the_injection_is_a_miss():
    missed = result(
        "mooncake",
        check("parity", "pass", "4/4 identical"),
        check("kv_transfer", "fail"),
        injected={"decode_weights_seed": 1},
    )
    t = recall_table.build(catalogue(WEIGHTS), [missed], ci=True)
    assert t.problems() == [
        "other-weights on mooncake: MISSED: parity passed under the injection: 4/4 identical"
    ]
    lacking = result("mooncake", check("parity", "fail"), injected={"decode_weights_seed": 1})
    cell = recall_table.build(catalogue(WEIGHTS), [lacking], ci=True).at("other-weights", "mooncake")
    assert cell.status == "not run" and "kv_transfer did not run" in cell.detail


def test_an_xfail_of_caught_by_does_not_hide_a_later_check_that_passed():
    """Each check of caught_by is looked at: parity XFAIL (a known issue) then kv_transfer PASS
    under the injection is a miss, not the known issue's XFAIL."""
    known = {"known_issue": {"id": "mooncake-n-gt-1", "link": "https://github.com/x/y/issues/1"}}
    xfail_then_pass = result(
        "mooncake",
        check("parity", "xfail", "differs", **known),
        check("kv_transfer", "pass", "32 of 32 tokens"),
        injected={"decode_weights_seed": 1},
    )
    cell = recall_table.build(catalogue(WEIGHTS), [xfail_then_pass], ci=True).at("other-weights", "mooncake")
    assert cell.status == "missed" and "kv_transfer passed" in cell.detail
    xfail_then_fail = result(
        "mooncake",
        check("parity", "xfail", "differs", **known),
        check("kv_transfer", "fail", "0 tokens"),
        injected={"decode_weights_seed": 1},
    )
    cell = recall_table.build(catalogue(WEIGHTS), [xfail_then_fail], ci=True).at("other-weights", "mooncake")
    assert cell.status == "xfail" and "mooncake-n-gt-1" in cell.detail


def test_a_class_declared_out_on_every_connector_in_ci_is_refused_by_the_loader():
    """CI's scope: every class must be counted on a connector (the loader refuses the entry)."""
    with pytest.raises(ConfigError, match="at least one connector"):
        catalogue(WEIGHTS.replace('nixl = "one cluster more"', 'nixl = "a"\nmooncake = "b"'))


def test_the_detection_template_reads_nested_keys_list_items_and_says_what_is_missing():
    c = check("wire_loss", "pass", "m", counts={"failed clearly": 2}, rates=[{"percent": 2}])
    assert (
        recall_table.detection("{counts.failed clearly} {rates.0.percent} {nope} {message}", c) == "2 2 ? m"
    )


def test_the_markdown_and_json_carry_every_cell():
    t = recall_table.build(catalogue(ZERO, PEER), [zero_caught("mooncake")])
    md = t.markdown()
    assert "| kv-zeroed | **CAUGHT**: 32/32 detected | **NOT RUN**: no result" in md
    d = t.to_dict()
    assert d["ok"] is False and d["recall"]["mooncake"] == {"covered": 1, "counted": 2}
    assert len(d["cells"]) == 4 and len(d["problems"]) == 3


# ---------------------------------------------------------------- pd-sessions recall --results


def _write(dir_: Path, r: recall_table.Result) -> None:
    dir_.mkdir(parents=True)
    (dir_ / "result.json").write_text(json.dumps(r.data))


def test_recall_from_earlier_results_writes_the_table_and_exits_by_recall(tmp_path, capsys):
    _write(tmp_path / "a" / "mooncake", zero_caught("mooncake"))
    _write(tmp_path / "b" / "1x1", zero_caught("nixl"))
    out = tmp_path / "out"
    rc = recall.main(["--results", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)])
    table = json.loads((out / "recall.json").read_text())
    assert rc == (0 if table["ok"] else 1)
    assert table["cells"][0]["status"] == "not run"  # the shipped catalogue's first class: no result
    assert {c["status"] for c in table["cells"] if c["bug"] == "kv-zeroed"} == {"caught"} and rc == 1
    assert "| kv-zeroed | **CAUGHT**" in (out / "recall.md").read_text()
    assert "kv-zeroed" in capsys.readouterr().out


def test_every_class_a_check_injects_is_run_by_one_of_recalls_sweeps():
    """`nox -s recall` must run every injecting check the catalogue names: the faults sweep's own
    list, what recall adds to it, and the wire rehearsals (it once left fault_strand out)."""
    from pd_sessions.core import config as sweep_config

    faults = sweep_config.load("faults")
    ran = set(faults.checks_on("cpu")) | set(recall.FAULTS_EXTRA) | set(json.loads(recall.WIRE_CHECKS))
    wanted = {b.injection.check for b in bug_catalogue.load().bugs if b.injection.check}
    assert wanted <= ran, sorted(wanted - ran)
    argv = recall.sweep_argv("faults", Path("/r"), "cpu")
    assert ",".join(recall.FAULTS_EXTRA) in argv


def test_recall_refuses_a_results_folder_that_is_not_there(tmp_path):
    with pytest.raises(UsageError, match=r"--results: .* is not a folder"):
        recall.main(["--results", str(tmp_path / "nope")])


def test_recall_runs_a_sweep_per_injecting_run_each_in_its_own_folder(tmp_path):
    argv = recall.sweep_argv("hosts_mooncake", tmp_path, "cpu")
    assert argv[1:5] == ["-m", "pd_sessions", "sweep", "mooncake_sweep"]
    assert "--simulate-hosts" in argv and argv[-2:] == ["--results-dir", str(tmp_path / "hosts_mooncake")]
    # every check a sweep names, and every built-in sweep it runs, exists
    wire = {b.injection.check for b in bug_catalogue.load().bugs if b.injection.check in check_registry.WIRE}
    assert wire <= set(json.loads(recall.WIRE_CHECKS))
    assert set(json.loads(recall.WIRE_CHECKS)) <= set(check_registry.NAMES)


def test_a_config_records_the_settings_that_inject_a_fault():
    base = {"name": "1x1", "connector": "mooncake", "model": "tiny-llama"}
    assert ClusterConfig(**base).injected == {}
    faulty = ClusterConfig(
        **base,
        decode_weights_seed=1,
        decode_kv_transfer=False,
        decode_extra_args=("--enforce-eager", "--num-gpu-blocks-override", "64"),
    )
    assert faulty.injected == {
        "decode_weights_seed": 1,
        "decode_kv_transfer": False,
        "decode_num_gpu_blocks_override": 64,
    }
    assert set(faulty.injected) == set(bug_catalogue.INJECTION_SETTINGS)
    # the = form, the last one given; an override on every instance (extra_args) is no injection
    eq = ClusterConfig(
        **base, decode_extra_args=("--num-gpu-blocks-override=8", "--num-gpu-blocks-override=9")
    )
    assert eq.injected == {"decode_num_gpu_blocks_override": 9}
    assert ClusterConfig(**base, extra_args=("--num-gpu-blocks-override", "64")).injected == {}


def test_kv_capacity_loss_is_caught_where_kv_capacity_fails_under_a_capped_decode():
    capped = {"decode_num_gpu_blocks_override": 64}
    caught = result("mooncake", check("kv_capacity", "fail", "decode-0 holds 1.6 % of prefill-0's KV"),
                    injected=capped)  # fmt: skip
    t = recall_table.build(bug_catalogue.load(), [caught], ci=True)
    assert t.at("kv-capacity-loss", "mooncake").status == "caught"
    missed = result("mooncake", check("kv_capacity", "pass", "every instance holds 100 %"), injected=capped)
    t = recall_table.build(bug_catalogue.load(), [missed], ci=True)
    assert t.at("kv-capacity-loss", "mooncake").status == "missed"


def test_recall_without_results_runs_each_sweep_then_judges_what_they_wrote(tmp_path, monkeypatch, capsys):
    ran: list[list[str]] = []

    def fake_sweep(argv):
        ran.append(list(argv))
        out = Path(argv[argv.index("--results-dir") + 1])
        if out.name == "faults":  # this one wrote a result; the others failed before any
            _write(out / "nixl", zero_caught("nixl"))
        return 1

    monkeypatch.setattr(recall, "run_sweep", fake_sweep)
    assert recall.main(["--out", str(tmp_path), "--no-hosts"]) == 1
    assert [a[4] for a in ran] == ["faults", "recall_decode"]  # --no-hosts: no rehearsal
    table = json.loads((tmp_path / "recall.json").read_text())
    cells = {(c["bug"], c["connector"]): c["status"] for c in table["cells"]}
    assert cells[("kv-zeroed", "nixl")] == "caught" and cells[("kv-zeroed", "mooncake")] == "not run"
    assert "recall: faults exited 1" in capsys.readouterr().out


@pytest.mark.procs
def test_a_sweep_is_waited_for_and_its_exit_status_returned(python):
    assert recall.run_sweep([python, "-c", "raise SystemExit(3)"]) == 3


# A sweep stand-in: it starts a grandchild, names it, and both ignore SIGTERM (a teardown that hangs).
HANGING_SWEEP = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
g = subprocess.Popen([sys.executable, "-c", code])
open(sys.argv[1], "w").write(f"{os.getpid()} {g.pid}")
time.sleep(600)
"""


@pytest.mark.procs
def test_a_stopped_sweep_is_gone_with_everything_it_started(python, tmp_path):
    """Stopped while it runs, the sweep's whole group (a grandchild included) is gone when
    run_sweep gives the stop back, even though both ignore SIGTERM: SIGKILL after the grace."""
    import signal

    import psutil

    from pd_sessions.runtime import process

    named = tmp_path / "grandchild.pid"

    class Stop(Exception):
        pass

    def on_alarm(signum, frame):
        if named.exists() and named.read_text():
            signal.setitimer(signal.ITIMER_REAL, 0)  # once: the stop itself is not interrupted
            raise Stop

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.1, 0.1)
    try:
        with pytest.raises(Stop):
            recall.run_sweep([python, "-c", HANGING_SWEEP, str(named)], grace_s=0.5, kill_wait_s=30.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    for pid in map(int, named.read_text().split()):  # the sweep, its grandchild
        try:
            p = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        assert not process.alive(p), f"pid {pid} outlived the stop"
