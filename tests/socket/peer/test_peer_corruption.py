"""Corruption, aborts and broken streams: a replica counts only once every byte and checksum
arrived; a torn, aborted or corrupted one is never served and never displaces a good one."""

from __future__ import annotations

import struct

import pytest

from resilrun.errors import CheckpointCorruptError
from resilrun.tiers.peer import ReplicaServer, ReplicaStore, ReplicationError, fetch, push
from resilrun.tiers.peer.client import push_view
from resilrun.tiers.peer.wire import (
    CHUNK_BYTES,
    Announce,
    Deadline,
    snapshot_bounds,
)
from tests.conftest import wait_until
from tests.socket.peer.harness import (
    SECRET,
    SHORT,
    Relay,
    authenticated,
    snapshot,
)

pytestmark = pytest.mark.timeout(30)


def test_a_byte_flipped_in_transit_is_rejected_and_the_newest_replica_survives(
    server: ReplicaServer, store: ReplicaStore
) -> None:
    push(server.address, SECRET, 0, 1, None, snapshot(1), None, timeout=SHORT)
    push(server.address, SECRET, 0, 2, None, snapshot(2), "two", timeout=SHORT)
    data = snapshot(3, numel=256 * 1024)
    relay = Relay(server.port, flip_up_at=len(data) // 2)  # well inside the data section
    try:
        with pytest.raises(ReplicationError, match="crc32"):
            push(relay.address, SECRET, 0, 3, None, data, None, timeout=SHORT)
    finally:
        relay.close()

    assert store.steps(0) == [2]  # step 3 went into step 1's slot and never counted
    assert store.read(0, 2) == (snapshot(2), "two")
    assert bytes(fetch(server.address, SECRET, 0, 2, timeout=SHORT)[0]) == snapshot(2)


def test_a_sender_announcing_wrong_checksums_is_rejected(server: ReplicaServer, store: ReplicaStore) -> None:
    data = snapshot(1)
    bounds = snapshot_bounds(memoryview(data))
    with authenticated(server) as session:
        deadline = Deadline.total(5)
        announce = Announce(0, 1, None, len(data), None, bounds)
        session.send({"op": "push", **announce.to_message()}, deadline)
        assert session.recv(deadline) == {"ok": True}
        session.sock.sendall(struct.pack("<I", len(data)) + data + struct.pack("<I", 0))
        mac = session.stream_mac(outgoing=True)  # a sender with the secret: its MAC is right
        mac.update(memoryview(data))
        session.send({"commit": True, "crc32": [0] * (len(bounds) - 1), "mac": mac.tag().hex()}, deadline)
        reply = session.recv(deadline)

    assert reply["ok"] is False and "crc32" in reply["error"]
    assert store.held() == {}


def test_an_aborted_push_is_not_visible(server: ReplicaServer, store: ReplicaStore) -> None:
    data = snapshot(1, numel=(CHUNK_BYTES + 100) // 4)  # two frames: the tear shows after the first
    view = memoryview(data)
    checks = iter([True, False])
    announce = Announce(0, 1, None, len(data), None, snapshot_bounds(view))

    committed = push_view(server.address, SECRET, announce, view, Deadline.total(5), lambda: next(checks, False))

    assert committed is False
    assert store.held() == {}
    push(server.address, SECRET, 0, 1, None, data, None, timeout=SHORT)  # the rank's slot was released
    assert store.steps(0) == [1]


def test_a_truncated_push_is_not_visible_and_the_server_keeps_serving(
    server: ReplicaServer, store: ReplicaStore
) -> None:
    data = snapshot(1)
    with authenticated(server) as session:
        deadline = Deadline.total(5)
        announce = Announce(0, 1, None, len(data), None, snapshot_bounds(memoryview(data)))
        session.send({"op": "push", **announce.to_message()}, deadline)
        assert session.recv(deadline) == {"ok": True}
        session.sock.sendall(struct.pack("<I", len(data)) + data[: len(data) // 2])  # then the sender dies

    def pushed_again() -> bool:
        try:
            push(server.address, SECRET, 0, 2, None, snapshot(2), None, timeout=SHORT)
        except ReplicationError as exc:  # until the server saw the EOF, the rank's transfer is in progress
            assert "already being received" in exc.message
            return False
        return True

    wait_until(pushed_again)
    assert store.steps(0) == [2]


def test_a_server_dying_mid_fetch_raises_and_returns_nothing(server: ReplicaServer) -> None:
    data = snapshot(1, numel=64 * 1024)
    push(server.address, SECRET, 0, 1, None, data, None, timeout=SHORT)
    relay = Relay(server.port, cut_down_at=len(data) // 2)
    try:
        with pytest.raises(ReplicationError, match="closed the connection"):
            fetch(relay.address, SECRET, 0, 1, timeout=SHORT)
    finally:
        relay.close()


def test_a_replica_corrupted_at_rest_fails_the_fetchers_checksum_and_is_dropped(
    server: ReplicaServer, store: ReplicaStore
) -> None:
    push(server.address, SECRET, 0, 1, None, snapshot(1), None, timeout=SHORT)
    opened = store.open(0, 1)
    assert opened is not None
    view, _, _ = opened
    view[len(view) - 3] ^= 0xFF  # a bit flip in the node's memory after the replica was verified
    del view, opened

    with pytest.raises(CheckpointCorruptError, match="crc32"):
        fetch(server.address, SECRET, 0, 1, timeout=SHORT)
    # The server drops the copy once its own checksums fail, which can land just after the
    # fetcher has already raised: wait for it, with a deadline.
    wait_until(lambda: store.steps(0) == [], timeout=10, what="the corrupt replica dropped")
