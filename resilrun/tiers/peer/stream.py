"""Checksummed, authenticated snapshot streams between peers (after ``wire``'s handshake and announce).

A snapshot travels as an announce message (rank, step, world size, nbytes, values, segment bounds),
then data frames (u32 length + bytes; a zero length ends the data), then a trailer message:
``{"commit": true, "crc32": [...], "mac": hex}`` with one crc32 per segment and the GMAC of every
data byte under the session's stream key (``wire.Session``), or ``{"commit": false}`` (ABORT) when
the sender's source was overwritten meanwhile. On an encrypted session (``--peer-encryption``) the
frames are AES-256-GCM ciphertext, encrypted and decrypted in line (re-keyed every
``wire.REKEY_BYTES``), and the trailer's tags cover them; the messages, values tree included, are
encrypted too (``wire.Session``). The receiver counts nothing whose GMAC does not verify: a party
on the path who changed bytes and kept their crc32s (crc32 is linear: four chosen bytes restore
it) is caught there. Segments are the
safetensors header and each tensor, so a replica's crc32s are the same numbers the durable tier's
manifests record. The crc32s ride in the trailer rather than the announce so that each end reads
the bytes once, hashing them (on a helper thread) while they move; the receiver verifies before
anything becomes visible.

An announce may name *shared* segments (DDP's parameters and optimizer state, equal on every rank)
with the snapshot's layout and generation. A receiver whose own ranks hold the same step of the
same generation in the same layout answers ``filled``: it has them itself (by reference, see
``store``, or copied from its node memory); the sender then leaves those segments out of the
stream (null crc32s in the trailer). The receiver keeps null crc32s for them too, as nothing crossed
the network: a reader streaming the replica later hashes them as it sends them.
"""

from __future__ import annotations

import hmac
import socket
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from resilrun.errors import CheckpointCorruptError
from resilrun.snapshot.crc import crc32
from resilrun.snapshot.layout import parse_header
from resilrun.tiers.peer.wire import (
    CHUNK_BYTES,
    LEN,
    Deadline,
    ReplicationError,
    Session,
    StreamCipher,
    recv_exact,
    recv_into_exact,
)

# Frames the hashing helper may lag behind the one being moved before the mover waits for it. Deep
# enough that on a busy machine the mover rarely blocks on a descheduled helper (each wake-up then
# costs a scheduler slice); the lag costs no memory, the frames are views of the source or target.
_PIPELINE_DEPTH = 8
_MSG_MORE = getattr(socket, "MSG_MORE", 0)


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


class _Fed(Protocol):
    def update(self, piece: memoryview) -> None: ...


class _Hasher:
    """Checksums and the stream's MAC computed on a helper thread while the caller moves the next frame.

    Why: a crc32 pass costs about as much CPU as the socket copy; done in line, each side stops
    moving bytes while it hashes and the two ends run in lock-step. Pipelined, hashing frame i
    overlaps moving frame i + 1 (crc32, sendall and recv_into all release the GIL). Frames are
    hashed in order (one helper), at most ``_PIPELINE_DEPTH`` frames behind.
    """

    def __init__(self, bounds: Sequence[int], total: int, mac: _Fed) -> None:
        self.sums = Checksums(bounds)
        self.mac = mac
        pipelined = total > CHUNK_BYTES  # one frame: nothing to overlap with
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="resilrun-crc") if pipelined else None
        self._pending: deque[Future[None]] = deque()

    def __enter__(self) -> _Hasher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def feed(self, piece: memoryview) -> None:
        self._submit(self._hash, piece)

    def _hash(self, piece: memoryview) -> None:
        self.sums.update(piece)
        self.mac.update(piece)

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

    def tag(self) -> bytes:
        """The stream's MAC (after ``finish``)."""
        return self.mac.tag()  # type: ignore[attr-defined]


# -- snapshot streams -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Sent:
    committed: bool  # False: the source changed while it was read and ABORT went instead of COMMIT
    crcs: tuple[int | None, ...]  # what the bytes sent hash to (None: skipped; empty when aborted)


def send_snapshot(
    session: Session,
    deadline: Deadline,
    view: memoryview,
    bounds: Sequence[int],
    is_intact: Callable[[], bool] | None = None,
    stored_crcs: Sequence[int | None] | None = None,
    skip: Sequence[tuple[int, int]] = (),
    expected_crcs: Sequence[int | None] | None = None,
) -> Sent:
    """Stream ``view`` as data frames, then COMMIT with the crc32s, or ABORT when it was torn.

    Args:
        is_intact: the source's seqlock check, asked before every frame and after the last one.
        stored_crcs: crcs recorded when the bytes were received (a replica); they are sent instead of
            the ones computed now, so that bytes corrupted at rest fail the receiver's check (a
            null one, for bytes that never crossed the network, is replaced by the computed one).
        skip: whole segments the receiver fills itself (``Announce.shared``): not sent, not
            hashed, null in the trailer.
        expected_crcs: what the source's commit recorded (None: a segment it did not write); a sent
            segment hashing otherwise was torn, however intact the source said it was: ABORT.
    """
    sock = session.sock
    cipher = session.stream_cipher(outgoing=True) if session.encrypt else None
    scratch = memoryview(bytearray(min(CHUNK_BYTES, len(view)))) if cipher is not None else None
    mac = cipher.helper_mac if cipher is not None else session.stream_mac(outgoing=True)
    with _Hasher(bounds, len(view), mac) as hasher:
        position = 0
        for begin, end in spans(len(view), skip):
            if begin > position:
                hasher.skip(begin - position)
            for offset in range(begin, end, CHUNK_BYTES):
                if is_intact is not None and not is_intact():
                    hasher.finish()
                    return _abort(session, deadline)
                piece = view[offset : min(offset + CHUNK_BYTES, end)]
                hasher.feed(piece)
                frame = piece if cipher is None or scratch is None else cipher.seal(piece, scratch)
                deadline.apply(sock)
                sock.sendall(LEN.pack(len(frame)), _MSG_MORE)
                sock.sendall(frame)
            position = end
        if position < len(view):
            hasher.skip(len(view) - position)
        computed = hasher.finish()  # before the last check: the helper reads the source too
        tag = hasher.tag() if cipher is None else cipher.tag()
    if is_intact is not None and not is_intact():
        return _abort(session, deadline)
    if expected_crcs is not None and any(
        now is not None and wanted is not None and now != wanted
        for now, wanted in zip(computed, expected_crcs, strict=True)
    ):
        return _abort(session, deadline)
    deadline.apply(sock)
    sock.sendall(LEN.pack(0), _MSG_MORE)
    crcs = computed
    if stored_crcs is not None and not skip:
        crcs = [now if stored is None else stored for stored, now in zip(stored_crcs, computed, strict=True)]
    session.send({"commit": True, "crc32": crcs, "mac": tag.hex()}, deadline)
    return Sent(True, tuple(computed))


