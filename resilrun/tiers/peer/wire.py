"""The peer-replica wire protocol: mutual authentication, keyed framing, and the snapshot announce.

One request per TCP connection, after a mutual challenge-response on the job's secret::

    server -> client   MAGIC, server nonce (32 bytes)
    client -> server   client nonce (32), HMAC-SHA256(secret, "client" | server nonce | client nonce)
    server -> client   HMAC-SHA256(secret, "server" | server nonce | client nonce)   (only if the client proved it)
    client -> server   request: a JSON message {"op": "push" | "fetch" | "held", ...}

Both ends then hold a session key, HMAC-SHA256(secret, "session" | server nonce | client nonce),
fresh for every connection (``Session``). Every message after the handshake carries an HMAC-SHA256
under it of its direction, its sequence number and its body, so an on-path party that edits,
drops, reorders, replays or reflects one is caught at the next message. A snapshot travels as an
announce message (rank, step, world size, nbytes, values, segment bounds, and optionally shared
segments), then data frames, then a trailer message carrying, besides the per-segment crc32s, a
GMAC of every data byte under the session's stream key (``resilrun.tiers.peer.stream``): crc32
catches accidents, and a forger can keep a segment's crc32 while changing its bytes; the GMAC he
cannot make without the secret. GMAC (AES-256-GCM over no plaintext) because it runs faster than a
memory copy here, where the standard library's MACs run at a quarter of one
(``benchmarks/integrity_primitives.py``).

Invariants: nothing but fixed-size reads happens before the peer proved the secret; every socket
operation runs under a deadline; every size a peer announces is checked before anything is
allocated for it; the role labels in the HMACs stop a client's proof from being replayed as a
server's (a reflection attack), so a client never sends state to a peer that lacks the secret; no
message is acted upon before its MAC verified, and no received snapshot counts before its GMAC did.

Confidentiality is optional (``--peer-encryption``, ``PeerKey.encrypt``): the data frames are then
AES-256-GCM ciphertext under the same stream key and nonce, the trailer's tags covering them, so
the same check that refuses a forgery refuses a changed ciphertext. A stream is re-keyed every
``REKEY_BYTES`` (one GCM key and nonce encrypts at most 64 GiB), each segment under its own key
derived from the stream key and the segment's index, each with its tag in the trailer. Control
messages (ranks, steps, segment bounds, values trees: a snapshot's non-tensor state) are
encrypted too, with AES-256-CTR under a message cipher key, the nonce their direction and
sequence number, and their HMAC then taken over the ciphertext (encrypt-then-MAC: the
authentication above is unchanged); only their lengths show. The handshake stays in clear (it
carries nonces and proofs only). The server's hello names its mode (``MAGIC`` or
``MAGIC_ENCRYPTED``) and the mode is bound into the session key, so a mismatch is named at once
and an on-path party cannot strip the encryption by rewriting the hello.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, TypeGuard

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from resilrun.errors import CheckpointError
from resilrun.snapshot.layout import parse_header

MAGIC = b"RSLRPR01"
MAGIC_ENCRYPTED = b"RSLRPE01"  # the same protocol, its snapshot streams encrypted
NONCE_BYTES = 32
MIN_SECRET_BYTES = 16
# Snapshot data moves in frames of this size: measured here, 4 MiB sendall/recv_into calls reach
# ~3.3 GB/s on loopback vs ~2 GB/s at 1 MiB, and a frame is still small enough to crc while cached.
CHUNK_BYTES = 4 * 1024 * 1024
# Control messages carry values trees (KBs) and segment bounds (one int per tensor): refuse absurd ones.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_SEGMENTS = 1 << 20
LEN = struct.Struct("<I")  # a frame or message length
MAC_BYTES = 32  # HMAC-SHA256 of a message
TAG_BYTES = 16  # GMAC of a stream
# An encrypted stream takes a fresh key after this many bytes: AES-GCM under one key and nonce
# encrypts at most 2^32 - 2 blocks (64 GiB less 32 bytes), and a rank's snapshot can be larger. Half
# the limit, a round number well clear of it; a re-key costs one HMAC and a tag in the trailer.
REKEY_BYTES = 32 * 1024**3
_SEQ = struct.Struct("<Q")


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


# -- socket options ---------------------------------------------------------------------------------
# The retransmission timeout's floor on this tier's connections. Linux's default floor is 200 ms, set
# for the wide-area Internet: between nodes whose round trip is tens of microseconds it turns one lost
# segment of a push (a tail segment, an ack, a handshake message: anything fast retransmit cannot
# repair) into a 200 ms stall of the commit gate, a step's time several times over (docs/benchmarks.md,
# packet loss). The kernel still keeps the timeout above the measured round trip plus four
# deviations, so a slower network gets a longer one; only the floor moves.
RTO_MIN_US = 5_000


@functools.cache
def _rto_floor_option() -> int | None:
    """TCP_RTO_MIN_US where this kernel takes it (Linux 6.15+; Python names it from 3.14 on), else None."""
    if not sys.platform.startswith("linux"):
        return None
    option = getattr(socket, "TCP_RTO_MIN_US", 45)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.IPPROTO_TCP, option, RTO_MIN_US)
    except OSError:  # ENOPROTOOPT/EINVAL: an older kernel keeps its own floor
        return None
    return option


def tune(sock: socket.socket) -> None:
    """Options every connection of this tier takes: no Nagle delay for its small control messages,
    and the lower retransmission floor where the kernel offers it."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    option = _rto_floor_option()
    if option is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, option, RTO_MIN_US)


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


