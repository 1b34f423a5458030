"""Three verdicts (issue 40): PASS, FAIL and NOT RUN. A check that could not look is never a pass:
its config reads "passed, N not run" everywhere it is shown (the summary table, summary.json,
JUnit, the page, the Buildkite annotation), a sweep may require it (then its config fails), and
--strict fails every NOT RUN. Each case feeds the bad verdict and expects the config or the
reader to say so."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from pd_sessions.core.results import (
    FAIL,
    FAILED,
    NOT_RUN,
    PASS,
    PASSED,
    SCHEMA_VERSION,
    CheckResult,
    ConfigResult,
    inapplicable,
    unrun,
)
from pd_sessions.report import buildkite_annotation, html, writers

NETEM = "netem is absent from this kernel (tc: 'Specified qdisc kind is unknown')"
EXPECTED = ("smoke", "wire_delay")


def config(*checks: CheckResult, required=(), strict=False) -> ConfigResult:
    r = ConfigResult("1x1", "1xP(TP1) + 1xD(TP1)", "mooncake", "cpu")
    r.checks = list(checks)
    r.decide([c.name for c in checks], required=required, strict=strict)
    return r


def ok(name: str = "smoke") -> CheckResult:
    return CheckResult(name, PASS, "fine")


def test_a_check_that_could_not_run_is_not_run_never_pass():
    r = config(ok(), unrun("wire_delay", NETEM))
    assert r.outcome == PASSED and r.not_run == ["wire_delay"] and r.unmet == []
    assert r.label == "passed, 1 not run"
    assert r.to_dict()["not_run"] == ["wire_delay"] and r.to_dict()["schema"] == SCHEMA_VERSION == 4


def test_a_required_check_that_did_not_run_fails_the_config():
    r = config(ok(), unrun("wire_delay", NETEM), required=["wire_delay"])
    assert r.outcome == FAILED and r.label == FAILED
    assert r.unmet == [f"wire_delay is required by the sweep and did not run: {NETEM}"]


def test_strict_fails_every_not_run():
    r = config(ok(), unrun("wire_delay", NETEM), strict=True)
    assert r.outcome == FAILED and "NOT RUN under --strict" in r.unmet[0]


LAYOUT = "prefill and decode lay their KV out differently (world: prefill 2, decode 1)"


def test_an_inapplicable_not_run_leaves_a_requiring_config_passing_and_says_not_run():
    """A required check with nothing to judge in this config (its layout is outside what it
    compares) is NOT RUN with its reason, never PASS, and its config passes, still "1 not run"."""
    r = config(ok(), inapplicable("kv_digest", LAYOUT), required=["smoke", "kv_digest"])
    assert r.outcome == PASSED and r.label == "passed, 1 not run"
    assert r.not_run == ["kv_digest"] and r.unmet == [] and r.unmet_checks == []
    (_, digest) = r.to_dict()["checks"]
    assert digest["verdict"] == NOT_RUN and digest["message"] == LAYOUT and digest["inapplicable"] is True
    assert "inapplicable" not in r.to_dict()["checks"][0]  # said of NOT RUN checks only


def test_an_inapplicable_not_run_fails_under_strict_and_a_plain_one_fails_when_required():
    strict = config(ok(), inapplicable("kv_digest", LAYOUT), required=["kv_digest"], strict=True)
    assert strict.outcome == FAILED and "NOT RUN under --strict" in strict.unmet[0]
    plain = config(ok(), unrun("kv_digest", "decode-0 run(s) no KV digest observer"), required=["kv_digest"])
    assert plain.outcome == FAILED and plain.unmet_checks == ["kv_digest"]
    assert plain.to_dict()["checks"][1]["inapplicable"] is False


@pytest.mark.parametrize("verdict", [PASS, FAIL])
def test_only_a_not_run_can_be_inapplicable(verdict):
    with pytest.raises(ValueError, match="only a NOT RUN can be inapplicable"):
        CheckResult("kv_digest", verdict, "?", inapplicable=True)


def test_junit_shows_an_inapplicable_not_run_as_skipped_with_its_reason(tmp_path: Path):
    r = config(ok(), inapplicable("wire_delay", LAYOUT), required=["wire_delay"])
    cases = _junit(tmp_path, [r])
    skipped = cases["wire_delay"].find("skipped")
    assert skipped is not None and skipped.get("message") == f"not run: {LAYOUT}"
    assert cases["wire_delay"].find("failure") is None


def test_a_failing_check_fails_whatever_else_did_not_run():
    assert config(CheckResult("smoke", FAIL, "wrong"), unrun("wire_delay", NETEM)).outcome == FAILED


def test_every_check_passing_is_plain_passed():
    r = config(ok(), ok("wire_delay"))
    assert r.outcome == PASSED and r.label == PASSED and r.not_run == []


@pytest.mark.parametrize("verdict", ["skip", "xpass?", "", "PASS"])
def test_a_verdict_outside_the_three_is_refused(verdict):
    with pytest.raises(ValueError, match="is not one of"):
        CheckResult("smoke", verdict, "?")


def test_the_summary_table_and_json_say_not_run(tmp_path: Path):
    results = [config(ok(), unrun("wire_delay", NETEM))]
    text = writers.table(results)
    assert "PASSED, 1 NOT RUN" in text and "wire_delay:not-run" in text
    writers.write_summary(results, tmp_path, {"sweep": "s"})
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["passed"] is True and doc["not_run"] == 1 and doc["configs"][0]["not_run"] == ["wire_delay"]
    assert "PASSED, 1 NOT RUN" in (tmp_path / "summary.txt").read_text()


def _junit(tmp_path: Path, results: list[ConfigResult]) -> dict[str, ET.Element]:
    path = writers.write_junit(results, tmp_path / "junit.xml", suite="s", expected_checks=EXPECTED)
    return {c.get("name") or "": c for c in ET.parse(path).getroot().iter("testcase")}


def test_junit_shows_a_not_run_check_as_skipped_with_its_reason(tmp_path: Path):
    cases = _junit(tmp_path, [config(ok(), unrun("wire_delay", NETEM))])
    skipped = cases["wire_delay"].find("skipped")
    assert skipped is not None and skipped.get("message") == f"not run: {NETEM}"
    assert cases["wire_delay"].find("failure") is None and list(cases["smoke"]) == []


def test_junit_fails_a_required_check_that_did_not_run(tmp_path: Path):
    cases = _junit(tmp_path, [config(ok(), unrun("wire_delay", NETEM), required=["wire_delay"])])
    failure = cases["wire_delay"].find("failure")
    assert failure is not None and failure.get("type") == "RequiredNotRun"
    assert "required by the sweep" in (failure.get("message") or "")


def test_junit_reads_which_checks_are_unmet_from_the_config_not_from_the_wording(tmp_path: Path):
    """The writer matched ``unmet``'s sentences by a name prefix; it reads the config's
    structured record (ConfigResult.unmet_checks, set with ``unmet`` by decide) now, so a
    rewording of the sentence cannot turn a required check that did not run into a skip."""
    r = config(ok(), unrun("wire_delay", NETEM), required=["wire_delay"])
    assert r.unmet_checks == ["wire_delay"]
    r.unmet = [f"the sweep requires wire_delay, which did not run: {NETEM}"]
    failure = _junit(tmp_path, [r])["wire_delay"].find("failure")
    assert failure is not None and failure.get("type") == "RequiredNotRun"
    assert failure.get("message") == r.unmet[0]
    plain = config(ok(), unrun("wire_delay", NETEM))
    assert plain.unmet_checks == [] and _junit(tmp_path, [plain])["wire_delay"].find("skipped") is not None


def test_the_page_is_never_plain_green_with_a_not_run_check(tmp_path: Path):
    results = [config(ok(), unrun("wire_delay", NETEM))]
    writers.write_summary(results, tmp_path, {"sweep": "s", "checks": list(EXPECTED)})
    page = html.render(html.load(tmp_path), tmp_path)
    assert '<span class="badge partial" id="verdict">PASSED, 1 not run</span>' in page
    assert '<span class="badge partial">PASSED, 1 NOT RUN</span>' in page
    assert f'class="cell not-run" title="not run: {NETEM}' in page.replace("&#39;", "'")
    assert '<span class="badge not-run">NOT RUN</span>' in page


def test_the_page_names_why_a_config_failed_without_a_failing_check(tmp_path: Path):
    results = [config(ok(), unrun("wire_delay", NETEM), required=["wire_delay"])]
    writers.write_summary(results, tmp_path, {"sweep": "s", "checks": list(EXPECTED)})
    page = html.render(html.load(tmp_path), tmp_path)
    assert 'id="verdict">FAILED<' in page
    assert "Failed although no check failed: wire_delay is required" in page


def test_the_buildkite_annotation_says_not_run():
    text = buildkite_annotation.annotation([config(ok(), unrun("wire_delay", NETEM))], sweep="s", page=None)
    assert text.startswith("**s**: passed, 1 not run")
    assert buildkite_annotation.annotation([config(ok())], sweep="s", page=None).startswith("**s**: passed\n")
    assert NOT_RUN == "not run"


# ------------------------------------------------------------------ the sweep's declaration


def _sweep(tmp_path: Path, extra: str = ""):
    from pd_sessions.core.config import load_sweep

    p = tmp_path / "s.toml"
    p.write_text(f'name = "s"\n{extra}\n[defaults]\nmodel = "tiny-llama"\n[[config]]\nname = "1x1"\n')
    return load_sweep(p)


def test_a_sweep_requires_its_own_checks_unless_it_declares_others(tmp_path: Path):
    from pd_sessions.core import check_registry

    # every default but kv_capacity (NOT RUN where no instance shares prefill-0's TP) and
    # conservation (its parts a lane cannot measure are NOT RUN, said)
    defaults = tuple(c for c in check_registry.defaults("cpu") if c not in ("kv_capacity", "conservation"))
    assert _sweep(tmp_path).required_on("cpu") == defaults
    listed = _sweep(tmp_path, 'checks = ["smoke", "parity"]')
    assert listed.required_on("cpu") == ("smoke", "parity")
    declared = _sweep(tmp_path, 'checks = ["smoke", "parity"]\nrequired_checks = ["smoke"]')
    assert declared.required_on("cpu") == ("smoke",)
    assert _sweep(tmp_path, "required_checks = []").required_on("cpu") == ()


def test_an_unknown_required_check_is_refused_naming_the_field(tmp_path: Path):
    from pd_sessions.core.errors import ConfigError

    with pytest.raises(ConfigError, match="required_checks") as e:
        _sweep(tmp_path, 'required_checks = ["smok"]')
    assert "did you mean" in str(e.value)


def test_the_banner_says_which_not_run_fails(tmp_path: Path):
    from types import SimpleNamespace

    from pd_sessions.run.sweep_banner import required_line

    sel = SimpleNamespace(sweep=_sweep(tmp_path, 'checks = ["smoke"]'), platform="cpu")
    checks = ("smoke", "wire_delay")  # wire_delay added by --check: reported, not failed
    line = required_line(sel, SimpleNamespace(strict=False), checks)  # type: ignore[arg-type]
    assert line == "NOT RUN fails: smoke (the sweep's required checks); reported, not failed: wire_delay"
    strict = required_line(sel, SimpleNamespace(strict=True), checks)  # type: ignore[arg-type]
    assert strict == "NOT RUN fails: every check (--strict)"
