"""What etcd pushes or holds for the backend (``rendezvous/etcd.py``): key watches and leased keys.

Split from the backend's request path: a watch is a thread following one streaming request, a
leased key a lease the caller renews; both use the backend's requests (failover, retries, auth)
and nothing else of it. What they use is named by :class:`GatewayRequests`, so this module needs
nothing of ``etcd.py`` and the imports run one way (the backend imports this module, never the
reverse).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Protocol

from resilrun.errors import StoreConnectionError
from resilrun.rendezvous.etcd_http import GatewayStream

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 2.0  # the most close() waits for a watch's thread
_BACKOFF_FIRST_S = 0.05
_WATCH_BACKOFF_MAX_S = 2.0


class GatewayRequests(Protocol):
    """The backend's requests, as watches and leased keys use them (``EtcdBackend`` is one).

    Failover, retries, deadlines and authentication stay the backend's: a watch only needs to know
    which endpoint the requests go to now, to follow them when they move.
    """

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One gateway request (JSON in, JSON out) under the backend's deadline.

        Raises:
            StoreConnectionError: no endpoint answered in time, or etcd refused the request.
        """
        ...

    def open_stream(self, path: str, body: dict[str, Any]) -> tuple[GatewayStream, int]:
        """A streaming request (a watch) on the current endpoint: the stream and that endpoint's index.

        Raises:
            StoreConnectionError: the endpoint refused or did not answer (the caller re-opens later).
        """
        ...

    def endpoint_index(self) -> int:
        """The index of the endpoint that requests go to now."""
        ...


def b64(data: str | bytes) -> str:
    import base64

    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def kv_value(kv: dict[str, Any]) -> bytes:
    import base64

    # The gateway omits empty fields (proto3 JSON): an absent "value" is b"", not a missing key.
    return base64.b64decode(kv.get("value", ""))


class KeyWatch:
    """One key as an etcd watch pushes it: its value (None: absent) and when this process saw it
    last change (``EtcdBackend.watch_key``, ``watch_presence``).

    The thread reads the key and its revision, then watches from the next revision, so no change
    between the read and the watch is missed; events update the value in order. While no stream is
    open (starting, broken, being re-opened after a backoff) ``seen`` is None and the caller reads
    the store instead, so a broken stream never hides a change. A member cut off the network
    without closing its connections leaves a stream that just goes quiet: once the backend's other
    requests have moved to another member, the stream on the old one is dropped at the next
    ``seen`` (None) and opened again where the requests go.
    """

    def __init__(self, backend: GatewayRequests, key: str) -> None:
        self._backend = backend
        self._key = key
        # (value, when it last changed) while the stream is current; the last value that was present
        self._seen: tuple[bytes | None, float] | None = None
        self._known: tuple[bytes | None, float] | None = None  # the last (value, since), current or not
        self.last_present: bytes | None = None
        self._stopping = threading.Event()
        self._response: Any = None
        self._index = -1  # the endpoint the stream is open on
        self._thread = threading.Thread(target=self._run, name="resilrun-etcd-watch", daemon=True)
        self._thread.start()

    def seen(self) -> tuple[bytes | None, float] | None:
        seen = self._seen
        if seen is not None and self._index != self._backend.endpoint_index():
            self._seen = None
            self._drop()  # wakes the thread, which opens the stream where the requests now go
            return None
        return seen

    def close(self) -> None:
        self._stopping.set()
        self._drop()
        self._thread.join(timeout=_CONNECT_TIMEOUT_S)

    def _run(self) -> None:
        backoff = _BACKOFF_FIRST_S
        while not self._stopping.is_set():
            try:
                self._follow()
                backoff = _BACKOFF_FIRST_S  # it ran, then ended (idle, or etcd closed it)
            except Exception as exc:  # noqa: BLE001 - any failure: read meanwhile, open again
                logger.debug("watch on %s broke: %s", self._key, exc)
            self._seen = None
            self._drop()
            if self._stopping.wait(backoff):
                return
            backoff = min(backoff * 2, _WATCH_BACKOFF_MAX_S)

    def _follow(self) -> None:
        result = self._backend.post("/kv/range", {"key": b64(self._key)})
        revision = int(result.get("header", {}).get("revision", 0))
        kvs = result.get("kvs")
        value = kv_value(kvs[0]) if kvs else None
        known = self._known  # kept across streams: a key gone before a re-open stays gone since then
        since = known[1] if known is not None and known[0] == value else time.monotonic()
        create = {"key": b64(self._key), "start_revision": str(revision + 1)}
        self._response, self._index = self._backend.open_stream("/watch", {"create_request": create})
        for line in self._response.lines():
            if self._stopping.is_set():
                return
            if not line.strip():
                continue
            chunk = json.loads(line)
            if "error" in chunk:
                raise StoreConnectionError(f"etcd ended the watch on {self._key}: {chunk['error']}")
            answer = chunk.get("result", {})
            if answer.get("canceled"):
                raise StoreConnectionError(f"etcd canceled the watch on {self._key}: {answer.get('cancel_reason')}")
            for event in answer.get("events", []):
                value = None if event.get("type") == "DELETE" else kv_value(event["kv"])
                since = time.monotonic()
            if answer.get("created") or answer.get("events"):
                if value is not None:
                    self.last_present = value
                self._known = self._seen = (value, since)

    def _drop(self) -> None:
        """Close the stream, waking the thread blocked reading it."""
        stream, self._response = self._response, None
        if stream is not None:
            stream.close()


class WatchedKey:
    """A key as a watch pushes it (``EtcdBackend.watch_key``, ``watch_presence``)."""

    def __init__(self, watch: KeyWatch) -> None:
        self._watch = watch

    def seen(self) -> tuple[bytes | None, float] | None:
        return self._watch.seen()

    @property
    def last_present(self) -> bytes | None:
        return self._watch.last_present

    def close(self) -> None:
        self._watch.close()


class LeasedKey:
    """A key held by a lease of its own (``EtcdBackend.lease_key``)."""

    def __init__(self, backend: GatewayRequests, key: str, value: bytes, ttl_s: int) -> None:
        self._backend = backend
        self._key = key
        self._value = value
        self._ttl_requested = ttl_s
        self._lease_id = 0
        self.ttl_s = ttl_s
        self._grant()

    def _grant(self) -> None:
        granted = self._backend.post("/lease/grant", {"TTL": str(self._ttl_requested), "ID": "0"})
        self._lease_id = int(granted["ID"])
        self.ttl_s = int(granted.get("TTL", self._ttl_requested))  # etcd raises a TTL below its minimum
        put = {"key": b64(self._key), "value": b64(self._value), "lease": str(self._lease_id)}
        self._backend.post("/kv/put", put)

    def refresh(self) -> None:
        """Renew the lease; one that expired meanwhile (this node was cut off or frozen for longer
        than the TTL, and its watchers heard it go) is granted anew and the key written again."""
        answer = self._backend.post("/lease/keepalive", {"ID": str(self._lease_id)})
        if int(answer.get("result", {}).get("TTL", 0)) <= 0:
            self._grant()

    def close(self) -> None:
        """Stop renewing: the key expires after its TTL, as a node that stops beating goes quiet."""
