"""The fault-injecting connector (pd_sessions/vllm_side/fault_connector.py).

Its logic is driven here on a fake connector base (what vLLM's connector would do is not under
test: the e2e fault scenarios run it on real vLLM); the KV cache tensors are real torch tensors,
and the wrapping of vLLM's registered connectors uses the installed vLLM.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from helpers.needs import needs

from pd_sessions.core import faults
from pd_sessions.core.faults import Control
from pd_sessions.vllm_side import fault_connector
from pd_sessions.vllm_side.fault_connector import FaultInjecting


class FakeResults:
    def __init__(self, finished, failed=()):
        self.finished_recving = set(finished)
        self.failed_recving = set(failed)
        self.finished_sending: set[str] = set()


class FakeBase:
    """What the mixin calls on the wrapped connector, recorded."""

    def __init__(self, vllm_config, role, kv_cache_config):
        self.bound = []
        self.results = FakeResults(())
        self.registered = None
        self.matched = (7, True)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.matched

    def bind_connector_metadata(self, metadata):
        self.bound.append(metadata)

    def get_transfer_results(self, finished_req_ids):
        return self.results

    def get_block_ids_with_load_errors(self):
        return set(getattr(self, "own_errors", ()))

    def register_kv_caches(self, kv_caches):
        self.registered = kv_caches


def make(tmp_path, *, side="decode", wraps="NixlConnector", num_blocks=10, block_size=16):
    control = tmp_path / "faults.json"
    cls = type("Fake", (FaultInjecting, FakeBase), {"_pd_wraps": wraps})
    ktc = SimpleNamespace(
        kv_connector_extra_config={faults.EXTRA_CONFIG_KEY: {"control": str(control)}},
        is_kv_producer=side == "prefill",
        is_kv_consumer=side == "decode",
    )
    conn = cls(
        SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=block_size)),
        SimpleNamespace(name="WORKER"),
        SimpleNamespace(num_blocks=num_blocks),
    )
    return conn, control


def switch(path, **fields):
    tmp = path.with_name("c.tmp")
    tmp.write_text(Control(**fields).to_json())
    tmp.replace(path)  # the injector sees it on its next call (a new inode)


def events(capsys):
    return faults.parse_events(capsys.readouterr().err)


def nixl_meta(**reqs):
    return SimpleNamespace(
        reqs_to_recv={r: SimpleNamespace(local_block_ids=(list(b),)) for r, b in reqs.items()}
    )


def test_with_the_mode_off_every_call_is_the_wrapped_connectors(tmp_path, capsys):
    conn, _ = make(tmp_path)  # no control file at all: off
    meta = nixl_meta(r1=[1, 2])
    conn.bind_connector_metadata(meta)
    assert conn.bound == [meta]  # the very object, untouched
    conn.results = FakeResults({"r1"})
    assert conn.get_transfer_results(set()).failed_recving == set()
    assert conn.get_num_new_matched_tokens(SimpleNamespace(request_id="r1"), 0) == (7, True)
    assert "fault-injecting NixlConnector (decode worker" in capsys.readouterr().err


def test_drop_reports_the_selected_finished_loads_failed_and_says_so(tmp_path, capsys):
    conn, control = make(tmp_path)
    switch(control, epoch="e", mode="drop", fraction=0.5)
    conn.results = FakeResults({"a", "b", "c", "d"}, failed={"d"})  # d failed on its own
    got = conn.get_transfer_results(set())
    assert got.failed_recving == {"b", "d"}  # candidates a, b, c: the second of every two
    assert [(e["mode"], e["req"]) for e in events(capsys)] == [("drop", "b")]


def test_a_decode_stall_holds_a_load_back_and_hands_it_over_later(tmp_path, capsys):
    conn, control = make(tmp_path)
    switch(control, epoch="s", mode="stall", stall_s=0.3)
    first = nixl_meta(r1=[1, 2], r2=[])  # r2: an empty load (tells the prefill to free): never held
    conn.bind_connector_metadata(first)
    assert set(conn.bound[-1].reqs_to_recv) == {"r2"} and set(first.reqs_to_recv) == {"r1", "r2"}
    conn.bind_connector_metadata(nixl_meta())
    assert conn.bound[-1].reqs_to_recv == {}
    time.sleep(0.3)
    conn.bind_connector_metadata(nixl_meta(r3=[4]))
    # r1 comes back; r3 is the next candidate (every one is held at fraction 1)
    assert set(conn.bound[-1].reqs_to_recv) == {"r1"}
    assert [(e["mode"], e["req"], e["where"]) for e in events(capsys)] == [
        ("stall", "r1", "decode"),
        ("stall", "r3", "decode"),
    ]


def test_mooncake_loads_are_listed_per_remote_engine(tmp_path):
    conn, control = make(tmp_path, wraps="MooncakeConnector")
    switch(control, epoch="s", mode="stall", stall_s=60)
    meta = SimpleNamespace(
        reqs_to_recv={
            "eng": {"r1": SimpleNamespace(local_block_ids=[[3]]), "r2": SimpleNamespace(local_block_ids=[[]])}
        }
    )
    conn.bind_connector_metadata(meta)
    assert {e: set(r) for e, r in conn.bound[-1].reqs_to_recv.items()} == {"eng": {"r2"}}


def test_a_prefill_stall_answers_not_yet_until_it_ends(tmp_path, capsys):
    conn, control = make(tmp_path, side="prefill")
    switch(control, epoch="p", mode="stall", where="prefill", stall_s=0.3)
    req = SimpleNamespace(request_id="q1")
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
    switch(control, epoch="p-off")  # switching off does not cut a stall short
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
    time.sleep(0.3)
    assert conn.get_num_new_matched_tokens(req, 0) == (7, True)
    assert [(e["mode"], e["side"]) for e in events(capsys)] == [("stall", "prefill")]


def test_strand_keeps_finished_sends_from_the_prefills_scheduler_until_the_mode_goes_off(tmp_path, capsys):
    conn, control = make(tmp_path, side="prefill")
    switch(control, epoch="t", mode="strand", stall_s=3)
    conn.results = FakeResults(())
    conn.results.finished_sending = {"a", "b"}
    assert conn.get_transfer_results(set()).finished_sending == set()  # the blocks stay in use
    conn.results.finished_sending = set()
    assert conn.get_transfer_results(set()).finished_sending == set()
    switch(control, epoch="t-off")
    conn.results.finished_sending = {"c"}
    assert conn.get_transfer_results(set()).finished_sending == {"a", "b", "c"}  # handed back
    conn.results.finished_sending = set()
    assert conn.get_transfer_results(set()).finished_sending == set()  # once
    said = [(e["mode"], e["req"], e["epoch"], e["side"]) for e in events(capsys)]
    assert said == [
        ("strand", "a", "t", "prefill"),
        ("strand", "b", "t", "prefill"),
        ("release", "a", "t", "prefill"),
        ("release", "b", "t", "prefill"),
    ]


def test_strand_stalls_the_decodes_loads_so_that_clients_leave_first(tmp_path, capsys):
    conn, control = make(tmp_path)
    switch(control, epoch="t", mode="strand", stall_s=60)
    conn.bind_connector_metadata(nixl_meta(r1=[1]))
    assert conn.bound[-1].reqs_to_recv == {}
    conn.results = FakeResults({"r9"})
    conn.results.finished_sending = {"r8"}
    assert conn.get_transfer_results(set()).finished_sending == {"r8"}  # the decode keeps nothing
    assert [(e["mode"], e["where"]) for e in events(capsys)] == [("stall", "decode")]


def test_a_bad_control_file_turns_faults_off_and_says_why_once(tmp_path, capsys):
    conn, control = make(tmp_path)
    control.write_text('{"mode": "melt"}')
    conn.results = FakeResults({"a"})
    assert conn.get_transfer_results(set()).failed_recving == set()
    conn.get_transfer_results(set())
    err = capsys.readouterr().err
    assert err.count("not applied: mode: got 'melt'") == 1 and "faults off" in err


def _caches(torch, n_layers=2, num_blocks=10):
    # [2 (K, V), blocks, heads, tokens]: the block dimension is found by its size
    return {
        f"l{i}": torch.arange(2 * num_blocks * 3 * 4, dtype=torch.float32).reshape(2, num_blocks, 3, 4) + i
        for i in range(n_layers)
    }


@pytest.mark.procs
def test_zero_overwrites_the_chosen_blocks_of_each_load_and_nothing_else(tmp_path, capsys):
    torch = needs("torch")
    conn, control = make(tmp_path)
    caches = _caches(torch)
    before = {k: v.clone() for k, v in caches.items()}
    conn.register_kv_caches(caches)
    switch(control, epoch="z", mode="zero", blocks=0.5)
    conn.bind_connector_metadata(nixl_meta(r1=[2, 5, 7, 8]))
    conn.results = FakeResults({"r1"})
    conn.get_transfer_results(set())
    for k, t in caches.items():
        assert (t[:, [2, 5]] == 0).all()
        keep = [b for b in range(10) if b not in (2, 5)]
        assert torch.equal(t[:, keep], before[k][:, keep])
    assert [(e["mode"], e["req"], e["blocks"]) for e in events(capsys)] == [("zero", "r1", 2)]


@pytest.mark.procs
def test_swap_gives_each_load_the_blocks_of_another_request(tmp_path, capsys):
    torch = needs("torch")
    conn, control = make(tmp_path)
    caches = _caches(torch)
    before = {k: v.clone() for k, v in caches.items()}
    conn.register_kv_caches(caches)
    switch(control, epoch="w", mode="swap")
    conn.bind_connector_metadata(nixl_meta(a=[1], b=[4]))
    conn.results = FakeResults({"a", "b"})
    conn.get_transfer_results(set())
    for k, t in caches.items():  # a got b's block and b got a's (a batch swaps around)
        assert torch.equal(t[:, 1], before[k][:, 4]) and torch.equal(t[:, 4], before[k][:, 1])
    conn.bind_connector_metadata(nixl_meta(c=[6]))
    conn.results = FakeResults({"c"})
    conn.get_transfer_results(set())
    for k, t in caches.items():  # c, alone, gets the last donor's own (unswapped) blocks: b's
        assert torch.equal(t[:, 6], before[k][:, 4])
    assert [(e["req"], e["donor"]) for e in events(capsys)] == [("a", "b"), ("b", "a"), ("c", "b")]


@pytest.mark.procs
def test_a_lone_first_swap_has_no_donor_and_is_said_skipped(tmp_path, capsys):
    torch = needs("torch")
    conn, control = make(tmp_path)
    conn.register_kv_caches(_caches(torch))
    switch(control, epoch="w", mode="swap")
    conn.bind_connector_metadata(nixl_meta(a=[1]))
    conn.results = FakeResults({"a"})
    conn.get_transfer_results(set())
    assert faults.count_events(events(capsys)) == {"swap_skipped": 1}


def test_corruption_on_a_connector_of_unknown_layout_is_skipped_with_the_reason(tmp_path, capsys):
    conn, control = make(tmp_path, wraps="SomeOtherConnector")
    switch(control, epoch="z", mode="zero")
    conn.results = FakeResults({"a"})
    conn.get_transfer_results(set())
    (ev,) = events(capsys)
    assert ev["applied"] is False and "recv_layout" in ev["reason"]


def test_the_wrapper_of_a_registered_connector_keeps_its_name_and_its_class(monkeypatch):
    """vLLM's factory, given kv_connector_module_path, does getattr(module, kv_connector): the
    answer is a subclass of the class registered under that name (the e2e fault scenarios show
    vLLM creating it; importing vLLM here would cost a CI minute)."""
    registry = {"NixlConnector": FakeBase}

    def registered(name):
        if name not in registry:
            raise ValueError(f"Connector '{name}' is not registered.")
        return registry[name]

    monkeypatch.setattr(fault_connector, "_registered", registered)
    monkeypatch.setattr(fault_connector, "_classes", {})
    wrapped = fault_connector.NixlConnector
    assert (
        wrapped.__name__ == "NixlConnector" and wrapped.__module__ == "pd_sessions.vllm_side.fault_connector"
    )
    assert issubclass(wrapped, FakeBase) and issubclass(wrapped, FaultInjecting)
    assert getattr(fault_connector, "NixlConnector") is wrapped  # built once  # noqa: B009
    with pytest.raises(AttributeError, match="no KV connector 'NoSuchConnector' to wrap"):
        fault_connector.NoSuchConnector  # noqa: B018
    with pytest.raises(AttributeError):
        fault_connector.__wrapped__  # noqa: B018


@pytest.mark.procs
def test_mixup_gives_each_load_the_whole_kv_of_another_concurrent_request(tmp_path, capsys):
    """Every block of each load (not a share: ``blocks`` is ignored) becomes another's; loads
    finished together trade crosswise; one alone takes the last batch's."""
    torch = needs("torch")
    conn, control = make(tmp_path)
    caches = _caches(torch)
    before = {k: v.clone() for k, v in caches.items()}
    conn.register_kv_caches(caches)
    switch(control, epoch="m", mode="mixup", blocks=0.1)
    conn.bind_connector_metadata(nixl_meta(a=[1, 2], b=[4, 5]))
    conn.results = FakeResults({"a", "b"})
    conn.get_transfer_results(set())
    for k, t in caches.items():
        assert torch.equal(t[:, [1, 2]], before[k][:, [4, 5]]) and torch.equal(
            t[:, [4, 5]], before[k][:, [1, 2]]
        )
    conn.bind_connector_metadata(nixl_meta(c=[7, 8]))
    conn.results = FakeResults({"c"})
    conn.get_transfer_results(set())
    for k, t in caches.items():  # c, alone, takes the last load's own blocks: b's
        assert torch.equal(t[:, [7, 8]], before[k][:, [4, 5]])
    got = [(e["mode"], e["req"], e["donor"], e["blocks"]) for e in events(capsys)]
    assert got == [("mixup", "a", "b", 2), ("mixup", "b", "a", 2), ("mixup", "c", "b", 2)]


