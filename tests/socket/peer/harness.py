"""What the peer-transfer tests share: the job secret, snapshots, raw and authenticated connections,
and a relay that sits on the path between a client and a ReplicaServer (an attacker's position).

Hostile peers are raw sockets speaking just enough of the protocol (``resilrun.tiers.peer.wire``)
to get to the part under test.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta

import torch

from resilrun.snapshot.dedup import layout_hash
from resilrun.snapshot.layout import parse_header
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer
from resilrun.tiers.peer.wire import MAC_BYTES, NONCE_BYTES, Announce, Deadline, PeerKey, Session, client_handshake
from tests.conftest import make_snapshot

SECRET = b"job-secret-" + b"x" * 21
ENCRYPTED = PeerKey(SECRET, encrypt=True)
SHORT = timedelta(seconds=5)
NODE_ID = "node-a"  # what the `server` fixture answers ALIVE with


def snapshot(seed: int, numel: int = 4096) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    return make_snapshot(
        {
            "weight": torch.randn(numel, generator=generator),
            "step": torch.tensor([seed], dtype=torch.int64),
            "mask": torch.zeros(7, dtype=torch.bool),
        }
    )


def commit_to_memory(memory: NodeMemoryTier, rank: int, step: int, data: bytes, values: object, round: int = 0) -> None:
    """Do what a worker does (in generation ``round``): write the slot under its sequence counter, then commit."""
    slot = step % 2
    buffer = memory.allocate(rank, slot, len(data))
    seq = memory.rank(rank).seq
    seq.begin(slot)
    buffer.view()[: len(data)] = data
    seq.end(slot)
    memory.commit(rank, step, slot, len(data), values, layout=layout_hash(data), round=round)


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


def data_offset(announce: Announce) -> int:
    """Where the snapshot's first data byte is in what a client sends on a push: after its nonce and
    proof, the push message (length, JSON body, HMAC), and the first frame's length."""
    body = json.dumps({"op": "push", **announce.to_message()}, separators=(",", ":")).encode()
    return 2 * NONCE_BYTES + 4 + len(body) + MAC_BYTES + 4


def weight_bytes(data: bytes) -> bytes:
    """The bytes of the ``weight`` tensor in a snapshot."""
    view = memoryview(data)
    header = parse_header(view, len(view))
    weight = next(e for e in header.entries if e.name == "weight")
    return data[header.data_start + weight.begin : header.data_start + weight.end]