def _parse_message(raw: bytes) -> dict[str, Any]:
    try:
        message = json.loads(raw)
    # ValueError: bad UTF-8/JSON or an integer over Python's digit limit; RecursionError: deep nesting.
    except (ValueError, RecursionError) as exc:
        raise ReplicationError(f"malformed message from peer ({type(exc).__name__})") from None
    if not isinstance(message, dict):
        raise ReplicationError("malformed message from peer: not a JSON object")
    return message


# -- authentication ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PeerKey:
    """The job secret and whether snapshot streams are encrypted (every node of a job alike)."""

    secret: bytes
    encrypt: bool = False

    @property
    def magic(self) -> bytes:
        return MAGIC_ENCRYPTED if self.encrypt else MAGIC


# Where a plain secret is given, streams are authenticated only.
Credential = bytes | PeerKey


def as_key(credential: Credential) -> PeerKey:
    return credential if isinstance(credential, PeerKey) else PeerKey(credential)


def check_secret(credential: Credential) -> None:
    """Raises ValueError for a secret too short to authenticate anyone (a programmer error)."""
    secret = as_key(credential).secret
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the job secret must be at least {MIN_SECRET_BYTES} bytes")


def _session_label(key: PeerKey) -> bytes:
    return b"session encrypted" if key.encrypt else b"session"


def _proof(secret: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, role + server_nonce + client_nonce, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, credential: Credential, deadline: Deadline) -> Session | None:
    """Challenge the client; its session once it proved the secret (the server then proved it
    back), None when it did not."""
    key = as_key(credential)
    secret = key.secret
    server_nonce = os.urandom(NONCE_BYTES)
    deadline.apply(sock)
    sock.sendall(key.magic + server_nonce)
    answer = recv_exact(sock, 2 * NONCE_BYTES, deadline)
    client_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _proof(secret, b"client", server_nonce, client_nonce)):
        return None
    deadline.apply(sock)
    sock.sendall(_proof(secret, b"server", server_nonce, client_nonce))
    session_key = _proof(secret, _session_label(key), server_nonce, client_nonce)
    return Session(sock, session_key, server=True, encrypt=key.encrypt)


def client_handshake(sock: socket.socket, credential: Credential, deadline: Deadline) -> Session:
    """Prove the secret and make the server prove it too, before any state is sent; the session.

    Raises:
        ReplicationError: the peer is not a resilrun peer, refused us, or could not prove the secret.
    """
    key = as_key(credential)
    secret = key.secret
    hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if hello[: len(MAGIC)] != key.magic:
        if hello[: len(MAGIC)] in (MAGIC, MAGIC_ENCRYPTED):
            theirs, ours = ("does", "does not") if hello[: len(MAGIC)] == MAGIC_ENCRYPTED else ("does not", "does")
            raise ReplicationError(
                f"the peer {theirs} encrypt its replica streams and this node {ours}: "
                "give every node the same --peer-encryption"
            )
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
    session_key = _proof(secret, _session_label(key), server_nonce, client_nonce)
    return Session(sock, session_key, server=False, encrypt=key.encrypt)


class StreamMac:
    """GMAC of one snapshot stream's data bytes, fed in the order they travel (see ``Session``)."""

    def __init__(self, key: bytes, nonce: bytes) -> None:
        self._gcm = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()

    def update(self, piece: memoryview) -> None:
        self._gcm.authenticate_additional_data(piece)

    def tag(self) -> bytes:
        self._gcm.finalize()
        return self._gcm.tag


class _NoTag:
    """The helper's share of an encrypted stream: nothing (the cipher authenticates in line)."""

    def update(self, piece: memoryview) -> None:
        pass