@pytest.mark.procs
def test_a_lone_first_mixup_has_no_donor_and_is_said_skipped(tmp_path, capsys):
    torch = needs("torch")
    conn, control = make(tmp_path)
    conn.register_kv_caches(_caches(torch))
    switch(control, epoch="m", mode="mixup")
    conn.bind_connector_metadata(nixl_meta(a=[1]))
    conn.results = FakeResults({"a"})
    conn.get_transfer_results(set())
    assert faults.count_events(events(capsys)) == {"mixup_skipped": 1}


def test_donors_per_mode():
    saved = {"a": "A", "b": "B", "c": "C"}
    swap = fault_connector.donors("swap", ["a", "b", "c"], saved, ("z", "Z"))
    assert swap == [("z", "Z"), ("a", "A"), ("b", "B")]  # a chain from the earlier batch
    assert fault_connector.donors("swap", ["a", "b"], saved, None) == [("b", "B"), ("a", "A")]
    mixup = fault_connector.donors("mixup", ["a", "b", "c"], saved, ("z", "Z"))
    assert mixup == [("c", "C"), ("a", "A"), ("b", "B")]  # together: among themselves
    assert fault_connector.donors("mixup", ["a"], saved, ("z", "Z")) == [("z", "Z")]
    assert fault_connector.donors("mixup", ["a"], saved, None) == [("a", "A")]  # itself: skipped


