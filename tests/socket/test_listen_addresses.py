"""Listeners bind the address the job names, never every interface when a specific one is given.

The rendezvous store holds the job secret and the replica server serves model state: with
``--rdzv-endpoint 127.0.0.1:...`` or ``--local-addr 127.0.0.1`` neither may be reachable from
another interface.
"""

from __future__ import annotations

import os
from datetime import timedelta

import psutil
import pytest

from resilrun.agent.state.replication import PeerTier
from resilrun.rendezvous.c10d import connect_store, host_store, open_store
from resilrun.tiers.memory import NodeMemoryTier


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections() if c.status == "LISTEN" and c.laddr.port == port}


def test_a_store_hosted_on_an_ip_literal_listens_on_that_address_only() -> None:
    store = host_store("127.0.0.1", 0, timedelta(seconds=10))
    assert _listening(store.port) == {"127.0.0.1"}
    client = connect_store("127.0.0.1", store.port, timedelta(seconds=10))
    client.set("k", b"v")
    assert store.get("k") == b"v"
    # a second agent on the same node finds the port taken and connects as a client, as before
    _, hosting = open_store("127.0.0.1", store.port, is_host=None, timeout=timedelta(seconds=10))
    assert hosting is False


def test_a_store_hosted_on_a_wildcard_or_a_name_keeps_torchruns_binding() -> None:
    # A name may resolve differently on other nodes (127.0.1.1 in /etc/hosts): not narrowed
    store = host_store("0.0.0.0", 0, timedelta(seconds=10))
    assert _listening(store.port) & {"0.0.0.0", "::"}


def test_hosting_a_store_leaks_no_descriptor() -> None:
    # The first store of a process sets up what every later one shares (two descriptors that stay,
    # torch 2.13): not a leak, so it is made before counting. Whether this test is the first to host
    # a store in its worker depends on how xdist deals the tests out.
    first = host_store("127.0.0.1", 0, timedelta(seconds=10))
    del first
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        store = host_store("127.0.0.1", 0, timedelta(seconds=10))
        del store
    assert len(os.listdir("/proc/self/fd")) <= before + 1


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_the_replica_server_binds_the_local_address_not_every_interface(host: str) -> None:
    memory = NodeMemoryTier("listen-test")
    tier = PeerTier(
        memory, os.urandom(32), "listen-test", "node-a", host, targets=list, peers=list, world_size=lambda: 0,
        generation=lambda: -1,
    )  # fmt: skip
    try:
        port = int(tier.address.rsplit(":", 1)[1])
        assert _listening(port) == {"127.0.0.1"}
    finally:
        tier.close()
        memory.close()
