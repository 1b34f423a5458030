"""The KV digest: the vLLM-side observer (pd_sessions/vllm_side/kv_observer.py, inside the fault
connector), its side files (core/digest_records.py) and the kv_digest check's verdict
(checks/kv_digest.py).

The observer is driven on a fake connector base with real torch KV tensors (those tests are marked
procs: the unit venv has no torch): a "transfer" here is a copy of the prefill's blocks into the
decode's, and the fault injector's own zero and swap corrupt them, as on real vLLM
(tests/test_e2e_kv_digest.py runs it on real vLLM over both connectors).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from helpers.needs import needs

from pd_sessions.checks import kv_digest as check
from pd_sessions.core import check_registry, connectors, digest_records, faults
from pd_sessions.core.faults import Control
from pd_sessions.core.results import FAIL, NOT_RUN, PASS
from pd_sessions.vllm_side.fault_connector import FaultInjecting
from pd_sessions.vllm_side.kv_observer import SENDS_ATTR, block_sums

BLOCK, NUM_BLOCKS, LAYERS = 4, 12, ("model.layers.0.attn", "model.layers.1.attn")


class FakeResults:
    def __init__(self, finished):
        self.finished_recving = set(finished)
        self.failed_recving: set[str] = set()
        self.finished_sending: set[str] = set()


class FakeBase:
    """What the mixin calls on the wrapped connector."""

    def __init__(self, vllm_config, role, kv_cache_config):
        self.results = FakeResults(())

    def request_finished(self, request, block_ids):
        return True, None

    def request_finished_all_groups(self, request, block_ids):
        return True, None

    def build_connector_meta(self, scheduler_output):
        return SimpleNamespace(reqs_to_recv={})

    def bind_connector_metadata(self, metadata):
        pass

    def get_transfer_results(self, finished_req_ids):
        return self.results

    def register_kv_caches(self, kv_caches):
        pass


def make(tmp_path, side, *, wraps="NixlConnector", groups=1, control=""):
    cls = type("Fake", (FaultInjecting, FakeBase), {"_pd_wraps": wraps})
    settings = {
        "control": control,
        digest_records.SETTING: str(tmp_path / f"{side}-0{digest_records.SUFFIX}"),
    }
    ktc = SimpleNamespace(
        kv_connector_extra_config={faults.EXTRA_CONFIG_KEY: settings},
        is_kv_producer=side == "prefill",
        is_kv_consumer=side == "decode",
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=ktc,
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    cache_config = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[object()] * groups)
    conn = cls(vllm_config, SimpleNamespace(name="WORKER"), cache_config)
    torch = needs("torch")
    conn.register_kv_caches(
        {name: torch.randn(2, NUM_BLOCKS, BLOCK, 2, 8, dtype=torch.bfloat16) for name in LAYERS}
    )
    return conn


def prefill_sends(conn, reqs):
    """request_finished for each (req, blocks, tokens, transfer id), then the metadata bound."""
    for req, blocks, tokens, tid in reqs:
        request = SimpleNamespace(
            request_id=req, num_computed_tokens=tokens, kv_transfer_params={"transfer_id": tid}
        )
        conn.request_finished_all_groups(request, (list(blocks),))
    meta = conn.build_connector_meta(None)
    conn.bind_connector_metadata(meta)
    return meta


def transfer(p, d, src, dst):
    """What the connector does: the prefill's blocks ``src`` copied into the decode's ``dst``."""
    for layer in LAYERS:
        d._pd.kv_caches[layer][:, dst] = p._pd.kv_caches[layer][:, src]


def nixl_load(d, loads, finished):
    """Bind a NIXL-like load meta ({decode req: (prefill req, blocks, prefix hits)}), report
    ``finished`` done."""
    recv = {
        r: SimpleNamespace(
            local_block_ids=(list(b),), remote=SimpleNamespace(request_id=pr), local_num_computed_blocks=(k,)
        )
        for r, (pr, b, k) in loads.items()
    }
    d.bind_connector_metadata(SimpleNamespace(reqs_to_recv=recv))
    d.results = FakeResults(finished)
    d.get_transfer_results(set())


def records(tmp_path):
    return {
        p.name.removesuffix(digest_records.SUFFIX): digest_records.parse(p.read_text())
        for p in sorted(tmp_path.glob(f"*{digest_records.SUFFIX}"))
    }


def verdict(tmp_path, **kw):
    return check.evaluate(records(tmp_path), decodes=["decode-0"], router_requests=2, **kw)


def two_requests(tmp_path, *, control=""):
    """p1: 10 tokens in prefill blocks 1-3 (2 full); p2: 9 tokens in 4-6; moved to decode 7-9, 10, 11, 0."""
    p, d = make(tmp_path, "prefill"), make(tmp_path, "decode", control=control)
    prefill_sends(p, [("p1", [1, 2, 3], 10, "t1"), ("p2", [4, 5, 6], 9, "t2")])
    transfer(p, d, [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 0])
    return p, d


@pytest.mark.procs
def test_matching_digests_pass_partial_last_blocks_included(tmp_path):
    _, d = two_requests(tmp_path)
    nixl_load(d, {"d1": ("p1", [7, 8, 9], 0), "d2": ("p2", [10, 11, 0], 0)}, {"d1", "d2"})
    r = verdict(tmp_path)
    assert r.verdict == PASS, r.message
    assert (r.details["paired"], r.details["blocks_compared"], r.details["partial_compared"]) == (2, 6, 2)


@pytest.mark.procs
def test_a_changed_partial_last_block_fails(tmp_path):
    """On the CPU lane (block size 128) most prompts fill no block: the partial one is compared."""
    _, d = two_requests(tmp_path)
    d._pd.kv_caches[LAYERS[1]][0, 9, 1, 0, 0] += 1.0  # one value of p1's partial block, layer 1
    nixl_load(d, {"d1": ("p1", [7, 8, 9], 0), "d2": ("p2", [10, 11, 0], 0)}, {"d1", "d2"})
    r = verdict(tmp_path)
    assert r.verdict == FAIL and f"d1 layer {LAYERS[1]} block 2 (decode block 9" in r.message


@pytest.mark.procs
def test_a_zeroed_block_fails_naming_the_request_layer_and_block(tmp_path):
    control = tmp_path / "faults.json"
    control.write_text(Control(epoch="z", mode="zero", fraction=0.5).to_json())
    _, d = two_requests(tmp_path, control=str(control))
    nixl_load(d, {"d1": ("p1", [7, 8, 9], 0), "d2": ("p2", [10, 11, 0], 0)}, {"d1", "d2"})
    r = verdict(tmp_path)
    assert r.verdict == FAIL
    # the injector zeroes the second candidate (fraction 0.5): d2, its block 0 (decode block 10)
    assert "d2 layer model.layers.0.attn block 0 (decode block 10" in r.message
    assert [m["req"] for m in r.details["mismatches"]] == ["d2"]
    assert verdict(tmp_path, injected={"d2": "zero"}).verdict == PASS
    # the injector's word for a load whose blocks are intact: the digest missed it
    missed = verdict(tmp_path, injected={"d1": "zero", "d2": "zero"})
    assert missed.verdict == FAIL and "missed" in missed.message and missed.details["missed"] == ["d1"]


@pytest.mark.procs
def test_a_swapped_block_fails_and_with_the_injectors_word_the_corrupted_loads_are_the_ones_caught(
    tmp_path, capsys
):
    control = tmp_path / "faults.json"
    control.write_text(Control(epoch="s", mode="swap").to_json())
    _, d = two_requests(tmp_path, control=str(control))
    nixl_load(d, {"d1": ("p1", [7, 8, 9], 0), "d2": ("p2", [10, 11, 0], 0)}, {"d1", "d2"})
    injected = check.injected_requests([capsys.readouterr().err])
    assert injected == {"d1": "swap", "d2": "swap"}  # each took the other's blocks
    r = verdict(tmp_path)
    assert r.verdict == FAIL and r.details["requests_differ"] == 2
    caught = verdict(tmp_path, injected=injected)
    assert caught.verdict == PASS, caught.message
    assert caught.details["detection"] == {"swap": "2/2"} and caught.details["observer_s"] > 0


@pytest.mark.procs
def test_prefix_hits_on_the_decode_are_not_compared_and_tail_loads_align_with_the_end(tmp_path):
    _, d = two_requests(tmp_path)
    for layer in LAYERS:  # decode block 7 is a prefix-cache hit of its own: not loaded
        d._pd.kv_caches[layer][:, 7].zero_()
    nixl_load(d, {"d1": ("p1", [7, 8, 9], 1)}, {"d1"})
    r = verdict(tmp_path)
    assert r.verdict == PASS and r.details["blocks_compared"] == 2


def test_the_loaded_blocks_pair_with_the_end_of_the_prefills_list():
    # a "tail" connector lists only the loaded blocks: they align with the end of the prefill's
    send = {"kind": "send", "key": "t", "rank": 0, "listed": 3, "full": 2, "sums": {"l": [1, 2]}}
    load = {"kind": "load", "key": "t", "rank": 0, "align": "tail", "first": 0, "listed": 2, "blocks": [5, 6]}
    assert check._positions(send, dict(load)) == [(0, 1)]  # decode block 5 is the prefill's second
    wrong = check.pair({"p": [send], "d": [{**load, "sums": {"l": [9, 9]}}]})
    assert wrong.mismatches[0]["block"] == 1
    # NIXL, seen on real vLLM: a 514-token prompt in 5 prefill blocks; the decode lists 3, hit 2 in
    # its own cache and loads the last: it pairs with the prefill's last (partial) block
    send5 = {"kind": "send", "key": "k", "rank": 0, "listed": 5, "full": 4, "sums": {"l": [1, 2, 3, 4, 5]}}
    load1 = {"kind": "load", "key": "k", "rank": 0, "align": "all", "first": 2, "listed": 3, "blocks": [18]}
    assert check._positions(send5, load1) == [(0, 4)]


@pytest.mark.procs
def test_mooncake_pairs_by_transfer_id(tmp_path):
    p = make(tmp_path, "prefill", wraps="MooncakeConnector")
    d = make(tmp_path, "decode", wraps="MooncakeConnector")
    prefill_sends(p, [("p1", [1, 2, 3], 12, "tx-1")])
    transfer(p, d, [2, 3], [8, 9])  # the decode had block 1's prefix: it loads the tail only
    meta = SimpleNamespace(
        reqs_to_recv={"eng": {"d1": SimpleNamespace(local_block_ids=([8, 9],), transfer_id="tx-1")}}
    )
    d.bind_connector_metadata(meta)
    d.results = FakeResults({"d1"})
    d.get_transfer_results(set())
    r = verdict(tmp_path)
    assert r.verdict == PASS, r.message
    assert r.details["blocks_compared"] == 2


@pytest.mark.procs
def test_a_load_with_no_send_fails(tmp_path):
    d = make(tmp_path, "decode")
    nixl_load(d, {"d1": ("ghost", [7], 0)}, {"d1"})
    r = verdict(tmp_path)
    assert r.verdict == FAIL and "d1 on decode-0: no send digest" in r.message


def test_no_side_file_or_no_load_at_all_fails():
    assert check.evaluate({}, decodes=["decode-0"], router_requests=3).verdict == FAIL  # no side file
    none = check.evaluate({"decode-0": []}, decodes=["decode-0"], router_requests=3)
    assert none.verdict == FAIL and "saw nothing" in none.message


def test_layouts_that_differ_are_not_run():
    base = {"key": "k", "rank": 0, "method": "crc32", "layout": ["x"], "block_size": 4}
    send = {**base, "kind": "send", "world": 2, "listed": 1, "full": 1, "sums": {"l": [1]}}
    load = {**base, "kind": "load", "world": 1, "first": 0, "listed": 1, "blocks": [3], "sums": {"l": [1]}}
    r = check.evaluate({"prefill-0": [send], "decode-0": [load]}, decodes=["decode-0"], router_requests=1)
    assert r.verdict == NOT_RUN and "world: prefill 2, decode 1" in r.message
    assert r.inapplicable  # nothing to compare: it fails no config, even one requiring it


def test_one_odd_load_beside_a_corrupted_one_fails_and_is_never_not_applicable():
    """Not applicable only when the whole config's layouts differ: one load missing a layer (a
    connector inconsistent with itself) beside a corrupted load is a FAIL naming both, not a NOT
    RUN that fails no config; every load differing in a layer set too."""
    base = {"rank": 0, "method": "crc32", "layout": ["x"], "block_size": 4, "world": 1}
    sends = [
        {**base, "key": k, "kind": "send", "listed": 1, "full": 1, "sums": {"l0": [1], "l1": [2]}}
        for k in ("a", "b")
    ]
    corrupted = {**base, "key": "a", "req": "ra", "kind": "load", "first": 0, "listed": 1, "blocks": [3]}
    corrupted["sums"] = {"l0": [9], "l1": [2]}
    odd = {**base, "key": "b", "req": "rb", "kind": "load", "first": 0, "listed": 1, "blocks": [4]}
    odd["sums"] = {"l0": [1]}
    r = check.evaluate(
        {"prefill-0": sends, "decode-0": [corrupted, odd]}, decodes=["decode-0"], router_requests=2
    )
    assert r.verdict == FAIL and not r.inapplicable, r.message
    assert (
        "1 of 2 loads are laid out unlike their sends" in r.message
        and "1 compared load(s) differ" in r.message
    )
    layers = check.evaluate(
        {"prefill-0": sends[1:], "decode-0": [odd]}, decodes=["decode-0"], router_requests=1
    )
    assert layers.verdict == FAIL and "layers:" in layers.message
    healthy = {**corrupted, "sums": {"l0": [1], "l1": [2]}}
    some = check.evaluate(
        {
            "prefill-0": [sends[0], {**sends[1], "world": 2}],
            "decode-0": [healthy, {**odd, "sums": {"l0": [1], "l1": [2]}}],
        },
        decodes=["decode-0"],
        router_requests=2,
    )
    assert some.verdict == FAIL and "1 of 2 loads" in some.message  # one world differs, not the config's


def _config_of(r):
    """``r`` in a config of the CPU lane's defaults, each required (a sweep listing no checks)."""
    from pd_sessions.core.results import CheckResult as Result
    from pd_sessions.core.results import ConfigResult

    c = ConfigResult("1x1", "1xP(TP2) + 1xD(TP1)", "nixl", "cpu")
    c.checks = [Result("smoke", PASS, "fine"), r]
    c.decide(["smoke", "kv_digest"], required=check_registry.defaults("cpu"))
    return c