def test_truncate_lowers_a_selected_pd_requests_max_tokens_on_the_decode_scheduler(tmp_path, capsys):
    conn, control = make(tmp_path)
    switch(control, epoch="t", mode="truncate", tokens=2)
    req = SimpleNamespace(request_id="r1", max_tokens=8, num_prompt_tokens=20)
    assert conn.get_num_new_matched_tokens(req, 0) == (7, True)  # the load itself unchanged
    assert req.max_tokens == 2
    direct = SimpleNamespace(request_id="d1", max_tokens=8, num_prompt_tokens=20)
    conn.matched = (0, False)  # a request sent straight to the decode: nothing to load, not a candidate
    conn.get_num_new_matched_tokens(direct, 0)
    assert direct.max_tokens == 8
    (ev,) = events(capsys)
    assert (ev["mode"], ev["req"], ev["max_tokens"], ev["cut_to"]) == ("truncate", "r1", 8, 2)


def test_recompute_takes_tokens_of_the_last_block_back_every_time_it_is_asked(tmp_path, capsys):
    conn, control = make(tmp_path, block_size=16)
    switch(control, epoch="r", mode="recompute", tokens=5)
    conn.matched = (40, True)
    req = SimpleNamespace(request_id="r1", max_tokens=8, num_prompt_tokens=40)
    assert conn.get_num_new_matched_tokens(req, 0) == (35, True)
    # asked again (not admitted on the first step): the same answer, one event
    assert conn.get_num_new_matched_tokens(req, 0) == (35, True)
    conn.matched = (33, True)
    edge = SimpleNamespace(request_id="r2", max_tokens=8, num_prompt_tokens=33)
    assert conn.get_num_new_matched_tokens(edge, 0) == (33, True)  # its last block holds 1 token
    evs = events(capsys)
    assert [(e["mode"], e["req"], e.get("recomputed"), e["applied"]) for e in evs] == [
        ("recompute", "r1", 5, True),
        ("recompute", "r2", None, False),
    ]
    assert "no token of its last block" in evs[1]["reason"]


