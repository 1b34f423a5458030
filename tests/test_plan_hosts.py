"""The planner across hosts (core.plan.across_hosts and plan_cluster with a HostLayout): phase 1's facts in,
each instance on its host with that host's address, ports and devices, the router on the driver's."""

from __future__ import annotations

import pytest
from helpers.builders import arg, cfg, plan

from pd_sessions.core import connectors
from pd_sessions.core.config import ClusterConfig
from pd_sessions.core.errors import ConfigError, PlanError
from pd_sessions.core.inventory import Inventory
from pd_sessions.core.plan.across_hosts import HostFacts, HostLayout, assign_hosts, is_loopback

DRIVER = HostFacts("driver", "198.18.0.254", Inventory((), (0, 1)))


def host(k: int, *, cpus=(0,), gpus=(), rdma=None, labels=(), iface="auto", python=None, models=()):
    return HostFacts(
        f"host{k}",
        f"198.18.0.{k}",
        Inventory(tuple(gpus), tuple(cpus), rdma_devices=rdma),
        interface=f"pdh{k}" if iface == "auto" else iface,
        labels=(("pd-host", f"host{k}"), *labels),
        python=python,
        model_paths=models,
    )


def layout(*hosts, allow=False):
    return HostLayout((DRIVER, *hosts), "driver", allow_loopback=allow)


def tiny(**kw) -> ClusterConfig:
    return cfg(model="tiny-llama", **kw)


def test_1p1d_prefill_on_host1_decode_on_host2_each_binding_and_advertising_its_address():
    p = plan(
        tiny(connector="nixl"), layout=layout(host(2), host(1)), model="/m", platform="cpu"
    )  # found in any order: sorted by address
    (pre,), (dec,) = p.prefill, p.decode
    assert (pre.node, pre.host, pre.bind) == ("host1", "198.18.0.1", "198.18.0.1")
    assert (dec.node, dec.host, arg(dec, "--host")) == ("host2", "198.18.0.2", "198.18.0.2")
    for spec, k in ((pre, 1), (dec, 2)):
        e = spec.env_dict()
        assert e["VLLM_HOST_IP"] == e["VLLM_NIXL_SIDE_CHANNEL_HOST"] == f"198.18.0.{k}"
        assert e["GLOO_SOCKET_IFNAME"] == e["NCCL_SOCKET_IFNAME"] == e["UCX_NET_DEVICES"] == f"pdh{k}"
        assert e["UCX_TLS"] == "tcp"  # no shm or cma: namespaces share /dev/shm
        assert spec.url == f"http://198.18.0.{k}:{spec.port}"
    # the router runs on the driver's host, bound to config.host, told the advertised URLs
    r = p.router
    assert (r.node, r.host) == ("driver", "127.0.0.1")
    assert arg(r, "--prefill") == pre.url and arg(r, "--decode") == dec.url
    assert p.hosts == (("driver", "198.18.0.254"), ("host1", "198.18.0.1"), ("host2", "198.18.0.2"))


def test_ports_are_unique_per_host_and_may_repeat_across_hosts():
    p = plan(tiny(), layout=layout(host(1), host(2)), model="/m", platform="cpu")
    by_host: dict[str, list[int]] = {}
    for label, port in p.ports:
        by_host.setdefault(label.split("/")[0], []).append(port)
    assert set(by_host) == {"driver", "host1", "host2"}
    assert all(len(ports) == len(set(ports)) for ports in by_host.values())
    assert p.prefill[0].port == p.decode[0].port  # each host's own source: the same number is fine


def test_mooncake_binds_its_tcp_transport_on_the_hosts_address_and_keeps_a_bootstrap_port_per_prefill():
    p = plan(
        tiny(connector="mooncake", num_prefill=2), layout=layout(host(1), host(2)), model="/m", platform="cpu"
    )
    assert [s.node for s in p.prefill] == ["host1", "host1"]  # 2P1D on 2 hosts: both on host 1
    assert [s.env_dict()["MC_TCP_BIND_ADDRESS"] for s in p.instances] == ["198.18.0.1"] * 2 + ["198.18.0.2"]
    assert len({s.bootstrap_port for s in p.prefill}) == 2
    kv = arg(p.prefill[0], "--kv-transfer-config")
    assert "bootstrap_server_address" not in kv  # vLLM would then not start the prefill's own server


def test_dry_run_render_says_where_each_process_runs_and_the_ports_of_each_host():
    text = plan(tiny(), layout=layout(host(1), host(2)), model="/m", platform="cpu").render()
    assert "  prefill-0: http://198.18.0.1:" in text and " on host1 (cores 0," in text
    assert "  router: http://127.0.0.1:" in text and " on driver (no device)" in text
    assert "  ports on host1 (198.18.0.1): all " in text and "  ports on driver (198.18.0.254)" in text
    assert "note: hosts: prefill on host1 (default split); decode on host2 (default split)" in text


