"""Tier 2 transfers over real loopback sockets: push, fetch, held, authentication and hostile peers.

Every test runs a real ReplicaServer on 127.0.0.1, port 0; hostile peers are raw sockets speaking
just enough of the protocol (``resilrun.tiers.peer.wire``) to get to the part under test.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch

from resilrun.agent.state.replication import PeerTier
from resilrun.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from resilrun.snapshot.dedup import layout_hash
from resilrun.snapshot.layout import parse_header
from resilrun.snapshot.selection import Selection
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer, ReplicaStore, ReplicationError, fetch, held, push
from resilrun.tiers.peer import server as peer_server
from resilrun.tiers.peer.client import connection, push_view
from resilrun.tiers.peer.refs import LocalReferences
from resilrun.tiers.peer.stream import spans
from resilrun.tiers.peer.wire import (
    CHUNK_BYTES,
    MAC_BYTES,
    MAGIC,
    NONCE_BYTES,
    Announce,
    Deadline,
    PeerKey,
    Session,
    client_handshake,
    snapshot_bounds,
)
from tests.conftest import make_snapshot
from tests.helpers.forgery import forged_keeping_crc32

pytestmark = pytest.mark.timeout(30)

SECRET = b"job-secret-" + b"x" * 21
SHORT = timedelta(seconds=5)


def snapshot(seed: int, numel: int = 4096) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    return make_snapshot(
        {
            "weight": torch.randn(numel, generator=generator),
            "step": torch.tensor([seed], dtype=torch.int64),
            "mask": torch.zeros(7, dtype=torch.bool),
        }
    )


def eventually(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError("condition not met before the deadline")
        time.sleep(0.01)


def commit_to_memory(memory: NodeMemoryTier, rank: int, step: int, data: bytes, values: object, round: int = 0) -> None:
    """Do what a worker does (in generation ``round``): write the slot under its sequence counter, then commit."""
    slot = step % 2
    buffer = memory.allocate(rank, slot, len(data))
    seq = memory.rank(rank).seq
    seq.begin(slot)
    buffer.view()[: len(data)] = data
    seq.end(slot)
    memory.commit(rank, step, slot, len(data), values, layout=layout_hash(data), round=round)


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
    replica_server = ReplicaServer(SECRET, store, memory, io_timeout=timedelta(seconds=5))
    yield replica_server
    replica_server.close()


def raw_connect(server: ReplicaServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.settimeout(5)
    return sock


@contextlib.contextmanager
def authenticated(server: ReplicaServer) -> Iterator[Session]:
    """A connection that proved the secret, as its session (messages then carry their MACs)."""
    with raw_connect(server) as sock:
        yield client_handshake(sock, SECRET, Deadline.total(5))


def is_closed_by_peer(sock: socket.socket) -> bool:
    """True when the peer closed (EOF or reset) before the socket timeout."""
    try:
        while True:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


class Relay:
    """A loopback TCP relay on the path between a client and the server (an attacker's position): it
    can flip one byte, rewrite bytes (``edit_up``/``edit_down``: stream offset -> new byte) or cut
    the stream, per direction, at stream offsets, and keeps what the client sent (``sent_up``)."""

    def __init__(
        self,
        upstream_port: int,
        *,
        flip_up_at: int | None = None,
        cut_down_at: int | None = None,
        edit_up: dict[int, int] | None = None,
        edit_down: dict[int, int] | None = None,
    ) -> None:
        self._upstream = upstream_port
        self._flip_up_at = flip_up_at
        self._cut_down_at = cut_down_at
        self._edits = (dict(edit_up or {}), dict(edit_down or {}))
        self.sent_up = bytearray()
        self.sent_down = bytearray()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._run, daemon=True)
        self._accept.start()

    def _run(self) -> None:
        client, _ = self._listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self._upstream), timeout=5)
        for source, sink, flip, cut, edits, kept in (
            (client, upstream, self._flip_up_at, None, self._edits[0], self.sent_up),
            (upstream, client, None, self._cut_down_at, self._edits[1], self.sent_down),
        ):
            args = (source, sink, flip, cut, edits, kept)
            thread = threading.Thread(target=self._pump, args=args, daemon=True)
            thread.start()
            self._threads.append(thread)

    @staticmethod
    def _pump(
        source: socket.socket,
        sink: socket.socket,
        flip: int | None,
        cut: int | None,
        edits: dict[int, int],
        kept: bytearray,
    ) -> None:
        offset = 0
        source.settimeout(10)
        with contextlib.suppress(OSError):
            while chunk := source.recv(1 << 16):
                kept.extend(chunk)
                data = bytearray(chunk)
                if flip is not None and offset <= flip < offset + len(data):
                    data[flip - offset] ^= 0x40
                for at in [at for at in edits if offset <= at < offset + len(data)]:
                    data[at - offset] = edits.pop(at)
                if cut is not None and offset + len(data) >= cut:
                    sink.sendall(data[: cut - offset])
                    break
                sink.sendall(data)
                offset += len(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        self._accept.join(5)
        for thread in self._threads:
            thread.join(5)


# -- the happy paths --------------------------------------------------------------------------------
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


# -- authentication ---------------------------------------------------------------------------------
def test_a_client_with_the_wrong_secret_is_refused_and_nothing_is_stored(
    server: ReplicaServer, store: ReplicaStore
) -> None:
    with pytest.raises(ReplicationError, match="refused our secret"):
        push(server.address, b"another-jobs-secret-0123456789", 0, 1, None, snapshot(1), None, timeout=SHORT)
    with pytest.raises(ReplicationError):
        fetch(server.address, b"another-jobs-secret-0123456789", 0, 1, timeout=SHORT)

    assert store.held() == {}
    push(server.address, SECRET, 0, 1, None, snapshot(1), None, timeout=SHORT)  # still serving the job
    assert store.steps(0) == [1]


def test_a_client_without_the_secret_is_cut_off(server: ReplicaServer, store: ReplicaStore) -> None:
    data = snapshot(1)
    with raw_connect(server) as sock:
        hello = sock.recv(len(MAGIC) + NONCE_BYTES)
        assert hello.startswith(MAGIC)
        # skip the proof and go straight to a request, as a client that knows no secret would
        header = json.dumps({"op": "push", "rank": 0, "step": 1, "nbytes": len(data), "bounds": [0, len(data)]})
        with contextlib.suppress(OSError):
            sock.sendall(b"\0" * (2 * NONCE_BYTES) + struct.pack("<I", len(header)) + header.encode() + data)
        assert is_closed_by_peer(sock)

    assert store.held() == {}


def test_a_silent_client_is_cut_off_after_the_auth_timeout(
    server: ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peer_server, "AUTH_TIMEOUT_S", 0.2)
    with raw_connect(server) as sock:
        started = time.monotonic()
        assert is_closed_by_peer(sock)
        assert time.monotonic() - started < 3


def test_a_client_never_sends_state_to_a_server_without_the_secret() -> None:
    received_after_handshake = bytearray()
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            conn.sendall(MAGIC + os.urandom(NONCE_BYTES))
            answer = b""
            while len(answer) < 2 * NONCE_BYTES:
                answer += conn.recv(2 * NONCE_BYTES - len(answer))
            conn.sendall(os.urandom(NONCE_BYTES))  # a proof it cannot compute
            with contextlib.suppress(OSError):
                while chunk := conn.recv(65536):
                    received_after_handshake.extend(chunk)

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"

    with pytest.raises(ReplicationError, match="could not prove"):
        push(address, SECRET, 0, 1, None, snapshot(1), {"private": True}, timeout=SHORT)

    thread.join(5)
    listener.close()
    assert received_after_handshake == b""


def test_a_non_resilrun_server_is_recognised() -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def http_server() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b" " * 64)

    thread = threading.Thread(target=http_server, daemon=True)
    thread.start()
    with pytest.raises(ReplicationError, match="not a resilrun replica server"):
        held(f"127.0.0.1:{listener.getsockname()[1]}", SECRET, timeout=SHORT)
    thread.join(5)
    listener.close()


def test_a_short_secret_is_a_programmer_error(store: ReplicaStore, memory: NodeMemoryTier) -> None:
    with pytest.raises(ValueError, match="at least"):
        ReplicaServer(b"", store, memory)
    with pytest.raises(ValueError, match="at least"):
        push("127.0.0.1:1", b"short", 0, 1, None, snapshot(1), None)


# -- corruption, aborts and broken streams ----------------------------------------------------------
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


# -- an attacker on the path, without the secret (issue 19) ----------------------------------------
# What the client sends before the snapshot's first data byte: its nonce and proof, the push
# message (length, JSON body, HMAC), and the first frame's length.
def _data_offset(announce: Announce) -> int:
    body = json.dumps({"op": "push", **announce.to_message()}, separators=(",", ":")).encode()
    return 2 * NONCE_BYTES + 4 + len(body) + MAC_BYTES + 4


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
    start = _data_offset(announce) + begin
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

    assert store.steps(0) == [2, 1] or store.steps(0) == [2]
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

    eventually(pushed_again)
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
    deadline = time.monotonic() + 10
    while store.steps(0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.steps(0) == []


# -- hostile input ----------------------------------------------------------------------------------
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


# -- shared segments (DDP state a peer holds itself) ---------------------------------------------------
def _ddp_snapshot(weight: torch.Tensor, own: int) -> bytes:
    """A rank's snapshot: a DDP-equal ``weight`` and per-rank ``rng`` bytes, in one fixed layout."""
    return make_snapshot({"weight": weight, "rng": torch.full((64,), own, dtype=torch.uint8)})


def _shared_announce(data: bytes, rank: int, step: int, round: int = 0) -> Announce:
    view = memoryview(data)
    layout = parse_header(view, len(view))
    weight = next(e for e in layout.entries if e.name == "weight")
    shared = ((layout.data_start + weight.begin, layout.data_start + weight.end),)
    bounds = snapshot_bounds(view)
    return Announce(rank, step, None, len(data), None, bounds, shared, zlib.crc32(layout.header), round)


def test_a_peer_holding_the_step_itself_fills_the_shared_segments_and_only_own_bytes_travel(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    weight = torch.randn(CHUNK_BYTES // 4 + 1000, generator=torch.Generator().manual_seed(3))
    commit_to_memory(memory, 1, 5, _ddp_snapshot(weight, own=1), None)  # the receiving node's own rank
    # What rank 0's sender streams: its own rng bytes, and a weight that must NOT arrive: if the
    # shared segment travelled, the replica would hold these zeros instead of the receiver's weight.
    sent = _ddp_snapshot(torch.zeros_like(weight), own=7)
    announce = _shared_announce(sent, 0, 5)

    assert push_view(server.address, SECRET, announce, memoryview(sent), Deadline.total(5))

    expected = _ddp_snapshot(weight, own=7)
    assert store.steps(0) == [5]
    data, _ = fetch(server.address, SECRET, 0, 5, timeout=SHORT)  # verified against the stored crc32s
    assert bytes(data) == expected


def _weight_range(data: bytes) -> slice:
    layout = parse_header(memoryview(data), len(data))
    weight = next(e for e in layout.entries if e.name == "weight")
    return slice(layout.data_start + weight.begin, layout.data_start + weight.end)


def _push_step_5_by_reference(server: ReplicaServer, memory: NodeMemoryTier, seed: int) -> tuple[torch.Tensor, bytes]:
    """This node's rank 1 commits step 5; rank 0's replica of it arrives with the weight shared
    (the sender's zeros there must never be what the replica holds). Returns (weight, sent)."""
    weight = torch.randn(1000, generator=torch.Generator().manual_seed(seed))
    commit_to_memory(memory, 1, 5, _ddp_snapshot(weight, own=1), None)
    sent = _ddp_snapshot(torch.zeros_like(weight), own=7)
    assert push_view(server.address, SECRET, _shared_announce(sent, 0, 5), memoryview(sent), Deadline.total(5))
    return weight, sent


def test_shared_segments_stay_in_node_memory_until_the_replica_is_read(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    weight, sent = _push_step_5_by_reference(server, memory, seed=8)
    # The replica refers to rank 1's slot for the weight: nothing was copied into its own slot
    replica = store.replica(0, 5)
    assert replica is not None and replica.local is not None
    opened = store.open(0, 5)
    assert opened is not None and not any(bytes(opened[0][_weight_range(sent)]))
    weight_segment = replica.bounds.index(_weight_range(sent).start)
    assert [i for i, crc in enumerate(replica.crcs) if crc is None] == [weight_segment]
    # Reading it copies the weight in first: the bytes and the crc32s are those of the whole snapshot
    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == _ddp_snapshot(weight, own=7)
    assert store.replica(0, 5).local is None  # type: ignore[union-attr]


def test_a_local_commit_copies_referenced_bytes_in_before_their_slot_can_be_rewritten(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    weight, sent = _push_step_5_by_reference(server, memory, seed=9)
    # When rank 1 commits step 6 (its worker may then rewrite step 5's slot) and no newer replica
    # of rank 0 comes, the replica takes its own copy of the weight
    commit_to_memory(memory, 1, 6, _ddp_snapshot(weight + 1, own=1), None)
    replica = store.replica(0, 5)
    assert replica is not None and replica.local is None and None not in replica.crcs  # checksummed at rest
    # Then rank 1 rewriting that slot (step 7) does not touch the replica
    commit_to_memory(memory, 1, 7, _ddp_snapshot(weight + 2, own=1), None)
    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == _ddp_snapshot(weight, own=7)
    # And a bit flipped in the copied-in weight afterwards is caught like any other
    opened = store.open(0, 5)
    assert opened is not None
    opened[0][_weight_range(sent).start + 5] ^= 0xFF
    del opened
    with pytest.raises(CheckpointCorruptError, match="crc32"):
        fetch(server.address, SECRET, 0, 5, timeout=SHORT)


def test_a_newer_replica_arriving_while_the_commit_waits_lets_the_older_one_go(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    weight = torch.randn(1000, generator=torch.Generator().manual_seed(10))
    sent = _ddp_snapshot(torch.zeros_like(weight), own=7)
    commit_to_memory(memory, 1, 4, _ddp_snapshot(weight, own=1), None)
    commit_to_memory(memory, 1, 5, _ddp_snapshot(weight, own=1), None)
    assert push_view(server.address, SECRET, _shared_announce(sent, 0, 5), memoryview(sent), Deadline.total(5))
    time.sleep(1.0)  # this node's steps are ~1 s apart: a commit may wait up to 0.8 s for a newer replica
    committing = threading.Thread(target=commit_to_memory, args=(memory, 1, 6, _ddp_snapshot(weight + 1, own=1), None))
    started = time.monotonic()
    committing.start()
    time.sleep(0.2)
    assert committing.is_alive()  # the commit's answer waits for the replica of step 6...
    assert push_view(server.address, SECRET, _shared_announce(sent, 0, 6), memoryview(sent), Deadline.total(5))
    committing.join(5)
    # ...which arrives, by reference too: the older replica is dropped instead of copied
    assert time.monotonic() - started < 0.8
    assert store.steps(0) == [6]
    assert bytes(fetch(server.address, SECRET, 0, 6, timeout=SHORT)[0]) == _ddp_snapshot(weight + 1, own=7)


def test_a_push_of_a_released_step_copies_the_shared_bytes(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    weight = torch.randn(1000, generator=torch.Generator().manual_seed(11))
    commit_to_memory(memory, 1, 5, _ddp_snapshot(weight, own=1), None)
    commit_to_memory(memory, 1, 6, _ddp_snapshot(weight + 1, own=1), None)  # step 5's slot is released
    sent = _ddp_snapshot(torch.zeros_like(weight), own=7)
    assert push_view(server.address, SECRET, _shared_announce(sent, 0, 5), memoryview(sent), Deadline.total(5))
    assert store.replica(0, 5).local is None  # type: ignore[union-attr]
    commit_to_memory(memory, 1, 7, _ddp_snapshot(weight + 2, own=1), None)
    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == _ddp_snapshot(weight, own=7)


def test_a_slot_reallocated_lets_the_replicas_referring_to_it_copy_their_bytes_first(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    # Rank 0's replica of step 5 refers to rank 1's slot 1 for the weight
    weight, sent = _push_step_5_by_reference(server, memory, seed=13)
    assert store.replica(0, 5).local is not None  # type: ignore[union-attr]
    # When that slot is given up without a commit releasing it first (a bigger snapshot written
    # whole after a recovery needs a bigger buffer), the replica keeps its bytes
    memory.allocate(1, 1, 2 * len(sent))
    assert memory.read(1, 5) is None
    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == _ddp_snapshot(weight, own=7)


def test_a_push_from_a_sender_of_a_superseded_generation_is_refused_and_keeps_the_new_owners_replicas(
    store: ReplicaStore, memory: NodeMemoryTier, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="resilrun.tiers.peer.server")
    # Given a node that follows generation 3, holding the new owner's replica of rank 0 step 7
    generation = 3
    server = ReplicaServer(SECRET, store, memory, io_timeout=timedelta(seconds=5), generation=lambda: generation)

    def push_step(step: int, data: bytes, **fields: int) -> bool:
        announce = Announce(0, step, None, len(data), None, snapshot_bounds(memoryview(data)), **fields)
        return push_view(server.address, SECRET, announce, memoryview(data), Deadline.total(5))

    try:
        fresh = snapshot(70)
        assert push_step(7, fresh, generation=3)
        # When the node that owned rank 0 before (cut off, replaced, back again), which still
        # follows generation 2, pushes its steps, a newer step number among them
        for step in (8, 9, 10):
            with pytest.raises(ReplicationError, match="superseded by generation 3"):
                push_step(step, snapshot(step), generation=2)
        # Then none is kept, the new owner's replica is untouched, and the refusal is said once
        assert store.steps(0) == [7]
        assert bytes(fetch(server.address, SECRET, 0, 7, timeout=SHORT)[0]) == fresh
        said = [r for r in caplog.records if "which follows generation 2" in r.getMessage()]
        assert len([r for r in said if r.levelname == "INFO"]) == 1
        # A survivor's step trained before the recovery counts (it follows the current generation),
        # and so does a push that names no generation (an older sender)
        generation = 4
        assert push_step(11, snapshot(11), round=3, generation=4)
        assert push_step(12, snapshot(12))
        assert store.steps(0) == [12, 11]
    finally:
        server.close()


def test_a_push_still_in_flight_when_its_step_is_released_is_not_published_by_reference(
    memory: NodeMemoryTier, store: ReplicaStore
) -> None:
    refs = LocalReferences(memory, store)
    token = refs.begin(5, 0)
    assert token is not None
    refs.release(5, 0)  # no step interval known yet: no wait, the push is revoked at once
    published: list[bool] = []
    assert not refs.publish(token, lambda: published.append(True)) and not published
    assert refs.begin(5, 0) is None and refs.begin(6, 0) is not None and refs.begin(4, 1) is not None


@pytest.mark.parametrize("local", ["none", "abandoned timeline"])
def test_without_the_same_step_locally_the_peer_takes_every_byte(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier, local: str
) -> None:
    weight = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    if local == "abandoned timeline":  # step 5 of generation 1, rolled back since: not the step 5 being sent
        commit_to_memory(memory, 1, 5, _ddp_snapshot(torch.ones_like(weight), own=1), None, round=1)
        commit_to_memory(memory, 1, 6, _ddp_snapshot(torch.ones_like(weight), own=1), None, round=1)
    sent = _ddp_snapshot(weight, own=7)

    announce = _shared_announce(sent, 0, 5, round=2)
    assert push_view(server.address, SECRET, announce, memoryview(sent), Deadline.total(5))

    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == sent


def test_a_peer_behind_the_pushed_step_waits_once_for_it_then_takes_every_byte(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    weight = torch.randn(1000, generator=torch.Generator().manual_seed(12))
    commit_to_memory(memory, 1, 3, _ddp_snapshot(weight, own=1), None)  # this node's commit of 5 never comes
    sent = _ddp_snapshot(weight + 1, own=7)
    started = time.monotonic()
    assert push_view(server.address, SECRET, _shared_announce(sent, 0, 5), memoryview(sent), Deadline.total(5))
    # One wait for this node's own step 5 (server._SHARED_WAIT_S), not one per way of holding it
    assert time.monotonic() - started < 1.8
    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == sent


def test_a_deduplicated_slot_sends_its_complete_copy_when_the_peer_cannot_fill(
    server: ReplicaServer, store: ReplicaStore
) -> None:
    weight = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    slot_bytes = _ddp_snapshot(torch.zeros_like(weight), own=7)  # borrowed weight not in this slot
    complete = _ddp_snapshot(weight, own=7)

    announce = _shared_announce(slot_bytes, 0, 5)
    view = memoryview(slot_bytes)
    assert push_view(server.address, SECRET, announce, view, Deadline.total(5), whole=lambda: memoryview(complete))

    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == complete


@pytest.mark.parametrize("shared", [[[8, 9]], [[0, 10**9]], "x", [[16, 8]]])
def test_shared_ranges_off_segment_bounds_are_refused(server: ReplicaServer, shared: object) -> None:
    data = snapshot(1)
    announce = Announce(0, 1, None, len(data), None, snapshot_bounds(memoryview(data)))
    with authenticated(server) as session:
        deadline = Deadline.total(5)
        session.send({"op": "push", **announce.to_message(), "shared": shared, "layout": 1}, deadline)
        reply = session.recv(deadline)
    assert reply["ok"] is False and "shared" in reply["error"]


def _push_in_thread(server: ReplicaServer, step: int, generation: int, delay_s: float) -> tuple[threading.Thread, list]:
    """A push of rank 0 ``step`` from a sender following ``generation`` that stalls ``delay_s`` after
    its announce was accepted (a sender cut off mid-push); the list gets its outcome."""
    data = snapshot(step)
    announce = Announce(0, step, None, len(data), None, snapshot_bounds(memoryview(data)), generation=generation)
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(
                push_view(server.address, SECRET, announce, memoryview(data), Deadline.total(20), delay_s=delay_s)
            )
        except (ReplicationError, OSError) as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_stalled_push_of_a_superseded_sender_gives_way_to_the_new_owners_push(
    store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    # Given a node following generation 2 that accepted rank 0's push from its owner, whose bytes
    # then stop coming (the owner was cut off mid-push: the connection stays open, silent)
    generation = 2
    server = ReplicaServer(SECRET, store, memory, io_timeout=timedelta(seconds=20), generation=lambda: generation)
    try:
        stale, outcome = _push_in_thread(server, 7, generation=2, delay_s=6)
        eventually(lambda: any(s.writing for s in store._slots.get(0, [])))
        # When the job moves on to generation 3 and rank 0's new owner pushes its step
        generation = 3
        started = time.monotonic()
        fresh = snapshot(80)
        announce = Announce(0, 8, None, len(fresh), None, snapshot_bounds(memoryview(fresh)), generation=3)
        # Then the new owner's push is taken at once, not refused until the stale one times out,
        assert push_view(server.address, SECRET, announce, memoryview(fresh), Deadline.total(10))
        assert time.monotonic() - started < 3
        # and the stale push is cut off, never published
        stale.join(10)
        assert outcome and outcome[0] is not True, outcome
        assert store.steps(0) == [8]
        assert bytes(fetch(server.address, SECRET, 0, 8, timeout=SHORT)[0]) == fresh
    finally:
        server.close()


def test_a_push_whose_sender_was_superseded_during_the_transfer_is_not_kept(
    store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    # Given a push of rank 0 from its owner, accepted while the node follows the owner's generation (2)
    generation = 2
    server = ReplicaServer(SECRET, store, memory, io_timeout=timedelta(seconds=5), generation=lambda: generation)
    try:
        stale, outcome = _push_in_thread(server, 9, generation=2, delay_s=1.0)
        eventually(lambda: any(s.writing for s in store._slots.get(0, [])))
        # When the node follows generation 3 before the old owner's bytes have all arrived
        generation = 3
        stale.join(10)
        # Then the replica is not kept: its sender no longer owns the rank
        assert isinstance(outcome[0], ReplicationError) and "superseded by generation 3" in str(outcome[0]), outcome
        assert store.steps(0) == []
    finally:
        server.close()


# -- encrypted streams (--peer-encryption) ----------------------------------------------------------
ENCRYPTED = PeerKey(SECRET, encrypt=True)


@pytest.fixture
def encrypted_server(store: ReplicaStore, memory: NodeMemoryTier) -> Iterator[ReplicaServer]:
    replica_server = ReplicaServer(ENCRYPTED, store, memory, io_timeout=timedelta(seconds=5))
    yield replica_server
    replica_server.close()


def _weight_bytes(data: bytes) -> bytes:
    view = memoryview(data)
    header = parse_header(view, len(view))
    weight = next(e for e in header.entries if e.name == "weight")
    return data[header.data_start + weight.begin : header.data_start + weight.end]


def test_encrypted_pushes_and_fetches_carry_no_plaintext_and_arrive_intact(
    encrypted_server: ReplicaServer, store: ReplicaStore
) -> None:
    data = snapshot(5, numel=CHUNK_BYTES // 4 + 1000)  # more than one frame
    relay = Relay(encrypted_server.port)
    try:
        push(relay.address, ENCRYPTED, 0, 5, 4, data, {"v": 1}, timeout=SHORT)
    finally:
        relay.close()
    assert store.read(0, 5) == (data, {"v": 1})
    plain = _weight_bytes(data)
    assert plain[:64] not in relay.sent_up and len(relay.sent_up) > len(data)  # every data byte went, none in clear
    relay = Relay(encrypted_server.port)
    try:
        got, values = fetch(relay.address, ENCRYPTED, 0, 5, timeout=SHORT)
    finally:
        relay.close()
    assert bytes(got) == data and values == {"v": 1}
    assert plain[:64] not in relay.sent_down and len(relay.sent_down) > len(data)


def test_a_ciphertext_byte_changed_on_the_path_is_refused(
    encrypted_server: ReplicaServer, store: ReplicaStore, caplog: pytest.LogCaptureFixture
) -> None:
    data = snapshot(6, numel=64 * 1024)
    view = memoryview(data)
    announce = Announce(0, 6, None, len(data), None, snapshot_bounds(view))
    relay = Relay(encrypted_server.port, flip_up_at=_data_offset(announce) + len(data) // 2)
    caplog.set_level(logging.WARNING, logger="resilrun.tiers.peer.server")
    try:
        with pytest.raises(ReplicationError, match="MAC|crc32"):
            push_view(relay.address, ENCRYPTED, announce, view, Deadline.total(5))
    finally:
        relay.close()
    assert store.held() == {}


@pytest.mark.parametrize("client_encrypts", [True, False])
def test_nodes_that_disagree_on_encryption_say_so(
    server: ReplicaServer, encrypted_server: ReplicaServer, store: ReplicaStore, client_encrypts: bool
) -> None:
    target = server if client_encrypts else encrypted_server
    key = ENCRYPTED if client_encrypts else SECRET
    with pytest.raises(ReplicationError, match="give every node the same --peer-encryption"):
        push(target.address, key, 0, 1, None, snapshot(1), None, timeout=SHORT)
    assert store.held() == {}


def test_the_encryption_cannot_be_stripped_by_rewriting_the_servers_hello(
    encrypted_server: ReplicaServer, store: ReplicaStore
) -> None:
    # An on-path party makes the encrypting server look like a plain one to a plain client: the
    # mode is bound into the session key, so the first message fails its MAC and nothing is kept.
    edits = {i: MAGIC[i] for i in range(len(MAGIC))}
    relay = Relay(encrypted_server.port, edit_down=edits)
    try:
        with pytest.raises(ReplicationError):
            push(relay.address, SECRET, 0, 1, None, snapshot(1), None, timeout=SHORT)
    finally:
        relay.close()
    assert store.held() == {}


# -- ranged fetches (a rank resuming at another world size) -----------------------------------------
def _rows_snapshot(rows: int = 2048, cols: int = 512) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    weight, bias = torch.randn(rows, cols, generator=generator), torch.randn(rows, generator=generator)
    return make_snapshot({"w": weight, "b": bias}), weight, bias


def _sparse(size: int) -> memoryview:
    return memoryview(mmap.mmap(-1, max(size, 1)))[:size]


def _tensor_in(buffer: memoryview, name: str) -> torch.Tensor:
    layout = parse_header(buffer, len(buffer))
    entry = next(e for e in layout.entries if e.name == name)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)[layout.data_start + entry.begin : layout.data_start + entry.end]
    return raw.view(torch.float32).view(entry.shape)


@pytest.mark.parametrize("held_as", ["replica", "local"])
def test_a_ranged_fetch_moves_only_the_selected_rows(
    server: ReplicaServer, memory: NodeMemoryTier, held_as: str
) -> None:
    data, weight, bias = _rows_snapshot()
    if held_as == "replica":
        push(server.address, SECRET, 2, 9, 3, data, {"k": 1}, timeout=SHORT)
    else:
        commit_to_memory(memory, 2, 9, data, {"k": 1})
    select = Selection({"w": (100, 164)})
    wanted = select.ranges(parse_header(data, len(data)))

    buffer, values = fetch(server.address, SECRET, 2, 9, SHORT, select=select, into=_sparse)

    assert values == {"k": 1}
    assert torch.equal(_tensor_in(buffer, "w")[100:164], weight[100:164])
    outside = spans(len(data), wanted)
    assert all(not any(buffer[b:e]) for b, e in outside)  # nothing else arrived
    assert sum(e - b for b, e in wanted) < len(data) // 20
    whole, _ = fetch(server.address, SECRET, 2, 9, SHORT, select=Selection(rest=True), into=_sparse)
    assert torch.equal(_tensor_in(whole, "b"), bias) and bytes(whole) == data


def test_a_replica_corrupted_at_rest_is_refused_to_a_ranged_fetch_and_dropped(
    server: ReplicaServer, store: ReplicaStore
) -> None:
    data, _, _ = _rows_snapshot()
    push(server.address, SECRET, 0, 1, None, data, None, timeout=SHORT)
    opened = store.open(0, 1)
    assert opened is not None
    view, _, _ = opened
    layout = parse_header(data, len(data))
    w = next(e for e in layout.entries if e.name == "w")
    view[layout.data_start + w.end - 3] ^= 0xFF  # in a row the fetch does not ask for
    del view, opened

    with pytest.raises(CheckpointNotFoundError, match="corrupt"):
        fetch(server.address, SECRET, 0, 1, SHORT, select=Selection({"w": (0, 4)}), into=_sparse)
    assert store.steps(0) == []


def test_a_peer_sending_other_bytes_than_asked_is_refused(
    server: ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, _, _ = _rows_snapshot()
    push(server.address, SECRET, 0, 1, None, data, None, timeout=SHORT)
    # A server that honours a different selection than the one asked for (a defect or a lie).
    real = Selection.ranges
    monkeypatch.setattr(
        peer_server,
        "Selection",
        type("Other", (Selection,), {"ranges": lambda self, layout: real(Selection(rest=True), layout)}),
    )

    with pytest.raises(ReplicationError, match="other bytes"):
        fetch(server.address, SECRET, 0, 1, SHORT, select=Selection({"w": (0, 4)}), into=_sparse)


def test_a_node_restoring_a_rank_whose_replica_it_holds_itself_reads_its_own_copy() -> None:
    # A node of a job that shrank after losing a host can be the one holding that host's replica
    # and the one whose new rank needs it (which node takes which node rank depends on join order)
    memories = [NodeMemoryTier(f"self-fetch-{uuid.uuid4().hex[:6]}") for _ in range(2)]
    tiers: list[PeerTier] = []
    peers = lambda me: [t.address for t in tiers if t is not me]  # noqa: E731
    for index, memory in enumerate(memories):
        tier = PeerTier(
            memory, SECRET, "self-fetch", f"node-{index}", "127.0.0.1", targets=list,
            peers=lambda index=index: peers(tiers[index]), world_size=lambda: 3, generation=lambda: -1,
        )  # fmt: skip
        tiers.append(tier)
    try:
        data, weight, _ = _rows_snapshot()
        push(tiers[1].address, SECRET, 1, 4, 3, data, {"world_size": 3}, timeout=SHORT)

        found = tiers[1].fetch(1, 4)
        assert found is not None and bytes(found[0]) == data
        part = tiers[1].fetch(1, 4, Selection({"w": (0, 2)}), _sparse)
        assert part is not None and torch.equal(_tensor_in(part[0], "w")[:2], weight[:2])
    finally:
        for tier in tiers:
            tier.close()
        for memory in memories:
            memory.close()