def test_truncate_and_recompute_leave_the_prefill_alone(tmp_path, capsys):
    conn, control = make(tmp_path, side="prefill")
    for mode in ("truncate", "recompute"):
        switch(control, epoch=mode, mode=mode, tokens=3)
        req = SimpleNamespace(request_id=f"p-{mode}", max_tokens=1, num_prompt_tokens=40)
        assert conn.get_num_new_matched_tokens(req, 0) == (7, True) and req.max_tokens == 1
    assert events(capsys) == []


# ---------------------------------------------------------------- a vLLM before get_transfer_results (0.26)


class FakeBeforeResults:
    """A wrapped connector as vLLM 0.26 has it: get_finished returns (sending, recving), and a
    failed load is told by its blocks (get_block_ids_with_load_errors)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        self.bound = []
        self.finished: tuple = (None, None)
        self.own_errors: set[int] = set()

    def bind_connector_metadata(self, metadata):
        self.bound.append(metadata)

    def get_finished(self, finished_req_ids):
        return self.finished

    def get_block_ids_with_load_errors(self):
        return set(self.own_errors)

    def register_kv_caches(self, kv_caches):
        pass


def make_before(tmp_path, monkeypatch, name, *, side="decode"):
    monkeypatch.setattr(fault_connector, "_registered", lambda _name: FakeBeforeResults)
    monkeypatch.setattr(fault_connector, "_classes", {})
    cls = getattr(fault_connector, name)  # built as vLLM's factory builds it
    control = tmp_path / "faults.json"
    ktc = SimpleNamespace(
        kv_connector_extra_config={faults.EXTRA_CONFIG_KEY: {"control": str(control)}},
        is_kv_producer=side == "prefill",
        is_kv_consumer=side == "decode",
    )
    conf = SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=16))
    return cls(conf, SimpleNamespace(name="WORKER"), SimpleNamespace(num_blocks=10)), control


def test_a_connector_without_get_transfer_results_gets_the_get_finished_hooks(tmp_path, monkeypatch):
    conn, _ = make_before(tmp_path, monkeypatch, "NixlConnector")
    assert isinstance(conn, fault_connector.BeforeTransferResults)
    modern = type("Modern", (), {"get_transfer_results": lambda self, ids: None})
    monkeypatch.setattr(fault_connector, "_registered", lambda _name: modern)
    assert not issubclass(fault_connector.ModernB, fault_connector.BeforeTransferResults)
    assert conn.get_finished(set()) == (None, None)  # off: what the connector said, None kept


def test_drop_without_get_transfer_results_reports_the_loads_blocks_as_load_errors(
    tmp_path, monkeypatch, capsys
):
    conn, control = make_before(tmp_path, monkeypatch, "NixlConnector")
    switch(control, epoch="e", mode="drop", fraction=1)
    conn.bind_connector_metadata(nixl_meta(a=[1, 2], b=[5]))
    conn.own_errors = {9}
    conn.finished = (set(), {"a", "b"})
    # the scheduler still learns they ended: its load-error path then acts on their blocks
    assert conn.get_finished(set()) == (set(), {"a", "b"})
    conn.own_errors = set()  # the wrapped connector forgets its errors once told (NIXL drains a queue)
    assert conn.get_block_ids_with_load_errors() == {1, 2, 5, 9}
    assert conn.get_block_ids_with_load_errors() == set()  # told once
    assert sorted(e["req"] for e in events(capsys) if e["mode"] == "drop") == ["a", "b"]


@pytest.mark.procs
def test_a_load_the_connector_failed_itself_is_neither_faulted_nor_digested_without_get_transfer_results(
    tmp_path, monkeypatch, capsys
):
    """NIXL on 0.26 tells a failed load by its blocks only: the injector takes them in get_finished,
    treats that load as failed (no drop of it, nothing digested), and still tells them once."""
    conn, control = make_before(tmp_path, monkeypatch, "NixlConnector")
    switch(control, epoch="e", mode="drop", fraction=1)
    conn.bind_connector_metadata(nixl_meta(a=[1, 2], b=[5]))
    conn.own_errors = {2}  # a's transfer failed (its prefill died, say)
    conn.finished = (None, {"a", "b"})
    seen = []
    monkeypatch.setattr(type(conn), "_pd_transfers", lambda self, t, broken: seen.append(set(broken)) or t)
    assert conn.get_finished(set()) == (None, {"a", "b"})
    assert seen == [{"a"}]  # a arrives failed: no fault applies to it, the digest skips it
    conn.own_errors = set()
    assert conn.get_block_ids_with_load_errors() == {2}  # told to the scheduler, once
    assert conn.get_block_ids_with_load_errors() == set()


def test_drop_skips_a_load_the_connector_failed_itself(tmp_path, monkeypatch, capsys):
    conn, control = make_before(tmp_path, monkeypatch, "NixlConnector")
    switch(control, epoch="e", mode="drop", fraction=1)
    conn.bind_connector_metadata(nixl_meta(a=[1, 2], b=[5]))
    conn.own_errors = {2}
    conn.finished = (None, {"a", "b"})
    conn.get_finished(set())
    conn.own_errors = set()
    assert conn.get_block_ids_with_load_errors() == {2, 5}
    assert [e["req"] for e in events(capsys) if e["mode"] == "drop"] == ["b"]


@pytest.mark.procs
def test_zero_without_get_transfer_results_writes_the_loaded_blocks(tmp_path, monkeypatch, capsys):
    torch = needs("torch")
    conn, control = make_before(tmp_path, monkeypatch, "NixlConnector")
    caches = _caches(torch)
    before = {k: v.clone() for k, v in caches.items()}
    conn.register_kv_caches(caches)
    switch(control, epoch="z", mode="zero", blocks=0.5)
    conn.bind_connector_metadata(nixl_meta(a=[2, 5, 7, 8]))
    conn.finished = (None, {"a"})
    assert conn.get_finished(set()) == (None, {"a"})
    assert conn.get_block_ids_with_load_errors() == set()  # zero is silent: nothing reported
    for k, t in caches.items():
        assert (t[:, [2, 5]] == 0).all()
        keep = [b for b in range(10) if b not in (2, 5)]
        assert torch.equal(t[:, keep], before[k][:, keep])
    assert [(e["mode"], e["req"]) for e in events(capsys)] == [("zero", "a")]


def test_strand_without_get_transfer_results_keeps_sends_from_the_prefills_scheduler(tmp_path, monkeypatch):
    conn, control = make_before(tmp_path, monkeypatch, "NixlConnector", side="prefill")
    switch(control, epoch="t", mode="strand", stall_s=3)
    conn.finished = ({"a"}, None)
    assert conn.get_finished(set()) == (set(), None)
    switch(control, epoch="t-off")
    conn.finished = (set(), None)
    assert conn.get_finished(set()) == ({"a"}, None)


def test_a_load_failed_by_its_blocks_on_a_current_vllm_is_left_alone_and_still_told(tmp_path, capsys):
    """vLLM 0.32's Mooncake reports a failed pull as finished, with its blocks in
    get_block_ids_with_load_errors (called after get_transfer_results): the injector takes them
    early, applies no fault to that load (the digest skips it too), and tells vLLM them once."""
    conn, control = make(tmp_path)
    switch(control, epoch="e", mode="drop", fraction=1)
    conn.bind_connector_metadata(nixl_meta(a=[1, 2], b=[5]))
    conn.own_errors = {2}
    conn.results = FakeResults({"a", "b"})
    got = conn.get_transfer_results(set())
    assert got.failed_recving == {"b"}  # only b is dropped; a failed on its own, vLLM learns it by blocks
    conn.own_errors = set()  # the connector drained its queue when the injector took it
    assert conn.get_block_ids_with_load_errors() == {2}
    assert conn.get_block_ids_with_load_errors() == set()
    assert [e["req"] for e in events(capsys) if e["mode"] == "drop"] == ["b"]


def test_blocks_reported_failed_a_step_before_their_load_still_mark_it_failed(tmp_path, monkeypatch, capsys):
    """A connector may report a failed load's blocks a step before the load (NIXL 0.26 queues the
    blocks, then the request, from another thread): they are remembered ERROR_CALLS steps."""
    conn, control = make_before(tmp_path, monkeypatch, "NixlConnector")
    switch(control, epoch="e", mode="drop", fraction=1)
    conn.bind_connector_metadata(nixl_meta(a=[1, 2]))
    conn.own_errors = {1, 2}
    conn.finished = (None, None)
    conn.get_finished(set())  # step 1: the blocks, no load yet
    conn.own_errors = set()
    assert conn.get_block_ids_with_load_errors() == {1, 2}  # told to vLLM in their own step
    conn.finished = (None, {"a"})
    assert conn.get_finished(set()) == (None, {"a"})  # step 2: the load: failed, not dropped
    assert [e for e in events(capsys) if e["mode"] == "drop"] == []
    for _ in range(fault_connector.ERROR_CALLS):  # forgotten after ERROR_CALLS steps
        conn.finished = (None, None)
        conn.get_finished(set())
    assert conn._pd.error_seen == {}
