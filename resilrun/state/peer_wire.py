"""The peer-replica wire protocol: mutual authentication, framing, and checksummed snapshot streams.

One request per TCP connection, after a mutual challenge-response on the job's secret::

    server -> client   MAGIC, server nonce (32 bytes)
    client -> server   client nonce (32), HMAC-SHA256(secret, "client" | server nonce | client nonce)
    server -> client   HMAC-SHA256(secret, "server" | server nonce | client nonce)   (only if the client proved it)
    client -> server   request: a JSON message {"op": "push" | "fetch" | "held", ...}

A snapshot travels as an announce message (rank, step, world size, nbytes, values, segment bounds),
then data frames (u32 length + bytes; a zero length ends the data), then a trailer message:
``{"commit": true, "crc32": [...]}`` with one crc32 per segment, or ``{"commit": false}`` (ABORT)
when the sender's source was overwritten meanwhile. Segments are the safetensors header and each
tensor, so a replica's crc32s are the same numbers the durable tier's manifests record.

An announce may name *shared* segments (DDP's parameters and optimizer state, equal on every rank)
with the snapshot's layout and generation. A receiver whose own ranks hold the same step of the
same generation in the same layout copies them from its node memory and answers ``filled``; the
sender then leaves those segments out of the stream (null crc32s in the trailer) and the receiver
hashes its own copy of them, so the replica is complete, with every crc32, either way. The crc32s
ride in the trailer rather than the announce so that each end reads the bytes once, hashing them
(on a helper thread) while they move; the receiver verifies before anything becomes visible.

Invariants: nothing but fixed-size reads happens before the peer proved the secret; every socket
operation runs under a deadline; every size a peer announces is checked before anything is
allocated for it; the role labels in the HMACs stop a client's proof from being replayed as a
server's (a reflection attack), so a client never sends state to a peer that lacks the secret.
Not covered (would need TLS): confidentiality, and an on-path attacker who edits an authenticated
stream (crc32 detects accidents, not forgeries).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeGuard

from resilrun.errors import CheckpointCorruptError, CheckpointError
from resilrun.state._crc import crc32
from resilrun.state.layout import parse_header

MAGIC = b"RSLRPR01"
NONCE_BYTES = 32
MIN_SECRET_BYTES = 16
# Snapshot data moves in frames of this size: measured here, 4 MiB sendall/recv_into calls reach
# ~3.3 GB/s on loopback vs ~2 GB/s at 1 MiB, and a frame is still small enough to crc while cached.
CHUNK_BYTES = 4 * 1024 * 1024
# Control messages carry values trees (KBs) and segment bounds (one int per tensor): refuse absurd ones.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_SEGMENTS = 1 << 20
# Frames the hashing helper may lag behind the one being moved before the mover waits for it. Deep
# enough that on a busy machine the mover rarely blocks on a descheduled helper (each wake-up then
# costs a scheduler slice); the lag costs no memory, the frames are views of the source or target.
_PIPELINE_DEPTH = 8
_LEN = struct.Struct("<I")
_MSG_MORE = getattr(socket, "MSG_MORE", 0)


class ReplicationError(CheckpointError):
    """A replica could not be sent or fetched: peer unreachable, refused, unauthenticated or aborted."""


# -- deadlines --------------------------------------------------------------------------------------
class Deadline:
    """The time budget of a socket conversation: a total deadline, or an idle timeout per operation.

    Clients know how long a whole transfer may take (``total``); a server cannot, so it bounds
    each operation instead (``idle``), which still turns a silent peer into an error.
    """

    def __init__(self, seconds: float, *, total: bool) -> None:
        self._seconds = seconds
        self._end = time.monotonic() + seconds if total else None

    @classmethod
    def total(cls, seconds: float) -> Deadline:
        return cls(seconds, total=True)

    @classmethod
    def idle(cls, seconds: float) -> Deadline:
        return cls(seconds, total=False)

    def left(self) -> float:
        """Seconds the next operation may take; raises TimeoutError once the budget is spent."""
        if self._end is None:
            return self._seconds
        left = self._end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"deadline of {self._seconds:.1f} s passed")
        return left

    def apply(self, sock: socket.socket) -> None:
        """Set the socket timeout for the next operation (see ``left``)."""
        sock.settimeout(self.left())


# -- addresses --------------------------------------------------------------------------------------
def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6host]:port`` -> (host, port).

    Raises:
        ValueError: not of that form.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer address {address!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


# -- raw I/O ----------------------------------------------------------------------------------------
def recv_exact(sock: socket.socket, count: int, deadline: Deadline) -> bytes:
    buffer = bytearray(count)
    recv_into_exact(sock, memoryview(buffer), deadline)
    return bytes(buffer)


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: Deadline) -> None:
    offset, count = 0, len(view)
    while offset < count:
        deadline.apply(sock)
        received = sock.recv_into(view[offset:])
        if received == 0:
            raise ReplicationError(f"peer closed the connection after {offset} of {count} bytes")
        offset += received


def send_message(sock: socket.socket, message: dict[str, Any], deadline: Deadline) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ReplicationError(f"message of {len(body)} bytes exceeds the {MAX_MESSAGE_BYTES} byte limit")
    deadline.apply(sock)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_message(sock: socket.socket, deadline: Deadline) -> dict[str, Any]:
    """One JSON object message; its size is checked before anything is allocated for it."""
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
    if length > MAX_MESSAGE_BYTES:
        raise ReplicationError(f"peer announced a {length} byte message (limit {MAX_MESSAGE_BYTES})")
    raw = recv_exact(sock, length, deadline)
    try:
        message = json.loads(raw)
    # ValueError: bad UTF-8/JSON or an integer over Python's digit limit; RecursionError: deep nesting.
    except (ValueError, RecursionError) as exc:
        raise ReplicationError(f"malformed message from peer ({type(exc).__name__})") from None
    if not isinstance(message, dict):
        raise ReplicationError("malformed message from peer: not a JSON object")
    return message


# -- authentication ---------------------------------------------------------------------------------
def check_secret(secret: bytes) -> None:
    """Raises ValueError for a secret too short to authenticate anyone (a programmer error)."""
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the job secret must be at least {MIN_SECRET_BYTES} bytes")


def _proof(secret: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, role + server_nonce + client_nonce, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, secret: bytes, deadline: Deadline) -> bool:
    """Challenge the client; True when it proved the secret (then the server proved it back)."""
    server_nonce = os.urandom(NONCE_BYTES)
    deadline.apply(sock)
    sock.sendall(MAGIC + server_nonce)
    answer = recv_exact(sock, 2 * NONCE_BYTES, deadline)
    client_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _proof(secret, b"client", server_nonce, client_nonce)):
        return False
    deadline.apply(sock)
    sock.sendall(_proof(secret, b"server", server_nonce, client_nonce))
    return True


def client_handshake(sock: socket.socket, secret: bytes, deadline: Deadline) -> None:
    """Prove the secret and make the server prove it too, before any state is sent.

    Raises:
        ReplicationError: the peer is not a resilrun peer, refused us, or could not prove the secret.
    """
    hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if hello[: len(MAGIC)] != MAGIC:
        raise ReplicationError("the peer is not a resilrun replica server")
    server_nonce, client_nonce = hello[len(MAGIC) :], os.urandom(NONCE_BYTES)
    deadline.apply(sock)
    sock.sendall(client_nonce + _proof(secret, b"client", server_nonce, client_nonce))
    try:
        proof = recv_exact(sock, NONCE_BYTES, deadline)
    except ReplicationError:
        raise ReplicationError("the peer refused our secret (the job secrets differ)") from None
    if not hmac.compare_digest(proof, _proof(secret, b"server", server_nonce, client_nonce)):
        raise ReplicationError("the peer could not prove the job secret: not sending it anything")


# -- snapshot announce and segments -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Announce:
    """What a snapshot stream carries besides its bytes (validated; see ``parse_announce``)."""

    rank: int
    step: int
    world_size: int | None
    nbytes: int
    values: Any
    bounds: tuple[int, ...]  # segment i is bytes [bounds[i], bounds[i + 1])
    # Whole segments that are equal on every rank of the job (DDP's parameters and optimizer
    # state): a receiver whose own ranks hold the same step in the same layout fills them from
    # its node memory, and the sender leaves them out of the stream.
    shared: tuple[tuple[int, int], ...] = ()
    layout: int = 0  # crc32 of the snapshot's header: "the same layout" above
    round: int = -1  # the generation the step was trained in: "the same step" above

    def to_message(self) -> dict[str, Any]:
        message = {
            "rank": self.rank,
            "step": self.step,
            "world_size": self.world_size,
            "nbytes": self.nbytes,
            "values": self.values,
            "bounds": list(self.bounds),
        }
        if self.shared:
            message.update(shared=[list(r) for r in self.shared], layout=self.layout, round=self.round)
        return message


def _is_int(value: Any, minimum: int = 0) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def parse_announce(message: dict[str, Any]) -> Announce:
    """Validate a peer's announce message.

    Raises:
        ReplicationError: a field is missing, of the wrong type, out of range or inconsistent.
    """
    rank, step, world_size = message.get("rank"), message.get("step"), message.get("world_size")
    nbytes, bounds = message.get("nbytes"), message.get("bounds")
    if not _is_int(rank) or not _is_int(step):
        raise ReplicationError(f"bad rank or step in announce: {rank!r}, {step!r}")
    if world_size is not None and not (_is_int(world_size, 1) and rank < world_size):
        raise ReplicationError(f"bad world size {world_size!r} for rank {rank}")
    if not _is_int(nbytes, 8):
        raise ReplicationError(f"bad snapshot size {nbytes!r}")
    if (
        not isinstance(bounds, list)
        or not 2 <= len(bounds) <= MAX_SEGMENTS + 1
        or not all(_is_int(b) for b in bounds)
        or bounds[0] != 0
        or bounds[-1] != nbytes
        or not all(a < b for a, b in zip(bounds, bounds[1:], strict=False))
    ):
        raise ReplicationError("bad segment bounds in announce")
    shared = _parse_shared(message.get("shared", []), bounds)
    layout, round_ = message.get("layout", 0), message.get("round", -1)
    if not _is_int(layout) or not _is_int(round_, -1):
        raise ReplicationError(f"bad layout or round in announce: {layout!r}, {round_!r}")
    return Announce(rank, step, world_size, nbytes, message.get("values"), tuple(bounds), shared, layout, round_)


def _parse_shared(raw: Any, bounds: list[int]) -> tuple[tuple[int, int], ...]:
    """Shared ranges: sorted, disjoint, non-empty, on segment bounds (so whole segments are skipped)."""
    cuts = set(bounds)
    if not isinstance(raw, list) or len(raw) > MAX_SEGMENTS:
        raise ReplicationError("bad shared ranges in announce")
    ranges: list[tuple[int, int]] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and all(_is_int(v) for v in item)):
            raise ReplicationError("bad shared ranges in announce")
        begin, end = item
        if begin >= end or begin not in cuts or end not in cuts or (ranges and begin < ranges[-1][1]):
            raise ReplicationError(f"shared range {item} is not on segment bounds, in order and disjoint")
        ranges.append((begin, end))
    return tuple(ranges)


def spans(total: int, skip: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges of [0, total) outside ``skip`` (sorted, disjoint): what a stream carries."""
    found, position = [], 0
    for begin, end in skip:
        if begin > position:
            found.append((position, begin))
        position = max(position, end)
    if position < total:
        found.append((position, total))
    return found


