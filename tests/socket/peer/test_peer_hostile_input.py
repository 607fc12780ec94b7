"""Hostile input from a peer that holds the secret: absurd sizes, malformed or bad requests,
non-snapshot data and concurrent pushes are refused, and the server keeps serving."""

from __future__ import annotations

import socket
import struct
import time
from datetime import timedelta

import pytest

from resilrun.errors import CheckpointCorruptError, CheckpointError
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer, ReplicaStore, ReplicationError, fetch, held, push
from resilrun.tiers.peer.client import connection, push_view
from resilrun.tiers.peer.wire import (
    Announce,
    Deadline,
    snapshot_bounds,
)
from tests.socket.peer.harness import (
    SECRET,
    SHORT,
    authenticated,
    is_closed_by_peer,
    snapshot,
)

pytestmark = pytest.mark.timeout(30)


def test_an_absurd_size_is_refused_before_anything_is_allocated(server: ReplicaServer, store: ReplicaStore) -> None:
    nbytes = 1 << 60
    with authenticated(server) as session:
        deadline = Deadline.total(5)
        session.send({"op": "push", "rank": 0, "step": 1, "nbytes": nbytes, "bounds": [0, nbytes]}, deadline)
        reply = session.recv(deadline)

    assert reply["ok"] is False and "memory" in reply["error"]
    assert store.held() == {}


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(None, id="message-length-over-the-limit"),
        pytest.param(b"\xff{[}x", id="not-json"),
        pytest.param(b"[]", id="not-an-object"),
        pytest.param(b"[" * 20000, id="deeply-nested"),
    ],
)
def test_malformed_messages_close_the_connection_and_the_server_keeps_serving(
    server: ReplicaServer, payload: bytes | None
) -> None:
    # (from a peer with the secret: the MAC is right, the body is not)
    with authenticated(server) as session:
        session.sock.sendall(struct.pack("<I", 0xFFFFFFFF) if payload is None else session.seal(payload))
        assert is_closed_by_peer(session.sock)

    assert held(server.address, SECRET, timeout=SHORT) == {"replicas": {}, "local": {}}


@pytest.mark.parametrize(
    "request_",
    [
        pytest.param({"op": "push", "rank": -1, "step": 1, "nbytes": 64, "bounds": [0, 64]}, id="negative-rank"),
        pytest.param({"op": "push", "rank": 0, "step": True, "nbytes": 64, "bounds": [0, 64]}, id="bool-step"),
        pytest.param({"op": "push", "rank": 0, "step": 1, "nbytes": 64, "bounds": [0, 80, 64]}, id="bad-bounds"),
        pytest.param({"op": "push", "rank": 0, "step": 1, "nbytes": "64", "bounds": [0, 64]}, id="string-size"),
        pytest.param({"op": "push", "rank": 4, "step": 1, "world_size": 4, "nbytes": 64, "bounds": [0, 64]}, id="ws"),
        pytest.param({"op": "fetch", "rank": "0", "step": 1}, id="fetch-string-rank"),
        pytest.param({"op": "rm -rf"}, id="unknown-op"),
    ],
)
def test_bad_requests_get_an_error_reply(
    server: ReplicaServer, store: ReplicaStore, request_: dict[str, object]
) -> None:
    with authenticated(server) as session:
        deadline = Deadline.total(5)
        session.send(request_, deadline)
        reply = session.recv(deadline)

    assert reply["ok"] is False and reply["error"]
    assert store.held() == {}


def test_data_that_is_not_a_snapshot_is_refused_by_both_ends(server: ReplicaServer, store: ReplicaStore) -> None:
    with pytest.raises(CheckpointCorruptError):
        push(server.address, SECRET, 0, 1, None, b"\x00" * 64, None, timeout=SHORT)
    garbage = struct.pack("<Q", 1 << 40) + b"\x00" * 56  # a header length pointing far past the end
    view = memoryview(garbage)
    announce = Announce(0, 1, None, len(garbage), None, (0, len(garbage)))
    with pytest.raises(ReplicationError, match="not a snapshot"):
        push_view(server.address, SECRET, announce, view, Deadline.total(5))
    assert store.held() == {}


def test_a_second_concurrent_push_for_the_same_rank_is_refused(server: ReplicaServer, store: ReplicaStore) -> None:
    data = snapshot(1)
    with authenticated(server) as session:
        deadline = Deadline.total(5)
        announce = Announce(0, 1, None, len(data), None, snapshot_bounds(memoryview(data)))
        session.send({"op": "push", **announce.to_message()}, deadline)
        assert session.recv(deadline) == {"ok": True}
        with pytest.raises(ReplicationError, match="already being received"):
            push(server.address, SECRET, 0, 2, None, snapshot(2), None, timeout=SHORT)
    assert store.held() == {}


def test_the_server_closes_promptly_with_connections_open(store: ReplicaStore, memory: NodeMemoryTier) -> None:
    replica_server = ReplicaServer(SECRET, store, memory)
    with authenticated(replica_server) as session:
        started = time.monotonic()
        replica_server.close(timeout=timedelta(seconds=3))
        assert time.monotonic() - started < 3
        assert is_closed_by_peer(session.sock)
    with pytest.raises(ReplicationError, match="could not reach"):
        held(replica_server.address, SECRET, timeout=SHORT)


def test_ipv6_loopback_works_where_available(store: ReplicaStore, memory: NodeMemoryTier) -> None:
    try:
        replica_server = ReplicaServer(SECRET, store, memory, host="::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert replica_server.address.startswith("[::1]:")
        push(replica_server.address, SECRET, 0, 1, None, snapshot(1), None, timeout=SHORT)
        assert bytes(fetch(replica_server.address, SECRET, 0, 1, timeout=SHORT)[0]) == snapshot(1)
    finally:
        replica_server.close()


def test_connection_helper_names_the_peer_in_errors() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"  # bound, not listening: refused
    with pytest.raises(ReplicationError, match=address), connection(address, SECRET, Deadline.total(2)):
        pass
    assert issubclass(ReplicationError, CheckpointError)
