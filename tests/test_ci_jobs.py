"""The Buildkite files are generated from the registry, valid, and only call nox sessions."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest
import yaml
from helpers import ROOT

from pd_sessions.report import buildkite_pipelines

SCHEMA = ROOT / "pd_sessions" / "data" / "buildkite-pipeline-schema.json"


@pytest.mark.parametrize(
    "rel,text", sorted(buildkite_pipelines.rendered().items()), ids=lambda x: str(x)[:40]
)
def test_committed_files_equal_the_registry(rel, text):
    path = ROOT / rel
    assert path.exists(), f"{rel} is missing: run `nox -s buildkite` and commit the result"
    assert path.read_text() == text, (
        f"{rel} drifted from pd_sessions/buildkite_pipelines.py: run `nox -s buildkite`"
    )


def test_no_stray_generated_files():
    generated = {str(p) for p in buildkite_pipelines.rendered()}
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / ".buildkite").rglob("*.y*ml")}
    assert on_disk == generated


def test_pipeline_validates_against_buildkite_schema():
    schema = json.loads(SCHEMA.read_text())
    doc = yaml.safe_load((ROOT / ".buildkite/pipeline.yml").read_text())
    jsonschema.validate(doc, schema)


def test_schema_rejects_a_broken_pipeline():
    schema = json.loads(SCHEMA.read_text())
    doc = buildkite_pipelines.pipeline()
    doc["steps"][0]["retry"] = {"automatic": [{"exit_status": -1, "limit": 99}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema)


def _commands():
    doc = yaml.safe_load((ROOT / ".buildkite/pipeline.yml").read_text())
    cmds = [s["command"] for s in doc["steps"]]
    for area in (ROOT / ".buildkite/test_areas").glob("*.yaml"):
        cmds += [c for s in yaml.safe_load(area.read_text())["steps"] for c in s["commands"]]
    return cmds


def _nox_lists(session: str) -> bool:
    """`nox --list --json -s NAME` lists NAME only if the noxfile defines it."""
    r = subprocess.run(
        [sys.executable, "-m", "nox", "--list", "--json", "-f", str(ROOT / "noxfile.py"), "-s", session],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    return r.returncode == 0 and session in {s["session"] for s in json.loads(r.stdout or "[]")}


@pytest.mark.procs
def test_every_command_is_one_nox_session_call_that_exists():
    names = set()
    for cmd in _commands():
        if cmd == buildkite_pipelines.IMAGE_NOX_INSTALL:  # test_areas: nox into vLLM's image, nothing else
            continue
        m = re.fullmatch(r"(?:nox|python3 -m nox --no-venv) -s (\w+)( -- .*)?", cmd)
        assert m, f"not a plain nox call: {cmd!r}"
        names.add(m.group(1))
    assert names == {"tests", "mooncake_sweep", "nixl_sweep", "kimi_linear_nightly"}
    for name in names:
        assert _nox_lists(name), f"a step names session {name!r}, which the noxfile lacks"
    assert not _nox_lists("no_such_session")


def test_gpu_steps_force_cuda_and_nightly_is_scheduled_soft_fail():
    for job in buildkite_pipelines.JOBS:
        assert ("--platform cuda" in job.command) == (job.gpus > 0)
    doc = buildkite_pipelines.pipeline()
    steps = {s["key"]: s for s in doc["steps"]}
    nightly = steps["kimi-linear-nixl-pd-nightly"]
    assert nightly["if"] == 'build.source == "schedule"' and nightly["soft_fail"] is True
    moon = steps["distributed-mooncakeconnector-pd-accuracy-4-gpus"]
    assert moon["agents"] == {"queue": "b200-k8s"} and moon["timeout_in_minutes"] == 10
    assert any("mooncake" in p for p in moon["if_changed"]) and "pd_sessions/**" in moon["if_changed"]
    for s in doc["steps"]:  # retries only for agent loss, never for test failures
        for rule in s["retry"]["automatic"]:
            assert rule.get("exit_status") == -1 or rule.get("signal_reason") == "agent_stop"
        assert s["artifact_paths"]


def test_test_areas_match_vllm_format():
    moon = buildkite_pipelines.test_area("disaggregated_mooncake")
    (step,) = moon["steps"]
    assert moon["group"] == "Disaggregated Mooncake" and moon["depends_on"] == ["image-build"]
    assert (step["device"], step["num_devices"], step["timeout_in_minutes"]) == ("b200-k8s", 4, 10)
    assert step["source_file_dependencies"] == ["vllm/distributed/kv_transfer/kv_connector/v1/mooncake/"]
    dis = buildkite_pipelines.test_area("disaggregated")
    kimi = next(s for s in dis["steps"] if "kimi" in s["key"])
    assert kimi["device"] == "h200" and kimi["num_devices"] == 4 and kimi["optional"] is True
    assert kimi["timeout_in_minutes"] == 60


def test_test_areas_run_the_images_vllm_and_the_pipeline_installs_its_own():
    """vLLM's CI tests the pull request's image: its steps must not build a venv from the index."""
    for name in ("disaggregated", "disaggregated_mooncake"):
        for step in buildkite_pipelines.test_area(name)["steps"]:
            install, run = step["commands"]
            assert install == buildkite_pipelines.IMAGE_NOX_INSTALL
            assert run.startswith("python3 -m nox --no-venv -s ") and "--platform cuda" in run
    for step in buildkite_pipelines.pipeline()["steps"]:
        assert step["command"].startswith("nox -s ") and "--no-venv" not in step["command"]


def test_each_step_uploads_its_results_once():
    """The standalone pipeline uploads through artifact_paths; vLLM's test_areas format has none,
    so those steps ask the sweep to upload (--upload-artifacts); never both."""
    jobs = {j.key: j for j in buildkite_pipelines.JOBS}
    for step in buildkite_pipelines.pipeline()["steps"]:
        assert step["artifact_paths"] == [f"{jobs[step['key']].results_dir}/**/*"]
        assert "--upload-artifacts" not in step["command"]
    for name in ("disaggregated", "disaggregated_mooncake"):
        for step in buildkite_pipelines.test_area(name)["steps"]:
            assert "artifact_paths" not in step
            run = step["commands"][-1]
            assert run.endswith(f"--results-dir {jobs[step['key']].results_dir} --upload-artifacts")
    # the CPU lane's end-to-end runs (their report.html and screenshot) land in what it uploads
    cpu = next(s for s in buildkite_pipelines.pipeline()["steps"] if s["key"] == "cpu-lane")
    assert cpu["env"]["PD_SESSIONS_E2E_RESULTS"].startswith("results/cpu-lane/")


def test_test_areas_validate_against_the_buildkite_step_schema():
    """Each test_areas step, rendered as the Buildkite command step vLLM's CI turns it into
    (commands, label, key, timeout), is schema-valid, and so is the group."""
    schema = json.loads(SCHEMA.read_text())
    for name in ("disaggregated", "disaggregated_mooncake"):
        area = yaml.safe_load((ROOT / f".buildkite/test_areas/{name}.yaml").read_text())
        steps = [
            {
                "label": s["label"],
                "key": s["key"],
                "commands": s["commands"],
                "timeout_in_minutes": s["timeout_in_minutes"],
                **({"env": s["env"]} if "env" in s else {}),
            }
            for s in area["steps"]
        ]
        jsonschema.validate(
            {"steps": [{"group": area["group"], "depends_on": area["depends_on"], "steps": steps}]}, schema
        )