def test_a_layout_not_run_leaves_the_config_passing_and_shows_not_run_with_its_reason():
    base = {"key": "k", "rank": 0, "method": "crc32", "layout": ["x"], "block_size": 4}
    send = {**base, "kind": "send", "world": 2, "listed": 1, "full": 1, "sums": {"l": [1]}}
    load = {**base, "kind": "load", "world": 1, "first": 0, "listed": 1, "blocks": [3], "sums": {"l": [1]}}
    r = check.evaluate({"prefill-0": [send], "decode-0": [load]}, decodes=["decode-0"], router_requests=1)
    c = _config_of(r)
    assert "kv_digest" in check_registry.defaults("cpu") and c.outcome == "passed"
    assert c.label == "passed, 1 not run" and c.not_run == ["kv_digest"] and c.unmet == []
    assert c.to_dict()["checks"][1]["message"].startswith("prefill and decode lay their KV out differently")


def test_an_observer_that_should_have_digested_and_did_not_fails_a_default_config():
    said = {"kind": "unavailable", "reason": "no KV cache tensors registered with the connector"}
    r = check.evaluate(
        {"decode-0": [{**said, "inapplicable": False}]}, decodes=["decode-0"], router_requests=1
    )
    assert r.verdict == NOT_RUN and not r.inapplicable
    c = _config_of(r)
    assert c.outcome == "failed" and c.unmet_checks == ["kv_digest"]
    hybrid = {"kind": "unavailable", "reason": "a hybrid model: 2 KV cache groups", "inapplicable": True}
    mixed = check.evaluate(
        {"prefill-0": [hybrid], "decode-0": [said]}, decodes=["decode-0"], router_requests=1
    )
    assert mixed.verdict == NOT_RUN and not mixed.inapplicable  # one reason that fails is enough
    only = check.evaluate({"prefill-0": [hybrid]}, decodes=["decode-0"], router_requests=1)
    assert only.inapplicable and _config_of(only).outcome == "passed"


