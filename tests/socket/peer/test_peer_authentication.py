"""Only holders of the job secret move state: a peer without it is refused or cut off, and a client
sends nothing to a server that cannot prove it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time

import pytest

from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer, ReplicaStore, ReplicationError, fetch, held, push
from resilrun.tiers.peer import server as peer_server
from resilrun.tiers.peer.wire import (
    MAGIC,
    NONCE_BYTES,
)
from tests.socket.peer.harness import (
    SECRET,
    SHORT,
    is_closed_by_peer,
    raw_connect,
    snapshot,
)

pytestmark = pytest.mark.timeout(30)


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