def snapshot_bounds(view: memoryview) -> tuple[int, ...]:
    """Segment bounds of a snapshot: its safetensors header, each tensor, and any bytes between.

    Raises:
        CheckpointCorruptError: the bytes are not a snapshot.
    """
    layout = parse_header(view, len(view))
    start = layout.data_start
    cuts = {0, start, len(view)}
    for entry in layout.entries:
        cuts.update((start + entry.begin, start + entry.end))
    return tuple(sorted(cuts))


def check_snapshot(view: memoryview) -> None:
    """Raises CheckpointCorruptError unless the received bytes parse as a snapshot."""
    parse_header(view, len(view))


class Checksums:
    """Per-segment crc32, fed the stream's bytes in order (crc32 releases the GIL)."""

    def __init__(self, bounds: Sequence[int]) -> None:
        self._bounds = bounds
        self._crc = 0
        self._position = 0
        self._skipped = False
        self.values: list[int | None] = []  # None: a segment (partly) skipped, not hashed

    def update(self, piece: memoryview) -> None:
        self._advance(len(piece), piece)

    def skip(self, count: int) -> None:
        self._advance(count, None)

    def _advance(self, count: int, piece: memoryview | None) -> None:
        start = 0
        while start < count:
            segment_end = self._bounds[len(self.values) + 1]
            take = min(count - start, segment_end - self._position)
            if piece is None:
                self._skipped = True
            else:
                self._crc = crc32(piece[start : start + take], self._crc)
            start += take
            self._position += take
            if self._position == segment_end:
                self.values.append(None if self._skipped else self._crc)
                self._crc, self._skipped = 0, False