def test_a_digest_mismatch_fails_a_default_config():
    base = {"key": "k", "rank": 0, "method": "crc32", "layout": ["x"], "block_size": 4, "world": 1}
    send = {**base, "kind": "send", "listed": 1, "full": 1, "sums": {"l": [1]}}
    load = {**base, "kind": "load", "first": 0, "listed": 1, "blocks": [3], "sums": {"l": [2]}, "req": "d1"}
    r = check.evaluate({"prefill-0": [send], "decode-0": [load]}, decodes=["decode-0"], router_requests=1)
    assert r.verdict == FAIL and "d1 layer l block 0" in r.message
    assert _config_of(r).outcome == "failed"


@pytest.mark.procs
def test_an_observer_that_cannot_digest_is_not_run(tmp_path):
    d = make(tmp_path, "decode", groups=2)  # a hybrid model: two KV cache groups
    nixl_load(d, {"d1": ("p1", [7], 0)}, {"d1"})
    r = verdict(tmp_path)
    assert r.verdict == NOT_RUN and "hybrid model" in r.message and r.inapplicable


@pytest.mark.procs
def test_an_observer_that_should_digest_and_cannot_is_a_not_run_that_fails_its_config(tmp_path):
    """No dimension of the KV tensors has num_blocks: the observer says so, not as a layout it
    does not cover, and the check's NOT RUN then fails a config that requires it."""
    d = make(tmp_path, "decode")
    d._pd_cache_config = SimpleNamespace(num_blocks=999, kv_cache_groups=[object()])
    nixl_load(d, {"d1": ("p1", [7], 0)}, {"d1"})
    (said,) = [r for r in records(tmp_path)["decode-0"] if r["kind"] == "unavailable"]
    assert said["inapplicable"] is False and "num_blocks=999" in said["reason"]
    r = verdict(tmp_path)
    assert r.verdict == NOT_RUN and not r.inapplicable and _config_of(r).outcome == "failed"


