"""torch's c10d TCPStore protocol in pure Python: a client and a server that torch's own clients
(``init_process_group``, gloo/NCCL rendezvous, DeviceMesh) can use.

Why: the agent imports torch only for the TCPStore (about 1.4 s of CPU per agent, the larger half of
an agent's start); with these it need not. Nothing here is torch's code: the protocol is what
torch's clients and servers put on the wire (validated against torch's own in
tests/socket/test_c10d_wire.py).

The protocol: a client opens with VALIDATE (magic number, no answer) and PING (a u32 echoed).
Then requests, answered in order on the connection: a type byte and its arguments; integers in the
machine's byte order (little-endian everywhere torch runs), strings and byte values as a u64 length
and the bytes, key lists as a u64 count and the strings. Every key a client uses is sent as
"/" + key (the ``init/`` worker count is not). WAIT's answer comes when every key it named exists,
however long that takes (its timeout is the client's, which cancels with CANCEL_WAIT); the server
has no other error signal than closing the connection, so one wrong byte would desynchronise a
client for good: a request is only acted on once it has fully arrived.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import selectors
import socket
import struct
import threading
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

MAGIC = 0x3C85F7CE
# Far above anything resilrun or torch stores; a length beyond them is a broken or hostile client.
MAX_VALUE_BYTES = 64 << 20
MAX_KEY_COUNT = 1 << 20
OUTBOX_LIMIT = 256 << 20
STOP_WAITING = 0
WAIT_CANCELED = 1
READY, NOT_READY = 0, 1


class Query(enum.IntEnum):
    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


_U8, _U32, _I64, _U64 = struct.Struct("<B"), struct.Struct("<I"), struct.Struct("<q"), struct.Struct("<Q")


def pack_bytes(value: bytes) -> bytes:
    return _U64.pack(len(value)) + value


def pack_keys(keys: Sequence[bytes]) -> bytes:
    return _U64.pack(len(keys)) + b"".join(pack_bytes(k) for k in keys)


class Incomplete(Exception):
    """The buffer does not yet hold the whole request: wait for more bytes."""


class Reader:
    """Reads one request's fields from a buffer; raises ``Incomplete`` rather than guessing."""

    def __init__(self, data: bytes | bytearray, offset: int = 0) -> None:
        self.data, self.offset = data, offset

    def take(self, count: int) -> bytes:
        end = self.offset + count
        if end > len(self.data):
            raise Incomplete
        chunk = bytes(self.data[self.offset : end])
        self.offset = end
        return chunk

    def u8(self) -> int:
        return int(_U8.unpack(self.take(1))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self.take(4))[0])

    def i64(self) -> int:
        return int(_I64.unpack(self.take(8))[0])

    def u64(self) -> int:
        return int(_U64.unpack(self.take(8))[0])

    def bytes_(self) -> bytes:
        length = self.u64()
        if length > MAX_VALUE_BYTES:
            raise ValueError(f"a value of {length} bytes is over {MAX_VALUE_BYTES}")
        return self.take(length)

    def key_list(self) -> list[bytes]:
        count = self.u64()
        if count > MAX_KEY_COUNT:
            raise ValueError(f"{count} keys in one request is over {MAX_KEY_COUNT}")
        return [self.bytes_() for _ in range(count)]


# -- the client ---------------------------------------------------------------------------------


