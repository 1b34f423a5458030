"""The connector install decision table, and its application through a fake session."""

from __future__ import annotations

import pytest

from pd_sessions.core.errors import InstallError
from pd_sessions.env.lane_install import (
    TEST_COMMANDS,
    Action,
    Platform,
    apply_actions,
    connector_actions,
    facts_from_json,
    index_env,
    kv_requirements,
    missing_commands,
    missing_system_packages,
)

CUDA12, CUDA13, CPU = Platform("cuda", 12), Platform("cuda", 13), Platform("cpu")
REQ = "mooncake-transfer-engine>=0.3.12"


def strs(actions):
    return [str(a) for a in actions]


@pytest.mark.parametrize(
    "platform,installed,expected",
    [
        (CUDA12, {}, ["install mooncake-transfer-engine>=0.3.12"]),
        (CUDA13, {}, ["install mooncake-transfer-engine-cuda13>=0.3.12"]),
        (CPU, {}, ["install mooncake-transfer-engine-non-cuda>=0.3.12"]),
        # upstream's swap: default wheel on a CUDA 13 image -> uninstall, same version cuda13
        (
            CUDA13,
            {"mooncake-transfer-engine": "0.3.14"},
            ["uninstall mooncake-transfer-engine", "install mooncake-transfer-engine-cuda13==0.3.14"],
        ),
        (
            CPU,
            {"mooncake_transfer_engine": "0.3.13.post1"},
            ["uninstall mooncake-transfer-engine", "install mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        ),
        # already right: nothing to do
        (CUDA13, {"mooncake-transfer-engine-cuda13": "0.3.14"}, []),
        # two variants at once: remove the wrong one first, reinstall the right one (files were overwritten)
        (
            CPU,
            {"mooncake-transfer-engine": "0.3.13.post1", "mooncake-transfer-engine-non-cuda": "0.3.13.post1"},
            ["uninstall mooncake-transfer-engine", "install mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        ),
        # an installed version the requirement does not allow is not carried over
        (
            CUDA13,
            {"mooncake-transfer-engine": "0.3.10"},
            ["uninstall mooncake-transfer-engine", "install mooncake-transfer-engine-cuda13>=0.3.12"],
        ),
    ],
)
def test_mooncake_decision_table(platform, installed, expected):
    actions = connector_actions(platform, installed, connectors=["mooncake"], requirements={"mooncake": REQ})
    assert strs(actions) == expected
    if actions and actions[0].op == "uninstall":
        assert actions[-1].op == "install"  # conflicting variants go first


def test_rocm_is_unsupported_with_a_clear_error():
    with pytest.raises(InstallError, match="ROCm is not supported yet"):
        connector_actions(Platform("rocm"), {}, connectors=["mooncake"])


def test_unknown_cuda_major():
    with pytest.raises(InstallError, match="CUDA 11; supported: CUDA 12, CUDA 13, CPU"):
        connector_actions(Platform("cuda", 11), {}, connectors=["mooncake"])


def test_requested_version_missing_for_variant():
    with pytest.raises(InstallError) as e:
        connector_actions(
            CUDA13,
            {"mooncake-transfer-engine": "0.3.12.post1"},
            connectors=["mooncake"],
            requirements={"mooncake": REQ},
            available={"mooncake-transfer-engine-cuda13": ["0.3.13", "0.3.14"]},
        )
    msg = str(e.value)
    assert "mooncake-transfer-engine-cuda13==0.3.12.post1" in msg and "CUDA 13" in msg
    assert "available: 0.3.13, 0.3.14" in msg


@pytest.mark.parametrize(
    "platform,installed,expected",
    [
        (CUDA13, {}, ["install nixl==1.5.1 (--no-deps)", "install nixl-cu13==1.5.1 (--no-deps)"]),
        (
            CUDA12,
            {"nixl": "1.5.1", "nixl-cu13": "1.5.1"},
            ["uninstall nixl-cu13", "install nixl-cu12==1.5.1 (--no-deps)"],
        ),
        (CPU, {}, ["install nixl==1.5.1 (--no-deps)", "install nixl-cu12==1.5.1 (--no-deps)"]),
        (CUDA13, {"nixl": "1.5.1", "nixl-cu13": "1.5.1"}, []),
    ],
)
def test_nixl_decision_table(platform, installed, expected):
    reqs = {"nixl": "nixl==1.5.1"}
    assert strs(connector_actions(platform, installed, connectors=["nixl"], requirements=reqs)) == expected
    # push mode needs the same wheels (its spec names NIXL's package)
    assert (
        strs(connector_actions(platform, installed, connectors=["nixl_push"], requirements=reqs)) == expected
    )


def test_without_a_requirement_the_installed_version_is_kept():
    """The installed-environment mode passes no requirements: any Mooncake variant's version, and
    the installed nixl's version for its backend."""
    got = connector_actions(
        CUDA13, {"mooncake-transfer-engine": "0.3.1", "nixl": "1.4.0"}, connectors=["mooncake", "nixl"]
    )
    assert strs(got) == [
        "uninstall mooncake-transfer-engine",
        "install mooncake-transfer-engine-cuda13==0.3.1",
        "install nixl-cu13==1.4.0 (--no-deps)",
    ]


def test_requirements_file_is_the_source():
    reqs = kv_requirements()
    assert reqs["mooncake"] == "mooncake-transfer-engine>=0.3.12" and reqs["nixl"] == "nixl==1.5.1"


@pytest.mark.parametrize(
    "doc,expected",
    [
        ({"torch": {"cuda": "13.0"}}, Platform("cuda", 13)),
        ({"torch": {"cuda": "12.8"}}, Platform("cuda", 12)),
        ({"torch": {"cuda": None}}, Platform("cpu")),
        ({"torch": {"hip": "6.2"}}, Platform("rocm")),
        ({"torch": None}, Platform("cpu")),
    ],
)
def test_facts(doc, expected):
    assert facts_from_json(doc)[0] == expected


class FakeSession:
    def __init__(self, fail_on: str | None = None):
        self.calls: list[tuple] = []
        self.fail_on = fail_on

    def install(self, *args, env=None):
        self.calls.append(("install", *args))
        if self.fail_on and any(self.fail_on in a for a in args):
            raise RuntimeError("Command uv pip install failed with exit code 1")

    def run_install(self, *args):
        self.calls.append(("run", *args))


def test_apply_prints_each_action_then_runs_it_in_order():
    said, s = [], FakeSession()
    acts = [
        Action("uninstall", "mooncake-transfer-engine"),
        Action("install", "mooncake-transfer-engine-cuda13", "==0.3.14"),
        Action("install", "nixl-cu13", "==1.5.1", no_deps=True),
    ]
    apply_actions(s, acts, CUDA13, say=said.append)
    assert said == [f"pd-sessions install: {a}" for a in acts]
    assert s.calls == [
        ("run", "uv", "pip", "uninstall", "mooncake-transfer-engine"),
        ("install", "mooncake-transfer-engine-cuda13==0.3.14"),
        ("install", "--no-deps", "nixl-cu13==1.5.1"),
    ]


def test_apply_failure_names_package_version_platform():
    with pytest.raises(InstallError) as e:
        apply_actions(
            FakeSession(fail_on="cuda13"),
            [Action("install", "mooncake-transfer-engine-cuda13", "==9.9")],
            CUDA13,
            say=lambda m: None,
        )
    assert "mooncake-transfer-engine-cuda13==9.9" in str(e.value) and "CUDA 13" in str(e.value)


def test_missing_commands_name_their_debian_packages():
    on_path = {"ls": "/bin/ls"}.get
    assert missing_commands({"gcc": "gcc", "ls": "coreutils"}, which=on_path) == ["gcc"]
    assert missing_commands({"ls": "coreutils"}, which=on_path) == []
    assert missing_commands({}) == []
    # the tests session's: a compiler for the canary's ELF files, Chromium and its driver for the page,
    # iproute2 for the simulated hosts, nftables for the wire faults between them
    assert missing_commands(TEST_COMMANDS, which=on_path) == [
        "chromium",
        "chromium-driver",
        "gcc",
        "iproute2",
        "nftables",
    ]


def test_system_packages_and_index_env():
    assert missing_system_packages({"libnuma.so.1", "libcurl.so.4"}) == ["libibverbs1"]
    assert missing_system_packages({"libibverbs.so.1", "libnuma.so.1", "libcurl.so.4"}) == []
    assert index_env({"PIP_FIND_LINKS": "/a /b"}) == {"UV_FIND_LINKS": "/a,/b", "UV_COMPILE_BYTECODE": "1"}
    assert index_env({"PIP_FIND_LINKS": "/a", "UV_FIND_LINKS": "/c"}) == {"UV_COMPILE_BYTECODE": "1"}
    assert index_env({"UV_COMPILE_BYTECODE": "0"}) == {}
