"""``--peer-encryption`` keeps everything a snapshot carries confidential, at any size (issue 43, F15).

(a) AES-GCM under one key and nonce encrypts at most 2^32 - 2 blocks (64 GiB): a longer stream
failed with the cryptography library's bare ValueError. Streams are re-keyed every
``wire.REKEY_BYTES``; the tests scale the library's limit and the re-key size down together.
(b) The values tree (a snapshot's non-tensor state, JSON in the announce) went in clear while the
tensors were encrypted: every control message is now encrypted too.

Real sockets on loopback, with a relay on the path that keeps what crossed it.
"""

from __future__ import annotations

import logging

import pytest
from cryptography.hazmat.primitives.ciphers import modes

from resilrun.tiers.peer import ReplicaServer, ReplicaStore, ReplicationError, fetch, held, push, wire
from resilrun.tiers.peer.client import push_view
from resilrun.tiers.peer.wire import CHUNK_BYTES, MAGIC, Announce, Deadline, snapshot_bounds
from tests.socket.peer.harness import ENCRYPTED, SECRET, SHORT, Relay, data_offset, snapshot, weight_bytes

pytestmark = pytest.mark.timeout(30)

MARKER = "values-tree-marker-5c1e9b7d"  # appears nowhere else on the wire
# The library's 64 GiB limit scaled down 65,536 times, and a re-key size under it that falls
# neither on a frame nor on an AES block boundary.
SCALED_LIMIT = 1 << 20
SCALED_REKEY = SCALED_LIMIT - 1000


@pytest.fixture
def scaled_gcm_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AES-GCM per-key limit as the library enforces it, scaled down, and the re-key size under it.

    ``raising=False``: on code without re-keying the stream then meets the library's limit, which
    is the failure this guards against."""
    monkeypatch.setattr(modes.GCM, "_MAX_ENCRYPTED_BYTES", SCALED_LIMIT)
    monkeypatch.setattr(wire, "REKEY_BYTES", SCALED_REKEY, raising=False)


def relayed(encrypted_server: ReplicaServer) -> Relay:
    return Relay(encrypted_server.port)


def test_the_values_tree_never_crosses_the_wire_in_clear(encrypted_server: ReplicaServer, store: ReplicaStore) -> None:
    data = snapshot(3)
    values = {"note": MARKER, "sampler": {"epoch": 2, "seed": MARKER + "-seed"}}
    relay = relayed(encrypted_server)
    try:
        push(relay.address, ENCRYPTED, 0, 3, 4, data, values, timeout=SHORT)
    finally:
        relay.close()
    assert store.read(0, 3) == (data, values)
    assert MARKER.encode() not in relay.sent_up and b'"sampler"' not in relay.sent_up
    relay = relayed(encrypted_server)
    try:
        got, fetched = fetch(relay.address, ENCRYPTED, 0, 3, timeout=SHORT)
        listing = held(encrypted_server.address, ENCRYPTED, timeout=SHORT)
    finally:
        relay.close()
    assert bytes(got) == data and fetched == values and listing["replicas"] == {0: [3]}
    assert MARKER.encode() not in relay.sent_down and b'"sampler"' not in relay.sent_down


@pytest.mark.usefixtures("scaled_gcm_limit")
def test_an_encrypted_stream_longer_than_the_gcm_limit_is_rekeyed_and_arrives_intact(
    encrypted_server: ReplicaServer, store: ReplicaStore
) -> None:
    data = snapshot(5, numel=(CHUNK_BYTES + 5 * SCALED_LIMIT) // 4)  # frames and re-keys at different places
    assert len(data) > 5 * SCALED_LIMIT
    relay = relayed(encrypted_server)
    try:
        push(relay.address, ENCRYPTED, 0, 5, 4, data, {"v": 1}, timeout=SHORT)
    finally:
        relay.close()
    assert store.read(0, 5) == (data, {"v": 1})
    assert weight_bytes(data)[-64:] not in relay.sent_up  # the last segment is encrypted too
    got, values = fetch(encrypted_server.address, ENCRYPTED, 0, 5, timeout=SHORT)
    assert bytes(got) == data and values == {"v": 1}


@pytest.mark.usefixtures("scaled_gcm_limit")
def test_a_ciphertext_byte_changed_after_a_rekey_is_refused(
    encrypted_server: ReplicaServer, store: ReplicaStore
) -> None:
    data = snapshot(6, numel=3 * SCALED_LIMIT // 4)
    view = memoryview(data)
    announce = Announce(0, 6, None, len(data), None, snapshot_bounds(view))
    relay = Relay(encrypted_server.port, flip_up_at=data_offset(announce) + 2 * SCALED_REKEY + 123)
    try:
        with pytest.raises(ReplicationError, match="MAC|crc32"):
            push_view(relay.address, ENCRYPTED, announce, view, Deadline.total(5))
    finally:
        relay.close()
    assert store.held() == {}


@pytest.mark.usefixtures("scaled_gcm_limit")
def test_a_trailer_with_a_tag_dropped_or_two_tags_swapped_is_refused() -> None:
    key, nonce = bytes(32), bytes(12)
    plain = memoryview(bytes(range(256)) * (3 * SCALED_REKEY // 256))  # three segments
    sender = wire.StreamCipher(key, nonce, outgoing=True)
    cipher = sender.seal(plain, memoryview(bytearray(len(plain))))
    tags = sender.tag()
    assert len(tags) == 3 * wire.TAG_BYTES

    def receives(trailer: bytes) -> bool:
        receiver = wire.StreamCipher(key, nonce, outgoing=False)
        received = bytearray(cipher)
        receiver.open(memoryview(received))
        return receiver.verify(trailer) and bytes(received) == bytes(plain)

    t = wire.TAG_BYTES
    assert receives(tags)
    assert not receives(tags[:-t])
    assert not receives(tags[t : 2 * t] + tags[:t] + tags[2 * t :])


# -- pushes and fetches, on-path edits, nodes that disagree on the mode -----------------------------
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
    plain = weight_bytes(data)
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
    relay = Relay(encrypted_server.port, flip_up_at=data_offset(announce) + len(data) // 2)
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
