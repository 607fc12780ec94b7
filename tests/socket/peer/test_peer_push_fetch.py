"""Tier 2 transfers that go right, over real loopback sockets: push, fetch and held, replicas kept per rank."""

from __future__ import annotations

import socket
import zlib

import pytest

from resilrun.errors import CheckpointNotFoundError
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer, ReplicaStore, fetch, held, push, wire
from resilrun.tiers.peer import client as client_module
from resilrun.tiers.peer import server as server_module
from resilrun.tiers.peer.wire import (
    CHUNK_BYTES,
)
from tests.socket.peer.harness import (
    SECRET,
    SHORT,
    commit_to_memory,
    snapshot,
)

pytestmark = pytest.mark.timeout(30)


def test_push_then_fetch_returns_the_same_bytes_and_values(server: ReplicaServer, store: ReplicaStore) -> None:
    data = snapshot(1)
    values = {"lr": 0.1, "names": ["a", "b"], "nested": {"x": None}}

    push(server.address, SECRET, 3, 7, 4, data, values, timeout=SHORT)

    fetched, fetched_values = fetch(server.address, SECRET, 3, 7, timeout=SHORT)
    assert bytes(fetched) == data
    assert fetched_values == values
    assert store.steps(3) == [7]
    assert store.read(3, 7) == (data, values)
    replica = store.replica(3, 7)
    assert replica is not None and replica.world_size == 4
    # the crc32s are the durable tier's per-tensor ones: the header first, then one per tensor
    assert replica.crcs[0] == zlib.crc32(data[: replica.bounds[1]])


def test_snapshot_larger_than_one_frame_round_trips(server: ReplicaServer) -> None:
    data = snapshot(2, numel=(CHUNK_BYTES * 2 + 12345) // 4)

    push(server.address, SECRET, 0, 1, None, memoryview(data), None, timeout=SHORT)

    assert bytes(fetch(server.address, SECRET, 0, 1, timeout=SHORT)[0]) == data


def test_fetch_serves_a_local_rank_from_node_memory(server: ReplicaServer, memory: NodeMemoryTier) -> None:
    data = snapshot(3)
    commit_to_memory(memory, 5, 12, data, {"epoch": 2})

    fetched, values = fetch(server.address, SECRET, 5, 12, timeout=SHORT)

    assert bytes(fetched) == data
    assert values == {"epoch": 2}


def test_held_lists_replicas_and_local_steps_newest_first(server: ReplicaServer, memory: NodeMemoryTier) -> None:
    commit_to_memory(memory, 0, 4, snapshot(4), None)
    commit_to_memory(memory, 0, 5, snapshot(5), None)
    for step in (1, 2, 3):
        push(server.address, SECRET, 2, step, None, snapshot(step), None, timeout=SHORT)

    assert held(server.address, SECRET, timeout=SHORT) == {"replicas": {2: [3, 2]}, "local": {0: [5, 4]}}


def test_fetch_of_a_step_not_held_raises_not_found(server: ReplicaServer) -> None:
    push(server.address, SECRET, 1, 1, None, snapshot(1), None, timeout=SHORT)

    with pytest.raises(CheckpointNotFoundError):
        fetch(server.address, SECRET, 1, 2, timeout=SHORT)


def test_store_keeps_the_two_newest_replicas_per_rank(server: ReplicaServer, store: ReplicaStore) -> None:
    for step in (10, 11, 12):
        push(server.address, SECRET, 0, step, None, snapshot(step), {"s": step}, timeout=SHORT)

    assert store.steps(0) == [12, 11]
    assert store.read(0, 10) is None
    assert store.held() == {0: [12, 11]}
    assert store.read(0, 11) == (snapshot(11), {"s": 11})


def test_pushing_a_step_again_replaces_the_older_copy(server: ReplicaServer, store: ReplicaStore) -> None:
    push(server.address, SECRET, 0, 1, None, snapshot(1), None, timeout=SHORT)
    push(server.address, SECRET, 0, 2, None, snapshot(2), None, timeout=SHORT)
    push(server.address, SECRET, 0, 2, None, snapshot(20), "again", timeout=SHORT)  # e.g. after a rollback

    assert store.steps(0) == [2]  # step 1's slot took the new copy, the stale copy of 2 was dropped
    assert store.read(0, 2) == (snapshot(20), "again")


@pytest.mark.skipif(wire._rto_floor_option() is None, reason="this kernel has no TCP_RTO_MIN_US (Linux 6.15+)")
def test_both_ends_of_a_transfer_retransmit_a_lost_segment_after_the_lower_floor(
    server: ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lost tail segment or ack would otherwise stall the push (and the commit gate) for 200 ms
    floors = []

    def tuned(sock: socket.socket) -> None:
        wire.tune(sock)
        floors.append(sock.getsockopt(socket.IPPROTO_TCP, wire._rto_floor_option() or 0))

    monkeypatch.setattr(client_module, "tune", tuned)
    monkeypatch.setattr(server_module, "tune", tuned)
    push(server.address, SECRET, 0, 1, None, snapshot(4), None, timeout=SHORT)
    # (the kernel keeps it in clock ticks, so it reads back rounded up to one; its default is 200 ms)
    assert len(floors) == 2 and all(wire.RTO_MIN_US <= floor < 200_000 for floor in floors), floors
