"""Faults on the wire between the prefill and decode hosts (issue 29), for real: the rehearsal's
1P1D over Mooncake (tcp) and over NIXL (UCX over tcp), prefill on host1 and decode on host2 of
the simulated hosts, runs the wire scenarios after its default checks on the same cluster
(tests/conftest.py: hosts_mooncake, hosts_nixl with WIRE). No cluster of its own.

Each scenario proves its fault bit from the kernel's counters (nftables' dropped packets, tbf's
overlimits or drops), keeps the promise (every request correct or failed clearly, never a 200
with other text, never a hang), records the recovery time, and leaves nothing on the hosts: no
rule, no qdisc. A kernel without netem records the delay as "not run: no netem in this kernel"."""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ET

import pytest
from helpers.e2e_runs import WIRE_LOSS_RATES

from pd_sessions.checks.faults.promise import BROKEN, HUNG, WRONG
from pd_sessions.core import check_registry, wire_rules

pytestmark = [pytest.mark.e2e, pytest.mark.multihost]

RUNS = ["hosts_mooncake", "hosts_nixl"]


def kept(details: dict) -> None:
    """No request got a 200 with other text, hung, or lost its HTTP answer."""
    c = details["counts"]
    assert c[WRONG] == c[HUNG] == c[BROKEN] == 0, details


@pytest.mark.parametrize("run", RUNS)
def test_every_wire_scenario_ran_on_the_rehearsal_bit_and_kept_the_promise(run, request, simulated_hosts_2):
    r = request.getfixturevalue(run)
    checks = r.checks
    assert set(check_registry.WIRE) <= set(checks), list(checks)
    for n in check_registry.WIRE:
        c = checks[n]
        print(f"{run}: {n} {c['verdict']} in {c['seconds']:.1f} s: {c['message']}")
    # wire_delay alone may be NOT RUN (a kernel without netem, as this one), asserted below
    assert all(checks[n]["verdict"] == "pass" for n in check_registry.WIRE if n != "wire_delay"), {
        n: checks[n]["message"] for n in check_registry.WIRE
    }

    loss = checks["wire_loss"]["details"]
    assert [x["percent"] for x in loss["rates"]] == list(WIRE_LOSS_RATES[run])
    for rate in loss["rates"]:
        assert rate["counters"][wire_rules.DROPPED] > 0, rate  # the rule dropped KV packets
        assert rate["counters"][wire_rules.SEEN] >= rate["counters"][wire_rules.DROPPED]
        kept(rate)
    assert loss["recovery"]["ok"] and loss["recovery_s"] >= 0

    part = checks["wire_partition"]["details"]
    assert part["dropped_packets"] > 0 and part["counters"][wire_rules.SEEN] == part["dropped_packets"], part
    kept(part)
    assert part["recovery"]["ok"] and part["recovery_s"] > 0

    cap = checks["wire_cap"]["details"]
    assert cap["tbf_overlimits"] + cap["tbf_drops"] > 0, cap
    assert cap["counts"]["correct"] == len(cap["outcomes"]) > 0  # the burst still passes
    assert cap["capped_median_s"] > cap["baseline_median_s"], cap  # ... slower: the cap shows

    delay = checks["wire_delay"]
    cases = {c.get("name"): c for c in ET.parse(r.results / "junit.xml").getroot().iter("testcase")}
    assert set(check_registry.WIRE) <= set(cases), cases  # each scenario a JUnit case
    if not delay["details"]["ran"]:  # this kernel has no netem: NOT RUN, everywhere, never a pass
        assert delay["verdict"] == "not run", delay
        assert delay["message"].startswith("no netem in this kernel"), delay["message"]
        skipped = cases["wire_delay"].find("skipped")
        assert skipped is not None and skipped.get("message", "").startswith("not run: no netem"), skipped
        page = (r.results / "report.html").read_text()
        assert 'class="cell not-run"' in page and "NOT RUN" in page
    else:
        assert delay["verdict"] == "pass", delay
        kept(delay["details"])
        assert delay["details"]["netem"]["packets"] > 0


def test_no_rule_and_no_qdisc_is_left_on_either_host(request, simulated_hosts_2):
    """After both runs, in each host's namespace: no pds_wire table, no tbf or netem qdisc."""
    for run in RUNS:
        request.getfixturevalue(run)
    for h in simulated_hosts_2.hosts:
        table = subprocess.run(
            ["ip", "netns", "exec", h.netns, "nft", "list", "table", wire_rules.FAMILY, wire_rules.TABLE],
            capture_output=True,
            text=True,
        )
        assert table.returncode != 0 and "No such file or directory" in table.stderr, table.stdout
        qd = subprocess.run(
            ["ip", "netns", "exec", h.netns, "tc", "-j", "qdisc", "show", "dev", h.ifname],
            capture_output=True,
            text=True,
            check=True,
        )
        assert (
            wire_rules.qdisc_stats(qd.stdout, "tbf") is None
            and wire_rules.qdisc_stats(qd.stdout, "netem") is None
        )
