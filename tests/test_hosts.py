from __future__ import annotations

import pytest

from pd_sessions.core.errors import ConfigError, PlanError
from pd_sessions.core.inventory import Inventory, parse_visible_devices, resolve_platform

GPU4 = ("0", "1", "2", "3")


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, GPU4),
        ("", ()),
        ("-1", ()),
        ("2,3", ("2", "3")),
        (" 1 , 0 ", ("1", "0")),
    ],
)
def test_visible_devices(value, expected):
    assert parse_visible_devices(value, GPU4) == expected


def test_visible_devices_unknown_gpu():
    with pytest.raises(ConfigError, match="names GPU 7, but this host has GPUs 0,1,2,3"):
        parse_visible_devices("0,7", GPU4)


@pytest.mark.parametrize(
    "requested,gpus,expected",
    [
        (None, GPU4, "cuda"),
        (None, (), "cpu"),
        ("cpu", GPU4, "cpu"),
        ("cpu", (), "cpu"),
        ("cuda", GPU4, "cuda"),
    ],
)
def test_resolve_platform(requested, gpus, expected):
    assert resolve_platform(requested, Inventory(gpus=gpus, cpus=(0, 1))) == expected


def test_cuda_without_gpu_is_an_error_never_a_fallback():
    with pytest.raises(PlanError, match="cuda was asked for, but no GPU is visible"):
        resolve_platform("cuda", Inventory(gpus=(), cpus=(0, 1), gpu_source="none"))