class StreamCipher:
    """AES-256-GCM of one encrypted snapshot stream: each frame is encrypted (or decrypted) in
    place, in the order frames travel; the tags cover the ciphertext (see ``Session``).

    Every ``REKEY_BYTES`` of the stream begin a segment under a key of its own,
    HMAC-SHA256(stream key, "segment" | index), with the stream's nonce (unique per key, as the
    keys differ); the trailer carries one tag per segment, in order. A segment moved, dropped or
    swapped fails its tag (its key depends on its index), and a trailer with another count of tags
    than segments received is refused.
    """

    def __init__(self, key: bytes, nonce: bytes, *, outgoing: bool) -> None:
        self._key = key
        self._nonce = nonce
        self._outgoing = outgoing
        self._segment_bytes = REKEY_BYTES  # read here, so that a test may scale it down
        self._used = 0  # bytes through the current segment's key
        self._finished: list[Any] = []  # earlier segments: their tags (sending) or contexts (receiving)
        self._ctx = self._context(0)
        self.helper_mac = _NoTag()

    def _context(self, index: int) -> Any:
        key = hmac.new(self._key, b"segment" + _SEQ.pack(index), hashlib.sha256).digest()
        cipher = Cipher(algorithms.AES(key), modes.GCM(self._nonce))
        return cipher.encryptor() if self._outgoing else cipher.decryptor()

    def _next_segment(self) -> None:
        if self._outgoing:
            self._ctx.finalize()
            self._finished.append(self._ctx.tag)
        else:
            self._finished.append(self._ctx)  # finalized with its tag once the trailer came
        self._ctx = self._context(len(self._finished))
        self._used = 0

    def _apply(self, source: memoryview, target: memoryview) -> None:
        """``source`` through the cipher into ``target`` (as long; the same view is safe: GCM is a
        stream mode), across as many segments as it spans."""
        done, count = 0, len(source)
        while done < count:
            if self._used == self._segment_bytes:
                self._next_segment()
            take = min(count - done, self._segment_bytes - self._used)
            self._ctx.update_into(source[done : done + take], target[done : done + take])
            done += take
            self._used += take

    def seal(self, plain: memoryview, out: memoryview) -> memoryview:
        """``plain`` encrypted into ``out`` (at least as long): the frame to send."""
        frame = out[: len(plain)]
        self._apply(plain, frame)
        return frame

    def open(self, piece: memoryview) -> None:
        """Decrypt a received frame where it lies (AES-GCM is a stream mode: in place is safe)."""
        self._apply(piece, piece)

    def tag(self) -> bytes:
        """The sender's tags, one per segment in order, to put in the trailer."""
        self._ctx.finalize()
        return b"".join([*self._finished, self._ctx.tag])

    def verify(self, tags: bytes) -> bool:
        """Whether the received ciphertext carried ``tags``; the plaintext counts only then."""
        from cryptography.exceptions import InvalidTag

        contexts = [*self._finished, self._ctx]
        if len(tags) != TAG_BYTES * len(contexts):
            return False
        authentic = True
        for index, ctx in enumerate(contexts):  # every one, so that each context is finalized
            try:
                ctx.finalize_with_tag(tags[index * TAG_BYTES : (index + 1) * TAG_BYTES])
            except (InvalidTag, ValueError):
                authentic = False
        return authentic


class _MessageCipher:
    """AES-256-CTR of an encrypted session's control messages (see the module docstring).

    CTR rather than GCM: the message HMAC already authenticates each message's direction, sequence
    number and bytes, so it is taken over the ciphertext (encrypt-then-MAC) and the framing and its
    checks stay as they are. The counter block is direction | sequence number | a 32-bit block
    counter, unique per message under the session's key; a message (at most ``MAX_MESSAGE_BYTES``)
    never carries the block counter into the sequence number.
    """

    def __init__(self, key: bytes) -> None:
        self._key = hmac.new(key, b"message cipher", hashlib.sha256).digest()

    def apply(self, direction: bytes, seq: int, data: bytes) -> bytes:
        """``data`` encrypted, or decrypted (the same operation), as message ``seq`` of ``direction``."""
        counter = direction + _SEQ.pack(seq) + bytes(4)
        ctx = Cipher(algorithms.AES(self._key), modes.CTR(counter)).encryptor()
        return ctx.update(data) + ctx.finalize()


