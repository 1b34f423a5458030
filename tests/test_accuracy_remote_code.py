"""lm_eval gets trust_remote_code=True exactly when the config trusts remote code."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from pd_sessions.checks import accuracy as acc
from pd_sessions.core.config import ClusterConfig


@pytest.mark.parametrize(
    "model, trust",
    [("tiny-llama", False), ("tiny-llama-remote", True), ("org/model", True), ("org/model", False)],
)
def test_accuracy_check_passes_the_configs_trust_to_lm_eval(monkeypatch, tmp_path, model, trust):
    calls = []

    def fake_run(**kw):  # stands in for lm_eval.simple_evaluate's caller: our own logic only
        calls.append(kw)
        args = acc.model_args(
            model=kw["model"],
            base_url=kw["base_url"],
            trust_remote_code=kw["trust_remote_code"],
            revision=kw["revision"],
        )
        kw["args"] = args
        return {
            "results": {kw["task"]: {"exact_match,strict-match": 0.5}},
            "n-samples": {kw["task"]: {"effective": 10}},
            "samples": {kw["task"]: []},
        }

    monkeypatch.setattr(acc, "run_lm_eval", fake_run)
    monkeypatch.setitem(sys.modules, "lm_eval", types.ModuleType("lm_eval"))
    cfg = ClusterConfig(
        name="c",
        model=model,
        trust_remote_code=trust,
        revision="abc" if trust and not model.startswith("tiny") else None,
    )
    spec = SimpleNamespace(name="prefill-0", url="http://p")
    plan = SimpleNamespace(
        config=cfg,
        served_model_name=model,
        model="/m",
        router=SimpleNamespace(url="http://r"),
        prefill=(spec,),
    )
    baselines = tmp_path / "baselines.toml"
    baselines.write_text('[[baseline]]\nmodel = "org/model"\ntask = "gsm8k"\nvalue = 0.5\nsamples = 10\n')
    acc.check(SimpleNamespace(plan=plan, run_dir=tmp_path), acc.AccuracyOptions(baselines=baselines))
    assert calls and all(c["trust_remote_code"] is trust for c in calls)
    assert all(("trust_remote_code=True" in c["args"]) is trust for c in calls)