class WireClient:
    """A TCPStore client: ``set``/``get``/``add``/``compare_set``/``check``/``wait``/``multi_get``/
    ``delete_key``/``num_keys``, keys as torch's client names them ("/" + key). One caller at a time
    (as torch's client serialises its operations)."""

    def __init__(self, host: str, port: int, timeout_s: float, connect_timeout_s: float | None = None) -> None:
        """``timeout_s``: a ``get``'s wait for its key; ``connect_timeout_s`` (default the same):
        the connection and the server's answer to the opening ping."""
        self.timeout_s = timeout_s
        self._sock = socket.create_connection((host, port), timeout=connect_timeout_s or timeout_s)
        self._lock = threading.Lock()
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = threading.get_native_id() & 0xFFFFFFFF
            self._send(_U8.pack(Query.VALIDATE) + _U32.pack(MAGIC) + _U8.pack(Query.PING) + _U32.pack(nonce))
            if self._u32() != nonce:  # within timeout_s: a peer that accepts and says nothing fails too
                raise ConnectionError(f"{host}:{port} is not a TCPStore (its answer to a ping did not match)")
        except BaseException:
            self._sock.close()
            raise
        # As torch's client: no deadline on an answer once connected (a deadline mid-answer would
        # leave its late bytes to be read as the next answer); a WAIT's own timeout is the exception.
        self._sock.settimeout(None)

    def close(self) -> None:
        self._sock.close()

    # wire helpers
    def _send(self, data: bytes) -> None:
        self._sock.sendall(data)

    def _exactly(self, count: int) -> bytes:
        parts, left = [], count
        while left:
            chunk = self._sock.recv(left)
            if not chunk:
                raise ConnectionError("the store closed the connection")
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)

    def _u8(self) -> int:
        return int(_U8.unpack(self._exactly(1))[0])

    def _u32(self) -> int:
        return int(_U32.unpack(self._exactly(4))[0])

    def _i64(self) -> int:
        return int(_I64.unpack(self._exactly(8))[0])

    def _bytes(self) -> bytes:
        return self._exactly(int(_U64.unpack(self._exactly(8))[0]))

    @staticmethod
    def _key(key: str) -> bytes:
        return b"/" + key.encode()

    # operations
    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._send(_U8.pack(Query.SET) + pack_bytes(self._key(key)) + pack_bytes(value))

    def get(self, key: str) -> bytes:
        with self._lock:
            self._wait_locked([key], self.timeout_s)
            self._send(_U8.pack(Query.GET) + pack_bytes(self._key(key)))
            return self._bytes()

    def add(self, key: str, delta: int) -> int:
        with self._lock:
            self._send(_U8.pack(Query.ADD) + pack_bytes(self._key(key)) + _I64.pack(delta))
            return self._i64()

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._lock:
            self._send(
                _U8.pack(Query.COMPARE_SET) + pack_bytes(self._key(key)) + pack_bytes(expected) + pack_bytes(desired)
            )
            return self._bytes()

    def check(self, keys: Sequence[str]) -> bool:
        with self._lock:
            self._send(_U8.pack(Query.CHECK) + pack_keys([self._key(k) for k in keys]))
            return self._u8() == READY

    def wait(self, keys: Sequence[str], timeout_s: float | None = None) -> None:
        with self._lock:
            self._wait_locked(keys, self.timeout_s if timeout_s is None else timeout_s)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        with self._lock:
            self._wait_locked(keys, self.timeout_s)
            self._send(_U8.pack(Query.MULTI_GET) + pack_keys([self._key(k) for k in keys]))
            return [self._bytes() for _ in keys]

    def delete_key(self, key: str) -> bool:
        with self._lock:
            self._send(_U8.pack(Query.DELETE_KEY) + pack_bytes(self._key(key)))
            return self._i64() == 1

    def num_keys(self) -> int:
        with self._lock:
            self._send(_U8.pack(Query.GETNUMKEYS))
            return self._i64()

    def _wait_locked(self, keys: Sequence[str], timeout_s: float) -> None:
        timeout_s = max(timeout_s, 1e-3)  # 0 would make the socket non-blocking, not bounded
        self._send(_U8.pack(Query.WAIT) + pack_keys([self._key(k) for k in keys]))
        self._sock.settimeout(timeout_s)
        try:
            answer = self._u8()
        except TimeoutError:
            self._sock.settimeout(None)
            self._send(_U8.pack(Query.CANCEL_WAIT))
            if self._u8() == STOP_WAITING:  # the keys came as the wait was cancelled
                self._u8()
            raise TimeoutError(f"keys {list(keys)} not set within {timeout_s:g} s") from None
        finally:
            self._sock.settimeout(None)
        if answer != STOP_WAITING:
            raise ConnectionError(f"unexpected answer {answer} to a wait")


# -- the server ---------------------------------------------------------------------------------