class Session:
    """An authenticated connection: its socket and the keys both ends derived in the handshake.

    Messages are ``u32 length | JSON body | HMAC-SHA256(message key, direction | seq | body)``; a
    stream's GMAC uses the stream key with a nonce of the sender's direction and its count of
    streams so far, unique because the session key is fresh for every connection. On an encrypted
    session the body is AES-256-CTR ciphertext (``_MessageCipher``) and the HMAC covers that.
    """

    def __init__(self, sock: socket.socket, key: bytes, *, server: bool, encrypt: bool = False) -> None:
        self.sock = sock
        self.encrypt = encrypt
        self._message_cipher = _MessageCipher(key) if encrypt else None
        self._message_key = hmac.new(key, b"messages", hashlib.sha256).digest()
        self._stream_key = hmac.new(key, b"streams", hashlib.sha256).digest()
        self._out, self._in = (b"srv>", b"cli>") if server else (b"cli>", b"srv>")
        self._sent = self._received = 0
        self._streams_out = self._streams_in = 0

    def _mac(self, direction: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(self._message_key, direction + _SEQ.pack(seq) + body, hashlib.sha256).digest()

    def send(self, message: dict[str, Any], deadline: Deadline) -> None:
        body = json.dumps(message, separators=(",", ":")).encode()
        if len(body) > MAX_MESSAGE_BYTES:
            raise ReplicationError(f"message of {len(body)} bytes exceeds the {MAX_MESSAGE_BYTES} byte limit")
        framed = self.seal(body)
        deadline.apply(self.sock)
        self.sock.sendall(framed)

    def seal(self, body: bytes) -> bytes:
        """``body`` framed as this end's next message, with its MAC (``send`` is this for JSON)."""
        if self._message_cipher is not None:
            body = self._message_cipher.apply(self._out, self._sent, body)
        mac = self._mac(self._out, self._sent, body)
        self._sent += 1
        return LEN.pack(len(body)) + body + mac

    def recv(self, deadline: Deadline) -> dict[str, Any]:
        """The peer's next message, once its MAC verified; its size is checked before anything is
        allocated for it.

        Raises:
            ReplicationError: a malformed message, or one whose MAC does not verify (changed on the
                way, replayed, reordered, or not from the peer that shook hands).
        """
        (length,) = LEN.unpack(recv_exact(self.sock, LEN.size, deadline))
        if length > MAX_MESSAGE_BYTES:
            raise ReplicationError(f"peer announced a {length} byte message (limit {MAX_MESSAGE_BYTES})")
        raw = recv_exact(self.sock, length + MAC_BYTES, deadline)
        body, mac = raw[:length], raw[length:]
        if not hmac.compare_digest(mac, self._mac(self._in, self._received, body)):
            raise ReplicationError("a message failed its MAC: changed on the way, or not from the authenticated peer")
        if self._message_cipher is not None:
            body = self._message_cipher.apply(self._in, self._received, body)
        self._received += 1
        return _parse_message(body)

    def stream_mac(self, *, outgoing: bool) -> StreamMac:
        """The GMAC of the next stream this end sends (``outgoing``) or receives."""
        return StreamMac(self._stream_key, self._stream_nonce(outgoing))

    def stream_cipher(self, *, outgoing: bool) -> StreamCipher:
        """The cipher of the next encrypted stream this end sends (``outgoing``) or receives."""
        return StreamCipher(self._stream_key, self._stream_nonce(outgoing), outgoing=outgoing)

    def _stream_nonce(self, outgoing: bool) -> bytes:
        if outgoing:
            direction, count = self._out, self._streams_out
            self._streams_out += 1
        else:
            direction, count = self._in, self._streams_in
            self._streams_in += 1
        return direction + _SEQ.pack(count)


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
    # The generation the sender follows (-1: unknown), its fencing token: a receiver that follows a
    # newer one refuses the push (the sender was cut off and replaced, or is a recovery behind).
    # Not ``round``: right after a recovery a survivor's newest step was trained in the one before.
    generation: int = -1

    def to_message(self) -> dict[str, Any]:
        message = {
            "rank": self.rank,
            "step": self.step,
            "world_size": self.world_size,
            "nbytes": self.nbytes,
            "values": self.values,
            "bounds": list(self.bounds),
        }
        if self.generation >= 0:
            message["generation"] = self.generation
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
    generation = message.get("generation", -1)
    if not _is_int(layout) or not _is_int(round_, -1) or not _is_int(generation, -1):
        raise ReplicationError(f"bad layout, round or generation in announce: {layout!r}, {round_!r}, {generation!r}")
    values = message.get("values")
    return Announce(rank, step, world_size, nbytes, values, tuple(bounds), shared, layout, round_, generation)


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