class _Hasher:
    """Checksums computed on a helper thread while the caller moves the next frame.

    Why: a crc32 pass costs about as much CPU as the socket copy; done in line, each side stops
    moving bytes while it hashes and the two ends run in lock-step. Pipelined, hashing frame i
    overlaps moving frame i + 1 (crc32, sendall and recv_into all release the GIL). Frames are
    hashed in order (one helper), at most ``_PIPELINE_DEPTH`` frames behind.
    """

    def __init__(self, bounds: Sequence[int], total: int) -> None:
        self.sums = Checksums(bounds)
        pipelined = total > CHUNK_BYTES  # one frame: nothing to overlap with
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="resilrun-crc") if pipelined else None
        self._pending: deque[Future[None]] = deque()

    def __enter__(self) -> _Hasher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def feed(self, piece: memoryview) -> None:
        self._submit(self.sums.update, piece)

    def skip(self, count: int) -> None:
        """Bytes left out of the stream: their segments get no crc32 (None)."""
        self._submit(self.sums.skip, count)

    def _submit(self, work: Callable[[Any], None], arg: Any) -> None:
        if self._pool is None:
            work(arg)
            return
        self._pending.append(self._pool.submit(work, arg))
        while len(self._pending) > _PIPELINE_DEPTH:
            self._pending.popleft().result()

    def finish(self) -> list[int | None]:
        """Every fed byte is hashed (and no longer read) once this returns."""
        while self._pending:
            self._pending.popleft().result()
        return self.sums.values


