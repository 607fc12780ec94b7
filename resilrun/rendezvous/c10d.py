"""The TCPStore rendezvous backend and the store's lifecycle (host or connect).

All torch store errors are translated in one place (``_call``) into StoreConnectionError, so a dead
or unreachable store host reads the same everywhere. Every operation also has a deadline
(``StoreCalls``): a TCPStore client's set/get/add carry no timeout of their own, so when the store
host drops off the network without closing its connections (a cut link, a powered-off machine: no
FIN, no RST), they would block until TCP gives up, hours later, and the node would hang there.

The store host is chosen as torchrun does: the node whose address matches the endpoint binds it; if
binding fails (another local agent won the race) it connects as a client.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

from resilrun.errors import StoreConnectionError
from resilrun.rendezvous.api import RendezvousBackend
from resilrun.rendezvous.c10d_wire import WireClient, WireServer

T = TypeVar("T")
# A sentinel stored in place of "absent": TCPStore.compare_set treats an empty expected value as
# "key missing", so real values are framed with a one-byte prefix to keep b"" distinguishable.
_FRAME = b"v"


def _call(endpoint: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except StoreConnectionError:
        raise
    except Exception as exc:  # torch raises RuntimeError subclasses (DistStoreError, ...)
        raise StoreConnectionError(
            f"rendezvous store at {endpoint} failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            hint="the node hosting the store may have stopped; check --rdzv-endpoint and that node's log",
        ) from exc


class _Pending:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None


class StoreCalls:
    """Runs one store client's operations on a daemon thread, each waited for at most ``timeout_s``.

    Why a thread: the blocking call cannot be interrupted, so the caller stops waiting instead and
    fails with StoreConnectionError (the agent then stops its workers and exits, as for a store that
    refused). While a call is stuck, later ones fail at once rather than queue behind it; if the
    link heals and the stuck call returns, calls go through again. A daemon thread, so a call stuck
    for good never holds up the interpreter's exit.
    """

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], _Pending]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stuck = False

    def call(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._stuck:
                raise self._unanswered()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="resilrun-store-calls", daemon=True)
                self._thread.start()
        pending = _Pending()
        self._calls.put((fn, pending))
        if not pending.done.wait(self._timeout_s):
            with self._lock:
                self._stuck = not pending.done.is_set()
            if not pending.done.is_set():
                raise self._unanswered()
        if pending.error is not None:
            raise pending.error
        return pending.value  # type: ignore[return-value]

    def _run(self) -> None:
        while True:
            fn, pending = self._calls.get()
            try:
                pending.value = fn()
            except BaseException as exc:  # handed to the caller, raised in its thread
                pending.error = exc
            with self._lock:
                self._stuck = False
            pending.done.set()

    def _unanswered(self) -> StoreConnectionError:
        return StoreConnectionError(
            f"rendezvous store at {self._endpoint} failed: no answer within {self._timeout_s:g} s",
            hint="the node hosting the store is down or cut off the network (a single point of failure on "
            "the c10d backend, as with torchrun; --rdzv-backend etcd removes it); --rdzv-conf read_timeout=SECONDS "
            "sets the wait",
        )


def _unframe(raw: bytes) -> bytes:
    """A value as it was set (counters written by ``add`` carry no frame)."""
    return raw[1:] if raw.startswith(_FRAME) else raw


class C10dBackend(RendezvousBackend):
    """See base class. Wraps a connected store client (torch's TCPStore protocol)."""

    def __init__(self, store: WireClient, endpoint: str, timeout: timedelta = timedelta(seconds=60)) -> None:
        """``timeout``: the most any one operation may take (``--rdzv-conf read_timeout``)."""
        self.store = store
        self.endpoint = endpoint
        self._calls = StoreCalls(endpoint, timeout.total_seconds())

    def _call(self, fn: Callable[[], T]) -> T:
        return self._calls.call(lambda: _call(self.endpoint, fn))

    def get(self, key: str) -> bytes | None:
        def read() -> bytes | None:
            if not self.store.check([key]):
                return None
            return _unframe(self.store.get(key))

        return self._call(read)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Two requests when every key exists (a check, a multi_get); else one check per key.

        TCPStore's multi_get waits for absent keys (until the store timeout), so only keys a check
        found are fetched; keys are never deleted, so a key found stays there for the fetch.
        """

        def read() -> list[bytes | None]:
            if not keys:
                return []
            present = list(keys) if self.store.check(list(keys)) else [k for k in keys if self.store.check([k])]
            found = dict(zip(present, self.store.multi_get(present), strict=True)) if present else {}
            return [_unframe(found[k]) if k in found else None for k in keys]

        return self._call(read)

    def set(self, key: str, value: bytes) -> None:
        self._call(lambda: self.store.set(key, _FRAME + value))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        if expected is not None and expected == desired:  # nothing to write; TCPStore would echo it
            return self.get(key) == desired
        want = b"" if expected is None else _FRAME + expected
        new = _FRAME + desired
        result = self._call(lambda: self.store.compare_set(key, want, new))
        return bytes(result) == new

    def add(self, key: str, amount: int) -> int:
        return int(self._call(lambda: self.store.add(key, amount)))


def is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (we can bind to it)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((sockaddr[0], 0))
                return True
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    return True
    return False


class HostedStore(WireClient):
    """A store server this process hosts (torch's TCPStore protocol, resilrun/rendezvous/c10d_wire.py)
    and this process's own client of it; the server stops with ``close`` or when it is dropped."""

    def __init__(self, server: WireServer, timeout_s: float) -> None:
        self._server = server
        bound = server.address
        if bound in ("0.0.0.0", "::"):  # noqa: S104 - a wildcard: reach it on IPv4 loopback (a
            bound = "127.0.0.1"  # dual-stack socket takes it; ::1 is missing where IPv6 is disabled)
        super().__init__(bound, server.port, timeout_s)

    @property
    def port(self) -> int:
        return self._server.port

    def close(self) -> None:
        super().close()
        self._server.close()

    def __del__(self) -> None:  # as a dropped TCPStore does: nothing of it stays open
        with contextlib.suppress(Exception):
            self.close()


def host_store(host: str, port: int, timeout: timedelta) -> HostedStore:
    """Bind a store server on ``port`` (0 = any free port).

    The store holds the job's secret. So when ``host`` is a literal IP address other than a wildcard
    (the user named the exact address, e.g. ``--rdzv-endpoint 127.0.0.1:29400``), the server listens
    on that address only. A host *name* keeps torchrun's wildcard: the name may resolve differently
    here (127.0.1.1 from /etc/hosts) than on the other nodes.
    """
    listener = _bind_exact(host, port)
    if listener is None:
        listener = _bind_any(port)
    server = WireServer(listener)
    try:
        return HostedStore(server, timeout.total_seconds())
    except BaseException:
        server.close()
        raise


def _bind_any(port: int) -> socket.socket:
    """Every interface, IPv6 and IPv4 where the machine has both (as TCPStore listens)."""
    if socket.has_dualstack_ipv6():
        with contextlib.suppress(OSError):
            return socket.create_server(
                ("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=socket.SOMAXCONN
            )
    return socket.create_server(("0.0.0.0", port), backlog=socket.SOMAXCONN)  # noqa: S104 - torchrun's wildcard


def _bind_exact(host: str, port: int) -> socket.socket | None:
    """A listening socket on exactly ``host``:``port`` when ``host`` is a specific IP literal, else None.

    Raises:
        OSError: the address cannot be bound (in use: another local agent hosts the store).
    """
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if address.is_unspecified:
        return None
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does: restarts reuse the port
        listener.bind((str(address), port))
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    return listener


def connect_store(host: str, port: int, timeout: timedelta) -> WireClient:
    """Connect to a store server, failing with a clear error after ``timeout`` (the host may still
    be starting: refused connections are retried until then, as torch's client does)."""
    endpoint = f"{host}:{port}"
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.01
    while True:
        try:
            return WireClient(host, port, timeout.total_seconds(), max(deadline - time.monotonic(), 0.1))
        except OSError as exc:
            if time.monotonic() + pause >= deadline:
                raise StoreConnectionError(
                    f"could not reach the rendezvous store at {endpoint} within {timeout.total_seconds():g} s",
                    hint="check --rdzv-endpoint, that the first node is up, and firewalls; "
                    "raise the wait with --rdzv-conf read_timeout=SECONDS",
                ) from exc
            time.sleep(pause)
            pause = min(pause * 2, 1.0)


def open_store(host: str, port: int, *, is_host: bool | None, timeout: timedelta) -> tuple[WireClient, bool]:
    """Host or connect to the rendezvous store; returns ``(store, hosting)``."""
    if is_host is None:
        is_host = port == 0 or is_local_address(host)
    if is_host:
        try:
            return host_store(host, port, timeout), True
        except Exception as exc:  # bind failed: another local agent hosts it
            if port == 0:
                raise StoreConnectionError(f"could not host a rendezvous store: {exc}") from exc
    return connect_store(host, port, timeout), False