@pytest.mark.procs
def test_block_sums_see_one_changed_byte_and_the_order_of_words():
    torch = needs("torch")
    t = torch.zeros(2, 3, 4, 8, dtype=torch.bfloat16)
    t[:, 1, 0, 0] = 1.0
    a, b, c = block_sums(t, 1, [0, 1, 2])
    assert a == c != b
    u = t.clone()
    u[:, 1, 0, 0], u[:, 1, 0, 1] = 0.0, 1.0  # the same values, moved
    assert block_sums(u, 1, [1]) != [b]


def test_without_the_digest_nothing_is_written_and_the_metadata_is_untouched(tmp_path):
    cls = type("Fake", (FaultInjecting, FakeBase), {"_pd_wraps": "NixlConnector"})
    ktc = SimpleNamespace(
        kv_connector_extra_config={faults.EXTRA_CONFIG_KEY: {"control": ""}},
        is_kv_producer=True,
        is_kv_consumer=False,
    )
    conn = cls(SimpleNamespace(kv_transfer_config=ktc), SimpleNamespace(name="SCHEDULER"), None)
    assert conn._pd_digest is None
    conn.request_finished(SimpleNamespace(request_id="r"), [1])
    assert not hasattr(conn.build_connector_meta(None), SENDS_ATTR)
    assert list(tmp_path.iterdir()) == []