@dataclass
class _Conn:
    sock: socket.socket
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)  # answers the client has not taken yet
    validated: bool = False
    awaited: int = 0  # keys this connection's pending WAIT/BARRIER still needs
    closed: bool = False


class WireServer:
    """A TCPStore server on one thread (selectors): what torch's clients ask, in the order each
    connection asks it; a WAIT is answered once its keys exist."""

    def __init__(self, listener: socket.socket) -> None:
        self._listener = listener
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = defaultdict(deque)
        self._waiters: dict[bytes, list[_Conn]] = defaultdict(list)
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="resilrun-store-server", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    @property
    def address(self) -> str:
        return str(self._listener.getsockname()[0])

    @property
    def family(self) -> int:
        return int(self._listener.family)

    def stop(self) -> None:
        """Ask the server to stop (its thread closes every connection and the listener)."""
        if not self._stopping:
            self._stopping = True
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")

    def close(self) -> None:
        self.stop()
        if self._thread is not threading.current_thread():
            self._thread.join(5)

    def _serve(self) -> None:
        try:
            while not self._stopping:
                for key, events in self._selector.select():
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    else:
                        try:
                            if events & selectors.EVENT_WRITE:
                                self._flush(key.data)
                            if events & selectors.EVENT_READ and not key.data.closed:
                                self._readable(key.data)
                        except Exception:  # one connection's trouble never ends the server
                            logger.exception("store server: dropping a connection after an error")
                            self._drop(key.data)
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._wake_w.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:  # nothing to accept after all, or a client gone before it was accepted
            return
        try:
            sock.setblocking(False)  # one thread serves everyone: no client may make it wait
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            sock.close()
            return
        self._selector.register(sock, selectors.EVENT_READ, _Conn(sock))

    def _readable(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        conn.inbox += chunk
        while conn.inbox and not conn.closed:
            reader = Reader(conn.inbox)
            try:
                answer = self._handle(conn, reader)
            except Incomplete:
                return
            except (ValueError, KeyError):
                self._drop(conn)  # what torch's server does with a request it cannot serve
                return
            del conn.inbox[: reader.offset]
            if answer:
                self._answer(conn, answer)

    def _answer(self, conn: _Conn, data: bytes) -> None:
        """Queue an answer and send what the socket takes now; the rest goes when it is writable.
        A client that takes nothing while ``OUTBOX_LIMIT`` piles up is dropped."""
        if conn.closed:
            return
        conn.outbox += data
        if len(conn.outbox) > OUTBOX_LIMIT:
            logger.warning("store server: dropping a client that does not read its answers")
            self._drop(conn)
            return
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbox) if conn.outbox else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(conn)
            return
        del conn.outbox[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbox else 0)
        with contextlib.suppress(KeyError, ValueError):
            if self._selector.get_key(conn.sock).events != events:
                self._selector.modify(conn.sock, events, conn)

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._forget_waits(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    def _forget_waits(self, conn: _Conn) -> None:
        for key in [k for k, waiting in self._waiters.items() if conn in waiting]:
            waiting = [c for c in self._waiters[key] if c is not conn]
            if waiting:
                self._waiters[key] = waiting
            else:
                del self._waiters[key]
        conn.awaited = 0

    def _handle(self, conn: _Conn, reader: Reader) -> bytes:  # noqa: C901, PLR0911, PLR0912 - one case per query type
        kind = Query(reader.u8())
        if not conn.validated:
            if kind != Query.VALIDATE or reader.u32() != MAGIC:
                raise ValueError("not a TCPStore client")
            conn.validated = True
            return b""
        if kind == Query.PING:
            return _U32.pack(reader.u32())
        if kind == Query.SET:
            key, value = reader.bytes_(), reader.bytes_()
            self._write(key, value)
            return b""
        if kind == Query.COMPARE_SET:
            key, expected, desired = reader.bytes_(), reader.bytes_(), reader.bytes_()
            current = self._data.get(key)
            if current is None:
                if expected:
                    return pack_bytes(expected)
                self._write(key, desired)
                return pack_bytes(desired)
            if current == expected:
                self._write(key, desired)
                return pack_bytes(desired)
            return pack_bytes(current)
        if kind == Query.GET:
            return pack_bytes(self._data.get(reader.bytes_(), b""))
        if kind == Query.ADD:
            key, delta = reader.bytes_(), reader.i64()
            total = int(self._data.get(key, b"0")) + delta
            self._write(key, str(total).encode())
            return _I64.pack(total)
        if kind == Query.CHECK:
            keys = reader.key_list()
            present = all(k in self._data or self._queues.get(k) for k in keys)
            return _U8.pack(READY if present else NOT_READY)
        if kind == Query.WAIT:
            return self._wait(conn, reader.key_list())
        if kind == Query.GETNUMKEYS:
            return _I64.pack(len(self._data))
        if kind == Query.DELETE_KEY:
            return _I64.pack(1 if self._data.pop(reader.bytes_(), None) is not None else 0)
        if kind == Query.APPEND:
            key, value = reader.bytes_(), reader.bytes_()
            self._write(key, self._data.get(key, b"") + value)
            return b""
        if kind == Query.MULTI_GET:
            return b"".join(pack_bytes(self._data.get(k, b"")) for k in reader.key_list())
        if kind == Query.MULTI_SET:
            count = reader.u64()
            if count > MAX_KEY_COUNT:
                raise ValueError(f"{count} keys in one request is over {MAX_KEY_COUNT}")
            pairs = [(reader.bytes_(), reader.bytes_()) for _ in range(count)]
            for key, value in pairs:
                self._write(key, value)
            return b""
        if kind == Query.CANCEL_WAIT:
            self._cancel(conn)
            return _U8.pack(WAIT_CANCELED)
        if kind == Query.QUEUE_PUSH:
            key, value = reader.bytes_(), reader.bytes_()
            self._queues[key].append(value)
            self._wake([key], one=True)
            return b""
        if kind == Query.QUEUE_POP:
            items = self._queues.get(reader.bytes_())
            if not items:
                return _I64.pack(0)
            length = len(items)
            return _I64.pack(length) + pack_bytes(items.popleft())
        if kind == Query.QUEUE_LEN:
            return _I64.pack(len(self._queues.get(reader.bytes_(), ())))
        if kind == Query.LIST_KEYS:
            return _I64.pack(len(self._data)) + b"".join(pack_bytes(k) for k in self._data)
        if kind == Query.BARRIER:
            key, world = reader.bytes_(), reader.i64()
            count = int(self._data.get(key, b"0")) + 1
            self._data[key] = str(count).encode()
            if count >= world:
                self._wake([key])
                return _U8.pack(STOP_WAITING)
            conn.awaited = 1
            self._waiters[key].append(conn)
            return b""
        raise ValueError(f"query {kind!r} is not served")  # VALIDATE twice

    def _write(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        self._wake([key])

    def _wait(self, conn: _Conn, keys: Iterable[bytes]) -> bytes:
        missing = [k for k in keys if k not in self._data and not self._queues.get(k)]
        if not missing:
            return _U8.pack(STOP_WAITING)
        conn.awaited = len(missing)
        for key in missing:
            self._waiters[key].append(conn)
        return b""

    def _wake(self, keys: Iterable[bytes], *, one: bool = False) -> None:
        """A key was written: each wait on it counts it, and one whose keys all exist is answered
        (``one``: a queue push, which stops at the first wait it completes, as torch's server does;
        the waits after it stay registered)."""
        for key in keys:
            waiting = self._waiters.pop(key, [])
            for index, conn in enumerate(waiting):
                conn.awaited -= 1
                if conn.awaited == 0:
                    self._answer(conn, _U8.pack(STOP_WAITING))
                    if one:
                        if waiting[index + 1 :]:
                            self._waiters[key] = waiting[index + 1 :]
                        break

    def _cancel(self, conn: _Conn) -> None:
        self._forget_waits(conn)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket for ``WireServer`` (port 0: any free one)."""
    listener = socket.create_server((host, port), reuse_port=False, backlog=1024)
    return listener
