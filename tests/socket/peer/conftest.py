"""One running ReplicaServer on 127.0.0.1 (port 0) over a fresh ReplicaStore and NodeMemoryTier,
plain or with ``--peer-encryption``: the peer-tier tests' node under test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest

from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer, ReplicaStore
from tests.socket.peer.harness import ENCRYPTED, NODE_ID, SECRET

# Short enough that a test about a stalled peer ends quickly, long enough for a loaded 2-core machine.
IO_TIMEOUT = timedelta(seconds=5)


@pytest.fixture
def memory() -> Iterator[NodeMemoryTier]:
    tier = NodeMemoryTier(f"t{uuid.uuid4().hex[:8]}")
    yield tier
    tier.close()


@pytest.fixture
def store() -> Iterator[ReplicaStore]:
    replicas = ReplicaStore("test")
    yield replicas
    replicas.close()


@pytest.fixture
def server(store: ReplicaStore, memory: NodeMemoryTier) -> Iterator[ReplicaServer]:
    replica_server = ReplicaServer(SECRET, store, memory, node_id=NODE_ID, io_timeout=IO_TIMEOUT)
    yield replica_server
    replica_server.close()


@pytest.fixture
def encrypted_server(store: ReplicaStore, memory: NodeMemoryTier) -> Iterator[ReplicaServer]:
    """A server of a job run with ``--peer-encryption`` (same store and memory as ``server``)."""
    replica_server = ReplicaServer(ENCRYPTED, store, memory, node_id=NODE_ID, io_timeout=IO_TIMEOUT)
    yield replica_server
    replica_server.close()