@pytest.mark.parametrize(
    "hosts,prefill,decode",
    [
        ((1,), ["host1"], ["host1"]),  # one node besides the driver: it serves both
        ((1, 2), ["host1"], ["host2"]),
        ((3, 1, 2), ["host1", "host2"], ["host3"]),  # the first half, rounded up
        ((1, 2, 3, 4), ["host1", "host2"], ["host3", "host4"]),
        ((), ["driver"], ["driver"]),  # no other node: the driver's
    ],
)
def test_default_split_sorted_by_address(hosts, prefill, decode):
    c = tiny(num_prefill=len(prefill), num_decode=len(decode))
    a = assign_hosts(c, layout(*(host(k) for k in hosts)))
    assert [h.name for h in a.prefill] == prefill and [h.name for h in a.decode] == decode


def test_addresses_sort_numerically_not_as_text():
    hosts = [HostFacts(f"h{n}", f"10.0.0.{n}", Inventory((), (0,))) for n in (10, 9, 100)]
    a = assign_hosts(tiny(num_prefill=2, num_decode=1), HostLayout((DRIVER, *hosts), "driver"))
    assert [h.name for h in a.prefill] == ["h9", "h10"] and [h.name for h in a.decode] == ["h100"]


def test_label_selectors_choose_the_hosts_of_each_role_round_robin():
    lay = layout(
        host(1, labels=(("pd-role", "decode"),)),
        host(2, labels=(("pd-role", "prefill"),)),
        host(3, labels=(("pd-role", "prefill"),)),
    )
    c = tiny(num_prefill=3, prefill_hosts=("pd-role=prefill",), decode_hosts=("pd-role=decode", "x=y"))
    a = assign_hosts(c, lay)
    assert [h.name for h in a.prefill] == ["host2", "host3", "host2"]
    assert [h.name for h in a.decode] == ["host1"]


def test_a_selector_no_node_matches_names_the_field_and_every_node():
    with pytest.raises(PlanError) as e:
        assign_hosts(tiny(decode_hosts=("pd-role=decode",)), layout(host(1), host(2)))
    assert e.value.field == "decode_hosts"
    assert "host1 (198.18.0.1, labels pd-host=host1)" in str(e.value) and "ray start --labels" in str(e.value)


@pytest.mark.parametrize("bad", [["pd-role"], ["=x"], ["k="], "pd-role=prefill"])
def test_selectors_are_key_value_lists(bad):
    from pd_sessions.core.config import Overrides

    with pytest.raises(ConfigError) as e:
        Overrides(fields=(("prefill_hosts", bad),)).apply(tiny())
    assert e.value.field == "prefill_hosts"


def test_selectors_come_from_set_like_any_field():
    from pd_sessions.core.config import make_overrides

    c = make_overrides(sets=['prefill_hosts=["pd-role=prefill"]']).apply(tiny())
    assert c.prefill_hosts == ("pd-role=prefill",)


def test_each_host_places_its_own_cores_and_warns_by_name_when_ranks_share():
    p = plan(
        tiny(num_prefill=2),
        layout=layout(host(1, cpus=(4,)), host(2, cpus=(6, 7))),
        model="/m",
        platform="cpu",
    )
    assert [s.cpu_bind for s in p.instances] == ["4", "4", "6,7"]
    assert any("2 TP ranks share 1 CPU cores on host1 (4)" in w for w in p.warnings)


