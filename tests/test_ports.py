from __future__ import annotations

import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pd_sessions.core.errors import PlanError
from pd_sessions.core.port_source import BLOCK_RANGE
from pd_sessions.runtime.ports import PortAllocator


def test_ports_unique_and_free_after_release():
    a = PortAllocator()
    ports = [a.take(f"p{i}") for i in range(20)]
    base = a.take_block("b", 16)
    assert len(set(ports)) == 20
    assert BLOCK_RANGE[0] <= base < BLOCK_RANGE[1]
    assert not set(range(base, base + 16)) & set(ports)
    a.release()
    for p in [*ports, *range(base, base + 16)]:
        s = socket.socket()
        s.bind(("127.0.0.1", p))  # free again
        s.close()


def test_ports_are_held_until_release():
    with PortAllocator() as a:
        p = a.take("x")
        s = socket.socket()
        with pytest.raises(OSError):
            s.bind(("127.0.0.1", p))
        s.close()


@pytest.mark.procs
def test_claim_of_taken_port_names_owner():
    srv = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen();"
            "print(s.getsockname()[1], flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(srv.stdout.readline())
        with PortAllocator() as a, pytest.raises(PlanError) as e:
            a.claim("router_port", port)
        msg = str(e.value)
        assert f"port {port}" in msg and "already in use" in msg and f"pid {srv.pid}" in msg
        assert e.value.field == "router_port"
    finally:
        srv.kill()
        srv.wait()


def test_claim_free_port_holds_it():
    with PortAllocator() as a:
        p = a.take("probe")
    with PortAllocator() as b:
        assert b.claim("x", p) == p
        with pytest.raises(PlanError, match="already used by this plan"):
            b.claim("y", p)


def test_a_released_port_is_not_handed_out_again_by_this_process():
    """Configs side by side: a port released right before its server spawns (which binds it only
    once it is up) is not taken by the next config planned meanwhile."""
    first = PortAllocator(rng=random.Random(7))
    base = first.take_block("a", 16)
    port = first.take("a.http")
    first.release()
    again = PortAllocator(rng=random.Random(7))  # the same draws: it would pick the same block
    try:
        other = again.take_block("b", 16)
        assert not set(range(other, other + 16)) & set(range(base, base + 16))
        assert port not in {again.take(f"b{i}") for i in range(50)}
    finally:
        again.release()


def test_a_single_port_comes_from_below_the_kernels_ephemeral_range():
    """A port the kernel picks for an outgoing connection or a bind to port 0 lies in its
    ephemeral range; one of ours there could be taken between its release at the spawn and the
    server's bind, seconds later. So every allocated port comes from BLOCK_RANGE, below it."""
    lo_eph = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    lo, hi = BLOCK_RANGE
    assert hi <= lo_eph
    with PortAllocator() as ports:
        got = [ports.take(f"p{i}") for i in range(20)]
    assert all(lo <= p < hi for p in got) and len(set(got)) == 20, got