# -- snapshot streams -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Sent:
    committed: bool  # False: the source changed while it was read and ABORT went instead of COMMIT
    crcs: tuple[int | None, ...]  # what the bytes sent hash to (None: skipped; empty when aborted)


def send_snapshot(
    sock: socket.socket,
    deadline: Deadline,
    view: memoryview,
    bounds: Sequence[int],
    is_intact: Callable[[], bool] | None = None,
    stored_crcs: Sequence[int] | None = None,
    skip: Sequence[tuple[int, int]] = (),
) -> Sent:
    """Stream ``view`` as data frames, then COMMIT with the crc32s, or ABORT when it was torn.

    Args:
        is_intact: the source's seqlock check, asked before every frame and after the last one.
        stored_crcs: crcs recorded when the bytes were received (a replica); they are sent instead of
            the ones computed now, so that bytes corrupted at rest fail the receiver's check.
        skip: whole segments the receiver fills itself (``Announce.shared``): not sent, not
            hashed, null in the trailer.
    """
    with _Hasher(bounds, len(view)) as hasher:
        position = 0
        for begin, end in spans(len(view), skip):
            if begin > position:
                hasher.skip(begin - position)
            for offset in range(begin, end, CHUNK_BYTES):
                if is_intact is not None and not is_intact():
                    hasher.finish()
                    return _abort(sock, deadline)
                piece = view[offset : min(offset + CHUNK_BYTES, end)]
                hasher.feed(piece)
                deadline.apply(sock)
                sock.sendall(_LEN.pack(len(piece)), _MSG_MORE)
                sock.sendall(piece)
            position = end
        if position < len(view):
            hasher.skip(len(view) - position)
        computed = hasher.finish()  # before the last check: the helper reads the source too
    if is_intact is not None and not is_intact():
        return _abort(sock, deadline)
    deadline.apply(sock)
    sock.sendall(_LEN.pack(0), _MSG_MORE)
    crcs = list(stored_crcs) if stored_crcs is not None and not skip else computed
    send_message(sock, {"commit": True, "crc32": crcs}, deadline)
    return Sent(True, tuple(computed))