def test_each_host_places_its_own_gpus_and_a_host_with_too_few_is_named():
    lay = layout(host(1, gpus=("0", "1")), host(2, gpus=("0",)))
    p = plan(cfg(prefill_tp=2), layout=lay, model="/m", platform="cuda")
    assert p.prefill[0].env_dict()["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert p.decode[0].env_dict()["CUDA_VISIBLE_DEVICES"] == "0"
    with pytest.raises(PlanError) as e:
        plan(cfg(decode_tp=2), layout=lay, model="/m", platform="cuda")
    assert e.value.field == "gpus" and "on host2 (198.18.0.2), which has 1: 0" in str(e.value)


@pytest.mark.parametrize(
    "rdma,name,field,needle",
    [
        ((), "", "mooncake_protocol", "this host has none"),
        (("mlx5_0",), "mlx5_12", "mooncake_device_name", "names mlx5_12, not an RDMA device of this host"),
        (("mlx5_12", "mlx5_0"), "mlx5_12", None, None),
    ],
)
def test_mooncake_rdma_devices_are_checked_against_each_host(rdma, name, field, needle):
    lay = layout(host(1, gpus=("0",), rdma=("mlx5_12",)), host(2, gpus=("0",), rdma=rdma))
    c = cfg(mooncake_protocol="rdma", mooncake_device_name=name)
    if field is None:
        assert (
            "MC_TCP_BIND_ADDRESS" not in plan(c, layout=lay, model="/m", platform="cuda").decode[0].env_dict()
        )  # rdma: not tcp
        return
    with pytest.raises(PlanError) as e:
        plan(c, layout=lay, model="/m", platform="cuda")
    assert e.value.field == field and needle in str(e.value)
    assert str(e.value).startswith(f"{field}: on host2 (198.18.0.2): "), e.value  # the host named


def test_ucx_net_devices_must_be_a_device_of_the_host():
    lay = layout(host(1, gpus=("0",), rdma=("mlx5_0",)), host(2, gpus=("0",), rdma=("mlx5_1",)))
    c = cfg(connector="nixl", extra_env=(("UCX_NET_DEVICES", "mlx5_0:1"),))
    with pytest.raises(PlanError) as e:
        plan(c, layout=lay, model="/m", platform="cuda")
    assert e.value.field == "UCX_NET_DEVICES" and "on host2 (198.18.0.2) (RDMA: mlx5_1" in str(e.value)


@pytest.mark.parametrize(
    "var,value",
    [
        ("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1"),
        ("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
        ("VLLM_HOST_IP", "127.0.0.1"),
        ("VLLM_HOST_IP", "::1"),
    ],
)
def test_a_loopback_advertised_across_hosts_is_refused_naming_the_variable_and_host(var, value):
    c = tiny(connector="nixl", extra_env=((var, value),))
    with pytest.raises(PlanError) as e:
        plan(c, layout=layout(host(1), host(2)), model="/m", platform="cpu")
    assert e.value.field == var
    assert f"prefill-0 on host1 (198.18.0.1) would advertise {var}={value}" in str(e.value)
    assert "--allow-loopback-advertise" in str(e.value)
    # allowed: planned, and each instance's warning names its host and the variable
    p = plan(c, layout=layout(host(1), host(2), allow=True), model="/m", platform="cpu")
    assert p.prefill[0].env_dict()[var] == value
    said = [w for w in p.warnings if var in w]
    assert len(said) == 2 and "decode-0 on host2 (198.18.0.2)" in said[1] and "must fail" in said[0]


def test_a_config_host_on_loopback_is_fine_across_hosts_each_instance_takes_its_own():
    p = plan(tiny(host="127.0.0.1"), layout=layout(host(1), host(2)), model="/m", platform="cpu")
    assert p.prefill[0].host == "198.18.0.1" and p.router.host == "127.0.0.1"


@pytest.mark.parametrize(
    "value,loop",
    [("127.0.0.1", True), ("127.8.0.1", True), ("localhost", True), ("", True), ("::1", True),
     ("[::1]", True), ("198.18.0.1", False), ("node-a", False)],
)  # fmt: skip
def test_is_loopback(value, loop):
    assert is_loopback(value) is loop


def test_the_host_python_and_model_path_are_used_there():
    h = host(2, python="/node/py", models=(("/m", "/node/cache/m"),))
    p = plan(tiny(), layout=layout(host(1), h), model="/m", platform="cpu")
    assert p.decode[0].argv[0] == "/node/py" and arg(p.decode[0], "--model") == "/node/cache/m"
    assert p.prefill[0].argv[0] == "/py" and arg(p.prefill[0], "--model") == "/m"


def test_a_host_without_an_interface_sets_no_interface_names():
    p = plan(tiny(connector="nixl"), layout=layout(host(1, iface=None), host(2)), model="/m", platform="cpu")
    assert not {"GLOO_SOCKET_IFNAME", "UCX_NET_DEVICES"} & set(p.prefill[0].env_dict())
    assert p.prefill[0].env_dict()["UCX_TLS"] == "tcp"


def test_the_single_host_plan_has_no_host_fields():
    p = plan(tiny(), Inventory((), (0, 1)), platform="cpu", model="/m")
    assert all(s.node is None and s.bind is None for s in p.processes) and p.hosts == ()
    assert "  ports: all " in p.render() and "  prefill-0: http://127.0.0.1:40001 (cores 0," in p.render()


@pytest.mark.parametrize("spec", connectors.ALL, ids=lambda s: s.name)
def test_every_connectors_advertised_variables_carry_the_hosts_address_and_loopback_there_is_refused(spec):
    """Each registered connector, across hosts (on the CPU lane, or on GPU hosts for one the CPU
    lane refuses): every variable its spec says it advertises (its side-channel host,
    ``across_hosts.advertised_env``) holds the instance's host address; forced to loopback, each is
    refused naming it and the host."""
    c = tiny(connector=spec.name, mooncake_protocol="tcp")
    platform = "cuda" if spec.limits.refuse(c, "cpu") else "cpu"
    hosts = (host(1, gpus=("0",)), host(2, gpus=("0",)))
    p = plan(c, layout=layout(*hosts), model="/m", platform=platform)
    for inst, h in ((p.prefill[0], "198.18.0.1"), (p.decode[0], "198.18.0.2")):
        e = inst.env_dict()
        assert e["VLLM_HOST_IP"] == h
        assert {v: e.get(v) for v in spec.advertised_env()} == dict.fromkeys(spec.advertised_env(), h)
    for var in spec.advertised_env():
        with pytest.raises(PlanError) as err:
            bad = tiny(connector=spec.name, mooncake_protocol="tcp", extra_env=((var, "127.0.0.1"),))
            plan(bad, layout=layout(*hosts), model="/m", platform=platform)
        assert err.value.field == var and "prefill-0 on host1 (198.18.0.1)" in str(err.value)