def test_the_planner_wraps_the_connector_for_the_digest_and_the_check_reads_its_setting():
    from pd_sessions.core.config import ClusterConfig
    from pd_sessions.core.plan.instance import kv_transfer_config

    c = ClusterConfig(name="c", model="tiny-llama", connector="nixl")
    plain = kv_transfer_config(c, "decode", "cpu")
    assert "kv_connector_module_path" not in plain
    kv = kv_transfer_config(c, "decode", "cpu", digest="/r/c/decode-0.kv_digest.jsonl")
    assert kv["kv_connector_module_path"] == faults.CONNECTOR_MODULE
    got = faults.settings(kv["kv_connector_extra_config"])  # type: ignore[arg-type]
    assert got == {"control": "", "digest": "/r/c/decode-0.kv_digest.jsonl"}
    argv = ["x", "--kv-transfer-config", json.dumps(kv)]
    assert check.digest_settings(argv) == "/r/c/decode-0.kv_digest.jsonl"
    assert check.digest_settings(["x", "--kv-transfer-config", json.dumps(plain)]) is None


def test_kv_digest_is_registered_last_and_each_connector_says_how_sends_pair_with_loads():
    # last but the conservation invariant, which only judges the probes after every check, and
    # hostile_clients (its forged transfers, a consumed one read again among them, are no P/D request
    # to digest)
    assert check_registry.NAMES[-3:] == (check_registry.KV_DIGEST, "conservation", "hostile_clients")
    assert check_registry.BY_NAME["kv_digest"].gatherer == ("kv_digest", "run")
    for name in ("nixl", "mooncake"):
        assert connectors.get(name).send_layout is not None


