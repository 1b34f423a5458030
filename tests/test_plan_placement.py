"""Which instance goes where (core.plan.placement): one slot per instance, prefill first."""

from __future__ import annotations

import pytest
from helpers.builders import CPU2, GPUS4, cfg

from pd_sessions.core.errors import PlanError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan.placement import Slot, place


def test_slots_carry_role_index_ranks_and_explicit_ports():
    c = cfg(num_prefill=2, prefill_ports=(18001, 18002), moe=True, decode_dp=2)
    p = place(c, Inventory(gpus=tuple("01234567"), cpus=(0,)), platform="cuda", share_gpus=False)
    assert [s.name for s in p.prefill] == ["prefill-0", "prefill-1"]
    assert [s.name for s in p.decode] == ["decode-0"]
    assert [(s.tp, s.dp, s.http_port) for s in p.prefill] == [(1, 1, 18001), (1, 1, 18002)]
    assert (p.decode[0].tp, p.decode[0].dp, p.decode[0].http_port) == (1, 2, None)
    assert [s.gpus for s in p.prefill + p.decode] == [("0",), ("1",), ("2", "3")]
    assert all(s.cpu_bind is None for s in p.prefill + p.decode)
    assert not p.shared_gpus and p.warnings == ()


def test_cpu_slots_bind_cores_and_take_no_gpus():
    p = place(cfg(), CPU2, platform="cpu", share_gpus=True)  # --share-gpus means nothing on cpu
    assert (p.prefill[0].cpu_bind, p.decode[0].cpu_bind) == ("0", "1")
    assert p.prefill[0].gpus == () == p.decode[0].gpus
    assert not p.shared_gpus and p.warnings == ()


@pytest.mark.parametrize(
    "platform,inv,share,shared,needle",
    [
        ("cuda", GPUS4, False, False, None),
        (
            "cuda",
            Inventory(gpus=("0",), cpus=(0,)),
            True,
            True,
            "--share-gpus: 1xP(TP1) + 1xD(TP1) shares GPUs 0",
        ),
        ("cpu", Inventory(gpus=(), cpus=(0,)), False, False, "2 TP ranks share 1 CPU cores (0)"),
    ],
)
def test_placement_warning_table(platform, inv, share, shared, needle):
    p = place(cfg(), inv, platform=platform, share_gpus=share)
    assert p.shared_gpus is shared
    assert [w for w in p.warnings if needle and needle in w] == list(p.warnings)
    assert len(p.warnings) == (1 if needle else 0)


def test_too_few_gpus_is_the_placements_error():
    with pytest.raises(PlanError) as e:
        place(
            cfg(prefill_tp=2, decode_tp=2),
            Inventory(gpus=("0",), cpus=(0,)),
            platform="cuda",
            share_gpus=False,
        )
    assert e.value.field == "gpus" and "needs 4 GPUs" in str(e.value)


def test_slot_name():
    assert Slot("decode", 3, tp=1, dp=1).name == "decode-3"
