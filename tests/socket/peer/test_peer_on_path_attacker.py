"""An attacker on the network path, without the secret (issue 19): forged, edited, replayed,
reordered or reflected messages are refused at the next MAC, and nothing forged is kept.

A Relay between client and server plays the attacker."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import zlib

import pytest

from resilrun.snapshot.layout import parse_header
from resilrun.tiers.peer import ReplicaServer, ReplicaStore, ReplicationError, held, push
from resilrun.tiers.peer.client import push_view
from resilrun.tiers.peer.wire import (
    MAGIC,
    NONCE_BYTES,
    Announce,
    Deadline,
    Session,
    snapshot_bounds,
)
from tests.helpers.forgery import forged_keeping_crc32
from tests.socket.peer.harness import (
    SECRET,
    SHORT,
    Relay,
    data_offset,
    is_closed_by_peer,
    raw_connect,
    snapshot,
)

pytestmark = pytest.mark.timeout(30)


def test_a_replica_forged_on_the_path_with_its_crc32s_kept_is_refused(
    server: ReplicaServer, store: ReplicaStore, caplog: pytest.LogCaptureFixture
) -> None:
    push(server.address, SECRET, 0, 2, None, snapshot(2), "two", timeout=SHORT)
    data = snapshot(3, numel=64 * 1024)
    view = memoryview(data)
    announce = Announce(0, 3, None, len(data), None, snapshot_bounds(view))
    weight = next(e for e in parse_header(view, len(view)).entries if e.name == "weight")
    begin = parse_header(view, len(view)).data_start + weight.begin
    end = begin + weight.end - weight.begin
    forged = forged_keeping_crc32(data[begin:end], edit_at=100, fix_at=200)
    assert forged != data[begin:end] and zlib.crc32(forged) == zlib.crc32(data[begin:end])  # crc32 is blind to it
    start = data_offset(announce) + begin
    edits = {start + i: forged[i] for i in range(len(forged)) if forged[i] != data[begin + i]}
    relay = Relay(server.port, edit_up=edits)
    caplog.set_level(logging.WARNING, logger="resilrun.tiers.peer.server")
    try:
        with pytest.raises(ReplicationError, match="MAC"):
            push_view(relay.address, SECRET, announce, view, Deadline.total(5))
    finally:
        relay.close()

    assert not relay._edits[0]  # every forged byte went through the relay
    assert store.steps(0) == [2] and store.read(0, 2) == (snapshot(2), "two")
    assert any("not kept" in r.getMessage() and "forged" in r.getMessage() for r in caplog.records)


def test_a_request_edited_on_the_path_is_dropped_and_logged(
    server: ReplicaServer, store: ReplicaStore, caplog: pytest.LogCaptureFixture
) -> None:
    data = snapshot(1)
    announce = Announce(0, 1, None, len(data), None, snapshot_bounds(memoryview(data)))
    step_at = json.dumps({"op": "push", **announce.to_message()}, separators=(",", ":")).index('"step":1') + 7
    relay = Relay(server.port, edit_up={2 * NONCE_BYTES + 4 + step_at: ord("9")})  # step 1 -> step 9
    caplog.set_level(logging.WARNING, logger="resilrun.tiers.peer.server")
    try:
        with pytest.raises(ReplicationError):
            push(relay.address, SECRET, 0, 1, None, data, None, timeout=SHORT)
    finally:
        relay.close()

    assert store.held() == {}
    assert any("failed its MAC" in r.getMessage() for r in caplog.records)


def test_a_reply_edited_on_the_path_is_refused_by_the_client(server: ReplicaServer) -> None:
    push(server.address, SECRET, 0, 7, None, snapshot(1), None, timeout=SHORT)
    # the server sends its hello and proof, then the HELD reply: change a digit of it
    reply = json.dumps({"ok": True, **server.describe()}, separators=(",", ":"))
    relay = Relay(server.port, edit_down={len(MAGIC) + 2 * NONCE_BYTES + 4 + reply.index("7"): ord("8")})
    try:
        with pytest.raises(ReplicationError, match="failed its MAC"):
            held(relay.address, SECRET, timeout=SHORT)
    finally:
        relay.close()


def test_a_recorded_push_replayed_later_is_refused(
    server: ReplicaServer, store: ReplicaStore, caplog: pytest.LogCaptureFixture
) -> None:
    relay = Relay(server.port)
    try:
        push(relay.address, SECRET, 0, 1, None, snapshot(1), "old", timeout=SHORT)
    finally:
        relay.close()
    push(server.address, SECRET, 0, 2, None, snapshot(2), "new", timeout=SHORT)
    caplog.set_level(logging.WARNING, logger="resilrun.tiers.peer.server")
    # The attacker sends every byte the client sent, on a new connection: the server's nonce is new,
    # so the recorded proof is not one for it
    with raw_connect(server) as sock:
        sock.recv(len(MAGIC) + NONCE_BYTES)
        with contextlib.suppress(OSError):
            sock.sendall(bytes(relay.sent_up))
        assert is_closed_by_peer(sock)

    assert store.steps(0) == [2, 1]  # both pushes of the job kept, nothing from the replay
    assert store.read(0, 2) == (snapshot(2), "new")
    assert any("did not prove the job secret" in r.getMessage() for r in caplog.records)


def test_a_message_replayed_reordered_or_reflected_within_a_session_is_refused() -> None:
    key, deadline = os.urandom(32), Deadline.total(5)

    def pair() -> tuple[Session, Session, socket.socket]:
        near, far = socket.socketpair()
        sockets.extend((near, far))
        return Session(near, key, server=False), Session(far, key, server=True), near

    sockets: list[socket.socket] = []
    try:
        client, server, wire_ = pair()
        first = client.seal(b'{"n":1}')
        wire_.sendall(first)
        assert server.recv(deadline) == {"n": 1}
        wire_.sendall(first)  # replayed
        with pytest.raises(ReplicationError, match="failed its MAC"):
            server.recv(deadline)
        client, server, wire_ = pair()
        client.seal(b'{"n":1}')
        wire_.sendall(client.seal(b'{"n":2}'))  # the second message before the first
        with pytest.raises(ReplicationError, match="failed its MAC"):
            server.recv(deadline)
        client, server, wire_ = pair()
        server.sock.sendall(Session(wire_, key, server=False).seal(b'{"n":1}'))  # a client's message sent back to it
        with pytest.raises(ReplicationError, match="failed its MAC"):
            client.recv(deadline)
    finally:
        for sock in sockets:
            sock.close()