@pytest.mark.procs
def test_the_gatherer_reads_each_instances_side_file_and_the_injectors_word(tmp_path, capsys):
    from pd_sessions.core.config import ClusterConfig
    from pd_sessions.core.plan.instance import kv_transfer_config

    control = tmp_path / "faults.json"
    control.write_text(Control(epoch="z", mode="zero").to_json())
    _, d = two_requests(tmp_path, control=str(control))
    nixl_load(d, {"d1": ("p1", [7, 8, 9], 0)}, {"d1"})
    (tmp_path / "decode-0.log").write_text(capsys.readouterr().err)  # the injector's lines
    c = ClusterConfig(name="c", model="tiny-llama", connector="nixl")

    def spec(name, digest=True):
        kv = kv_transfer_config(c, name.split("-")[0], "cpu", digest=digest_records.side_file(tmp_path, name))
        argv = ("python", "--kv-transfer-config", json.dumps(kv)) if digest else ("python",)
        return SimpleNamespace(name=name, argv=argv, node=None, log_name=f"{name}.log")

    def window(*specs, config=c):
        decode = [s for s in specs if s.name.startswith("decode")]
        plan = SimpleNamespace(config=config, instances=specs, decode=decode)
        return SimpleNamespace(plan=plan, cluster=SimpleNamespace(run_dir=tmp_path), router_requests=1)

    r = check.run(window(spec("prefill-0"), spec("decode-0")), {})
    assert r.verdict == PASS and r.details["detection"] == {"zero": "1/1"}, r.message
    unwrapped = check.run(window(spec("prefill-0"), spec("decode-0", digest=False)), {})
    assert unwrapped.verdict == NOT_RUN and unwrapped.message.startswith(
        "decode-0 run(s) no KV digest observer"
    )
    assert not unwrapped.inapplicable  # the observer should be there: a required check's NOT RUN fails


def test_a_config_the_digest_cannot_cover_runs_no_observer_and_is_not_run_inapplicable(tmp_path):
    """Known before launch (digest_records.not_covered): NIXL push (no send_layout) and a decode
    that loads no KV; the planner then wraps nothing for the digest, and the check says why."""
    from pd_sessions.core.config import ClusterConfig
    from pd_sessions.run.sweep_options import SweepOptions, kv_digest_dir

    opts = SweepOptions(platform="cpu", results_dir=tmp_path, selected_checks=("smoke", "kv_digest"))
    plain = ClusterConfig(name="c", model="tiny-llama", connector="nixl")
    assert kv_digest_dir(plain, opts) == str((tmp_path / "c").resolve())
    for config in (
        ClusterConfig(name="c", model="tiny-llama", connector="nixl_push"),
        ClusterConfig(name="c", model="tiny-llama", connector="mooncake", decode_kv_transfer=False),
    ):
        assert kv_digest_dir(config, opts) is None
        plan = SimpleNamespace(config=config, instances=(), decode=())
        w = SimpleNamespace(plan=plan, cluster=SimpleNamespace(run_dir=tmp_path), router_requests=1)
        r = check.run(w, {})  # type: ignore[arg-type]
        assert r.verdict == NOT_RUN and r.inapplicable, r.message
    assert connectors.get("nixl_push").send_layout is None  # when it gets one, this test changes