def _abort(session: Session, deadline: Deadline) -> Sent:
    deadline.apply(session.sock)
    session.sock.sendall(LEN.pack(0), _MSG_MORE)
    session.send({"commit": False, "reason": "the source was overwritten while it was sent"}, deadline)
    return Sent(False, ())


@dataclass(frozen=True, slots=True)
class Received:
    problem: str | None  # None: committed, complete, MAC and every crc32 matched, and the bytes parse as a snapshot
    crcs: tuple[int | None, ...]  # one per segment (None: filled here; empty unless problem is None)
    aborted: bool = False  # the sender sent ABORT: its source changed (expected, not an error)


def receive_snapshot(
    session: Session,
    deadline: Deadline,
    into: memoryview,
    bounds: Sequence[int],
    filled: Sequence[tuple[int, int]] = (),
    check: Callable[[memoryview], None] = check_snapshot,
    what: str = "a snapshot",
) -> Received:
    """Receive data frames straight into ``into`` and check the trailer.

    Args:
        filled: ranges of ``into`` the receiver fills itself (the announce's shared segments, which
            its own node memory holds): the stream leaves them out, and they are not read here
            (they may not have been copied in yet); their segments' crc32s are None.
        check: what the verified bytes must be (raises CheckpointCorruptError): a snapshot, or
            for a captured file (``files``), the bytes its announce's SHA-256 names; ``what``
            names it in the problem.

    Returns:
        The verified crc32s, or why the bytes do not count (an ABORT, a short stream, a MAC that
        does not verify, a checksum mismatch naming the segment, bytes that are not a snapshot).

    Raises:
        ReplicationError, OSError: the stream broke the protocol, closed or timed out.
    """
    total = len(into)
    todo = spans(total, filled)
    expected_bytes = sum(end - begin for begin, end in todo)
    offset, received = 0, 0
    computed: list[int | None] = []
    tag = b""
    sock = session.sock
    cipher: StreamCipher | None = session.stream_cipher(outgoing=False) if session.encrypt else None
    mac = cipher.helper_mac if cipher is not None else session.stream_mac(outgoing=False)
    with _Hasher(bounds, total, mac) as hasher:
        while True:
            (length,) = LEN.unpack(recv_exact(sock, LEN.size, deadline))
            if length == 0:
                break
            while todo and offset == todo[0][1]:
                todo.pop(0)
            if not todo:
                raise ReplicationError(f"a data frame of {length} bytes overruns the announced {total} bytes")
            if offset < todo[0][0]:  # the next span starts after bytes filled here
                hasher.skip(todo[0][0] - offset)
                offset = todo[0][0]
            if length > CHUNK_BYTES or length > todo[0][1] - offset:
                raise ReplicationError(f"a data frame of {length} bytes overruns the announced {total} bytes")
            piece = into[offset : offset + length]
            recv_into_exact(sock, piece, deadline)
            if cipher is not None:
                cipher.open(piece)
            hasher.feed(piece)
            offset += length
            received += length
        if received == expected_bytes:
            if offset < total:
                hasher.skip(total - offset)  # filled bytes after the last span
            computed = hasher.finish()
            tag = hasher.tag() if cipher is None else b""
    trailer = session.recv(deadline)
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
    # After the crc32s, so that an accident is reported as one; bytes changed with their crc32s kept
    # (a forgery: crc32 is linear) fail here.
    mac = trailer.get("mac")
    if cipher is not None:
        authentic = isinstance(mac, str) and _verify_hex(cipher, mac)
    else:
        authentic = isinstance(mac, str) and hmac.compare_digest(mac.encode(), tag.hex().encode())
    if not authentic:
        return Received("the bytes fail their MAC: changed on the way with their crc32s kept (forged)", ())
    try:
        check(into)
    except CheckpointCorruptError as exc:
        return Received(f"the bytes are not {what}: {exc.message}", ())
    return Received(None, tuple(computed))


def _verify_hex(cipher: StreamCipher, mac: str) -> bool:
    try:
        return cipher.verify(bytes.fromhex(mac))
    except ValueError:
        return False