def _abort(sock: socket.socket, deadline: Deadline) -> Sent:
    deadline.apply(sock)
    sock.sendall(_LEN.pack(0), _MSG_MORE)
    send_message(sock, {"commit": False, "reason": "the source was overwritten while it was sent"}, deadline)
    return Sent(False, ())


@dataclass(frozen=True, slots=True)
class Received:
    problem: str | None  # None: committed, complete, every crc32 matched, and the bytes parse as a snapshot
    crcs: tuple[int, ...]  # the verified crc32s, one per segment (empty unless problem is None)
    aborted: bool = False  # the sender sent ABORT: its source changed (expected, not an error)


def receive_snapshot(
    sock: socket.socket,
    deadline: Deadline,
    into: memoryview,
    bounds: Sequence[int],
    filled: Sequence[tuple[int, int]] = (),
) -> Received:
    """Receive data frames straight into ``into`` and check the trailer.

    Args:
        filled: ranges of ``into`` the receiver already wrote itself (the announce's shared
            segments, from its own node memory): the stream leaves them out; they are hashed here
            so that the replica's crc32s cover every segment.

    Returns:
        The verified crc32s, or why the bytes do not count (an ABORT, a short stream, a checksum
        mismatch naming the segment, bytes that are not a snapshot).

    Raises:
        ReplicationError, OSError: the stream broke the protocol, closed or timed out.
    """
    total = len(into)
    todo = spans(total, filled)
    expected_bytes = sum(end - begin for begin, end in todo)
    offset, received = 0, 0
    computed: list[int | None] = []
    with _Hasher(bounds, total) as hasher:
        while True:
            (length,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
            if length == 0:
                break
            while todo and offset == todo[0][1]:
                todo.pop(0)
            if not todo:
                raise ReplicationError(f"a data frame of {length} bytes overruns the announced {total} bytes")
            if offset < todo[0][0]:  # the next span starts after bytes filled here: hash those first
                hasher.feed(into[offset : todo[0][0]])
                offset = todo[0][0]
            if length > CHUNK_BYTES or length > todo[0][1] - offset:
                raise ReplicationError(f"a data frame of {length} bytes overruns the announced {total} bytes")
            piece = into[offset : offset + length]
            recv_into_exact(sock, piece, deadline)
            hasher.feed(piece)
            offset += length
            received += length
        if received == expected_bytes:
            if offset < total:
                hasher.feed(into[offset:total])  # filled bytes after the last span
            computed = hasher.finish()
    trailer = recv_message(sock, deadline)
    if trailer.get("commit") is not True:
        return Received(f"aborted by the sender ({str(trailer.get('reason'))[:200]})", (), aborted=True)
    crcs = trailer.get("crc32")
    if received != expected_bytes:
        return Received(f"the sender committed after {received} of {expected_bytes} bytes", ())
    if not isinstance(crcs, list) or len(crcs) != len(computed):
        return Received("the trailer does not carry one crc32 per segment", ())
    for index, (expected, actual) in enumerate(zip(crcs, computed, strict=True)):
        segment = (bounds[index], bounds[index + 1])
        if expected is None and any(begin <= segment[0] and segment[1] <= end for begin, end in filled):
            continue  # filled here, not sent: nothing to compare with
        if expected != actual:
            return Received(f"bytes {bounds[index]}..{bounds[index + 1]} (segment {index}) fail their crc32", ())
    try:
        check_snapshot(into)
    except CheckpointCorruptError as exc:
        return Received(f"the bytes are not a snapshot: {exc.message}", ())
    return Received(None, tuple(c for c in computed if c is not None))
