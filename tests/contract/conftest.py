"""Rendezvous backends for the contract suites: memory, c10d (TCPStore on port 0), etcd (real server),
and c10d behind the SealedBackend the agents write through (every value carrying its MAC)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

from resilrun.rendezvous.api import RendezvousBackend
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.sealed import SealedBackend

BACKENDS = ["memory", "c10d", "etcd", "sealed-c10d"]
SEALING_KEY = b"k" * 32


@dataclass
class HostedStore:
    server: Any
    port: int
    client: RendezvousBackend


@pytest.fixture(scope="module")
def hosted_store() -> Iterator[HostedStore]:
    """One TCPStore per module: creating many in quick succession makes torch's connects flaky."""
    from resilrun.rendezvous.c10d import C10dBackend, connect_store, host_store

    server = host_store("127.0.0.1", 0, timedelta(seconds=5))
    client = connect_store("127.0.0.1", server.port, timedelta(seconds=5))
    yield HostedStore(server, server.port, C10dBackend(client, f"127.0.0.1:{server.port}"))


@pytest.fixture(scope="module")
def etcd_backend(etcd_server: Any) -> Iterator[RendezvousBackend]:
    from resilrun.rendezvous.etcd import open_etcd

    backend = open_etcd(etcd_server.endpoint, timeout=timedelta(seconds=5))
    yield backend
    backend.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> RendezvousBackend:
    if request.param == "memory":
        return MemoryBackend()
    if request.param == "etcd":
        etcd: RendezvousBackend = request.getfixturevalue("etcd_backend")
        return etcd
    hosted: HostedStore = request.getfixturevalue("hosted_store")
    if request.param == "sealed-c10d":
        return SealedBackend(hosted.client, SEALING_KEY)
    return hosted.client


@pytest.fixture(params=BACKENDS)
def connect(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Factory of independent clients of one store, as separate nodes would hold (closed afterwards)."""
    opened: list[RendezvousBackend] = []
    if request.param == "memory":
        shared = MemoryBackend()

        def make() -> RendezvousBackend:
            return shared

    elif request.param in ("c10d", "sealed-c10d"):
        from resilrun.rendezvous.c10d import C10dBackend, connect_store

        hosted: HostedStore = request.getfixturevalue("hosted_store")
        sealing = request.param == "sealed-c10d"

        def make() -> RendezvousBackend:
            store = connect_store("127.0.0.1", hosted.port, timedelta(seconds=5))
            client = C10dBackend(store, f"127.0.0.1:{hosted.port}")
            return SealedBackend(client, SEALING_KEY) if sealing else client

    else:
        from resilrun.rendezvous.etcd import open_etcd

        server = request.getfixturevalue("etcd_server")

        def make() -> RendezvousBackend:
            return open_etcd(server.endpoint, timeout=timedelta(seconds=5))

    def tracked() -> RendezvousBackend:
        client = make()
        opened.append(client)
        return client

    yield tracked
    for client in opened:
        client.close()
