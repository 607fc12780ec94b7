"""The etcd v3 rendezvous backend: the same contract on a highly available store.

Why etcd and why this client: with the c10d backend the store lives inside one agent, so losing that
node ends the job. etcd is replicated by raft, so the rendezvous survives any node (and a minority
of etcd members). The backend speaks etcd's v3 JSON gRPC-gateway over HTTP/1.1 with the standard
library (``etcd_http.py``: kept-alive connections, the least client CPU per request of the
clients measured), so it pulls in no ``grpcio``/``protobuf`` whose pins fight torch's, and it
works with every etcd >= 3.4, including Debian's ``etcd-server`` 3.4.23. (``python-etcd3`` needs
an old protobuf and is unmaintained; ``aetcd`` is asyncio-only; ``etcd3gw``, used before, costs
about 3x the client CPU per request through ``requests``.)

How the contract maps onto etcd:

| call          | etcd requests                                                             |
|---------------|---------------------------------------------------------------------------|
| get           | one range                                                                  |
| set           | one put                                                                    |
| compare_set   | one txn: compare value == expected (or create_revision == 0 for absent),  |
|               | put on success, range on failure (to report "already holds desired")      |
| get_many      | one txn of ranges per 128 keys (etcd's default --max-txn-ops)             |
| add(key, 0)   | one range (a read never writes: polling a counter costs no raft proposal) |
| add(key, n)   | one txn: compare mod_revision == cached, put value+n; on a lost race the   |
|               | failure branch returns the fresh value and the txn is retried             |
| watch_key     | one range, then one watch stream from the next revision (no request per    |
|               | check: the value is pushed); re-opened the same way when the stream breaks |
| lease_key     | a lease grant and a put on it; then one keep-alive per refresh (no raft     |
|               | write); an expired lease is granted anew and the key put again             |
| watch_presence| as watch_key, one stream per key shared by the backend's callers           |

Invariants: every call is bounded by the operation timeout (a deadline on the monotonic clock, and
a per-request HTTP timeout); connection failures move to the next endpoint of
``host:port,host:port``; every failure surfaces as :class:`StoreConnectionError` with a hint. An
``add`` whose request was lost *after* it reached etcd may be applied twice when it is retried
(at-least-once): heartbeats and change hints do not care, and only a member dying mid-request can
cause it. Nothing that must count each node once is a counter: barriers are one key per node.

Security (``EtcdSecurity``, from ``--rdzv-conf``): over https with ``ca_file`` (etcd's certificate is
verified against it only, never against the machine's CA bundle or ``REQUESTS_CA_BUNDLE``); a
client certificate for etcd's ``--client-cert-auth``; and etcd's own users: the backend
authenticates with ``user`` and the password, sends the token with every request, and
authenticates again when etcd says the token expired. etcd's gateway ignores a client
certificate's common name when auth is on (and refuses such a request), so a user goes with TLS
and a password, a client certificate with mutual TLS alone.
Proxy variables in the environment (``https_proxy`` and the like) are not used: etcd is reached
directly, as the TCPStore is.

Cleanup: every key this backend writes is attached to one *job lease* (``attach_job_lease``), which
every agent of the job keeps alive; when the last agent is gone etcd deletes the job's keys after
the lease's TTL, so a cluster that runs many jobs is not polluted and a rerun with the same
``--rdzv-id`` starts clean.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from resilrun.errors import StoreConnectionError
from resilrun.option_values import parse_endpoints
from resilrun.rendezvous.api import KeyView, LeasedKey, Presence, RendezvousBackend
from resilrun.rendezvous.etcd_http import GatewayEndpoint, GatewayStream, TLSFailure, tls_context
from resilrun.rendezvous.etcd_push import KeyWatch, WatchedKey
from resilrun.rendezvous.etcd_push import LeasedKey as EtcdLeasedKey
from resilrun.rendezvous.etcd_push import b64 as _b64
from resilrun.rendezvous.etcd_push import kv_value as _value

logger = logging.getLogger(__name__)


# Connecting to a live etcd on a LAN takes milliseconds; 2 s bounds a dead host that drops SYNs
# before we fail over to the next endpoint.
_CONNECT_TIMEOUT_S = 2.0
# A single request's answer: etcd answers in milliseconds. A write a dying leader swallowed is only
# failed by etcd after its own ~7 s request timeout, longer than a heartbeat timeout, so the first
# attempts give up after 2 s and retry; an election takes 1-4 s, so a third attempt lands on the new
# leader. Then the timeout doubles up to 8 s, for requests that are merely slow (huge N, overload).
_FIRST_REQUEST_TIMEOUT_S = 2.0
_SHORT_ATTEMPTS = 3
_MAX_REQUEST_TIMEOUT_S = 8.0
# 500/503/504 come from the gateway while there is no leader or a request timed out inside etcd;
# 408 and 429 are transient too. Any other status means a bug or a server that is not etcd.
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Backoff between retries: an election on a 3-member cluster takes ~1-2 s (1 s election timeout).
_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 0.5
# etcd refuses a transaction of more operations than its --max-txn-ops (128 by default).
_MAX_TXN_OPS = 128
# A watch stream that has said nothing for this long is re-opened (one range, one watch): a stream
# whose connection was cut without a FIN would otherwise look current for ever. Readers re-read
# the rendezvous document every refresh interval anyway, so this only bounds the streams' staleness.
_WATCH_IDLE_S = 30.0
# etcd >= 3.4 serves the gateway at /v3/ (naming it skips a discovery request per endpoint).
_API = "/v3"
# Job keys outlive their last agent by this long: long enough that every agent being cut off from
# etcd for a moment does not erase a running job, short enough that a rerun soon starts clean.
JOB_LEASE_TTL_S = 120


class _GatewayError(Exception):
    """A non-200 answer of etcd's gateway (kept as the cause of the StoreConnectionError)."""


@dataclass(frozen=True)
class EtcdSecurity:
    """How to reach a protected etcd (see the module docstring); empty: plain http, no user."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None


class EtcdBackend(RendezvousBackend):
    """See base class. Talks to an etcd v3 cluster through its JSON gateway (``etcd_http``).

    Its requests are also the ``etcd_push.GatewayRequests`` its watches and leased keys use.
    """

    def __init__(
        self, endpoints: Sequence[tuple[str, int]], *, timeout: timedelta, security: EtcdSecurity | None = None
    ) -> None:
        """Build the clients; no request is made until the first call.

        Args:
            endpoints: one or more ``(host, port)`` of the same etcd cluster, tried in order.
            timeout: bound of each call, retries and failovers included.
            security: TLS and authentication (None: plain http).

        Raises:
            StoreConnectionError: the CA, certificate or key file cannot be loaded.
        """
        if not endpoints:
            raise ValueError("EtcdBackend needs at least one endpoint")
        self.endpoints = [f"{host}:{port}" for host, port in endpoints]
        self.timeout_s = timeout.total_seconds()
        self.security = security or EtcdSecurity()
        context = None
        if self.security.tls:
            try:
                context = tls_context(self.security.ca_file, self.security.cert_file, self.security.key_file)
            except (OSError, ssl.SSLError) as exc:
                raise StoreConnectionError(
                    f"TLS with etcd at {self.endpoint_list} cannot start: {exc}",
                    hint="check --rdzv-conf ca_file, cert_file and key_file (PEM files this user can read)",
                ) from exc
        # etcd is reached directly, as the TCPStore is: the http(s)_proxy that cluster nodes often
        # carry for the internet would fail every request (or see the job's keys); no proxy is read.
        self._gateways = [GatewayEndpoint(host, port, context, _CONNECT_TIMEOUT_S) for host, port in endpoints]
        self._token: str | None = None  # etcd's auth token, once authenticated (with a user)
        self._token_lock = threading.Lock()
        self._current = 0
        self._lock = threading.Lock()  # guards _current and _revisions, not the requests
        self._revisions: dict[str, tuple[int, int]] = {}  # key -> (value, mod_revision) last seen by add
        self._lease_id: int | None = None
        self._keepalive: threading.Thread | None = None
        self._stop = threading.Event()
        self._watches: list[KeyWatch] = []
        self._shared: dict[str, KeyWatch] = {}  # presence watches, one per key

    # -- the contract ---------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        kvs = self.post("/kv/range", {"key": _b64(key)}).get("kvs")
        return _value(kvs[0]) if kvs else None

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values: list[bytes | None] = []
        for start in range(0, len(keys), _MAX_TXN_OPS):
            chunk = keys[start : start + _MAX_TXN_OPS]
            ranges = [{"request_range": {"key": _b64(key)}} for key in chunk]
            result = self.post("/kv/txn", {"compare": [], "success": ranges})
            for response in result.get("responses", []):
                kvs = response.get("response_range", {}).get("kvs")
                values.append(_value(kvs[0]) if kvs else None)
        if len(values) != len(keys):
            raise StoreConnectionError(
                f"etcd at {self.endpoint_list} answered {len(values)} of {len(keys)} reads of one transaction",
                hint="check that --rdzv-endpoint names etcd's client URLs (an etcd v3 gateway)",
            )
        return values

    def set(self, key: str, value: bytes) -> None:
        self.post("/kv/put", self._put(key, value))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        if expected is None:
            compare = {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        else:
            compare = {"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(expected)}
        result = self._txn(compare, key, desired)
        if result.get("succeeded"):
            return True
        kvs = _failure_kvs(result)
        return bool(kvs) and _value(kvs[0]) == desired

    def add(self, key: str, amount: int) -> int:
        if amount == 0:
            kvs = self.post("/kv/range", {"key": _b64(key)}).get("kvs")
            return int(_value(kvs[0]) or b"0") if kvs else 0
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            known = self._revisions.get(key)
        while True:
            if known is None:  # never seen: assume absent; a lost race tells us the truth
                compare = {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
                base = 0
            else:
                base, revision = known
                compare = {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(revision)}
            new = base + amount
            result = self._txn(compare, key, str(new).encode())
            if result.get("succeeded"):
                revision = int(result.get("header", {}).get("revision", 0))
                with self._lock:
                    self._revisions[key] = (new, revision)
                return new
            kvs = _failure_kvs(result)
            known = (int(_value(kvs[0]) or b"0"), int(kvs[0]["mod_revision"])) if kvs else None
            if time.monotonic() >= deadline:  # only under extreme contention on one counter
                raise StoreConnectionError(
                    f"etcd at {self.endpoint_list}: add to '{key}' lost every race for {self.timeout_s:g} s",
                    hint="too many writers on one counter; raise --rdzv-conf read_timeout=SECONDS",
                )

    def watch_key(self, key: str) -> KeyView | None:
        """See base class: a thread follows one watch stream on ``key`` (one HTTP connection)."""
        return WatchedKey(self._watch(key))

    def watch_counter(self, key: str) -> KeyView | None:
        """See base class: as ``watch_key`` (one stream, one HTTP connection)."""
        return WatchedKey(self._watch(key))

    def watch_presence(self, key: str) -> Presence | None:
        """See base class: one watch stream per key, shared by every caller of this backend."""
        return WatchedKey(self._watch(key, shared=True))

    def leases(self) -> bool:
        return True

    def lease_key(self, key: str, value: bytes, ttl_s: int) -> LeasedKey | None:
        """See base class: a lease granted (etcd may raise the TTL to its minimum), the key put on it."""
        return EtcdLeasedKey(self, key, value, ttl_s)

    def _watch(self, key: str, *, shared: bool = False) -> KeyWatch:
        with self._lock:
            if shared and key in self._shared:
                return self._shared[key]
            watch = KeyWatch(self, key)
            self._watches.append(watch)
            if shared:
                self._shared[key] = watch
            return watch

    def close(self) -> None:
        """Stop keeping the job lease alive (the job's keys expire once no agent refreshes it) and
        end this backend's watches."""
        self._stop.set()
        with self._lock:
            watches, self._watches = self._watches, []
            self._shared = {}
        for watch in watches:
            watch.close()
        if self._keepalive is not None:
            self._keepalive.join(timeout=_CONNECT_TIMEOUT_S + _MAX_REQUEST_TIMEOUT_S)
        for gateway in self._gateways:
            gateway.close()

    # -- job lease ------------------------------------------------------------------------------
    def attach_job_lease(self, key: str, ttl_s: int = JOB_LEASE_TTL_S) -> int:
        """Attach every later write to the job's lease, and keep it alive from this process.

        The first agent grants a lease and records its id at ``key`` (attached to the lease itself);
        the others reuse it. If the recorded lease has expired (every agent was gone for ``ttl_s``),
        a new one replaces it. Returns the lease id.
        """
        while True:
            raw = self.get(key)
            if raw is not None:
                lease_id = int(raw)
                if self._lease_ttl(lease_id) > 0:
                    break
            granted = self.post("/lease/grant", {"TTL": str(ttl_s), "ID": "0"})
            candidate = int(granted["ID"])
            self._lease_id = candidate
            if self.compare_set(key, raw, str(candidate).encode()):
                lease_id = candidate
                break
            self._lease_id = None
            self.post("/kv/lease/revoke", {"ID": str(candidate)})
        self._lease_id = lease_id
        interval = max(ttl_s / 4, 1.0)
        self._keepalive = threading.Thread(
            target=self._keep_alive, args=(lease_id, interval), name="resilrun-etcd-lease", daemon=True
        )
        self._keepalive.start()
        return lease_id

    def _keep_alive(self, lease_id: int, interval: float) -> None:
        failing = False
        while not self._stop.wait(interval):
            try:
                self.post("/lease/keepalive", {"ID": str(lease_id)})
                failing = False
            except StoreConnectionError as exc:
                if not failing:
                    logger.warning("could not refresh the job's etcd lease: %s", exc.message)
                failing = True

    # -- mechanism ------------------------------------------------------------------------------
    # post, open_stream and endpoint_index are public: they are the ``etcd_push.GatewayRequests``
    # that this backend's watches and leased keys run on.
    def _put(self, key: str, value: bytes) -> dict[str, Any]:
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if self._lease_id is not None:
            put["lease"] = str(self._lease_id)
        return put

    def _txn(self, compare: dict[str, Any], key: str, value: bytes) -> dict[str, Any]:
        body = {
            "compare": [compare],
            "success": [{"request_put": self._put(key, value)}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        }
        return self.post("/kv/txn", body)

    def open_stream(self, path: str, body: dict[str, Any]) -> tuple[GatewayStream, int]:
        """A streaming POST to the current endpoint (a watch), on a connection of its own for as
        long as it lasts: the stream (status 200) and the endpoint's index.

        Raises:
            StoreConnectionError: the endpoint refused or did not answer (the caller re-opens later).
        """
        token = None if self.security.user is None else (self._token or self._authenticate(None))
        with self._lock:
            index = self._current
        try:
            stream = self._gateways[index].open_stream(_API + path, body, _auth(token), _WATCH_IDLE_S)
        except (TLSFailure, OSError, http.client.HTTPException) as exc:
            with self._lock:
                if self._current == index:
                    self._current = (index + 1) % len(self._gateways)
            raise StoreConnectionError(f"etcd at {self.endpoints[index]}: could not open a watch: {exc}") from exc
        if stream.status != 200:
            stream.close()
            if stream.status == 401 and token is not None:
                self._authenticate(token)
            raise StoreConnectionError(f"etcd at {self.endpoints[index]} refused a watch: HTTP {stream.status}")
        return stream, index

    def endpoint_index(self) -> int:
        """The index of the endpoint that requests go to now (a watch re-opens when it moves)."""
        with self._lock:
            return self._current

    def _lease_ttl(self, lease_id: int) -> int:
        return int(self.post("/kv/lease/timetolive", {"ID": str(lease_id)}).get("TTL", -1))

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One gateway request (JSON in, JSON out), with failover and retries; with a user, under its
        token, authenticating first (and again once when etcd says the token is no longer valid)."""
        if self.security.user is None:
            return self._call(path, body)
        token = self._token or self._authenticate(None)
        try:
            return self._call(path, body, token)
        except _TokenRejected:
            return self._call(path, body, self._authenticate(token))

    def _authenticate(self, stale: str | None) -> str:
        """A token for the user (a new one unless another thread already replaced ``stale``).

        Raises:
            StoreConnectionError: etcd refused the user or the password, or could not be reached.
        """
        with self._token_lock:
            if self._token is not None and self._token != stale:
                return self._token
            body = {"name": self.security.user, "password": self.security.password or ""}
            try:
                token = self._call("/auth/authenticate", body).get("token")
            except StoreConnectionError as exc:
                if "authentication failed" in exc.message:
                    raise StoreConnectionError(
                        f"etcd at {self.endpoint_list} refused user '{self.security.user}': wrong user or password",
                        hint="check --rdzv-conf user=NAME and the password (password_file=PATH, or "
                        "RESILRUN_ETCD_PASSWORD)",
                    ) from None
                raise
            if not isinstance(token, str) or not token:
                raise StoreConnectionError(
                    f"etcd at {self.endpoint_list} gave user '{self.security.user}' no token",
                    hint="is authentication enabled on this etcd (etcdctl auth enable)?",
                )
            self._token = token
            return token

    @property
    def endpoint_list(self) -> str:
        """The members, as ``--rdzv-endpoint`` names them (for logs and messages)."""
        return ",".join(self.endpoints)

    def _call(self, path: str, body: dict[str, Any], token: str | None = None) -> dict[str, Any]:
        """POST ``body`` to the gateway's ``path``, failing over and retrying until the deadline.

        Each attempt has its own read timeout, short at first, then doubling: a request a dead leader
        swallowed is abandoned after 2 s and retried (the new leader answers it), while a request
        that is merely slow at scale still gets up to 8 s on later attempts.
        """
        deadline = time.monotonic() + self.timeout_s
        backoff = _BACKOFF_FIRST_S
        attempt_timeout = _FIRST_REQUEST_TIMEOUT_S
        last: Exception | None = None
        tried = timeouts = 0
        while True:
            with self._lock:
                index = self._current
            remaining = max(deadline - time.monotonic(), 0.05)
            try:
                status, data = self._gateways[index].post(
                    _API + path, body, _auth(token), min(attempt_timeout, remaining)
                )
                if status == 200:
                    result: dict[str, Any] = json.loads(data)
                    return result
                text = data[:200].decode(errors="replace")
                if status == 401 and token is not None:
                    raise _TokenRejected(text)  # expired: the caller authenticates again
                last = _GatewayError(f"HTTP {status} from {self.endpoints[index]}: {text}")
                if status == 403:
                    raise StoreConnectionError(
                        f"etcd at {self.endpoint_list} denied user '{self.security.user}' a request on {path}",
                        hint="grant the user's role readwrite on the key prefix resilrun/ "
                        "(etcdctl role grant-permission ROLE --prefix=true readwrite resilrun/)",
                    )
                if status not in _RETRYABLE_STATUS:
                    break  # a bug or not an etcd gateway: retrying cannot help
            except TLSFailure as exc:  # a certificate problem: no retry fixes it
                raise StoreConnectionError(
                    f"TLS with etcd at {self.endpoints[index]} failed: {str(exc)[:300]}",
                    hint="check --rdzv-conf ca_file (the CA that signed etcd's certificate) and, where etcd "
                    "asks for one, cert_file and key_file",
                ) from exc
            except TimeoutError as exc:
                last = exc
                timeouts += 1
                if timeouts >= _SHORT_ATTEMPTS:
                    attempt_timeout = min(attempt_timeout * 2, _MAX_REQUEST_TIMEOUT_S)
            except (OSError, http.client.HTTPException, ValueError) as exc:  # refused, reset, bad JSON
                last = exc
            tried += 1
            with self._lock:
                if self._current == index:  # move on, unless another thread already did
                    self._current = (index + 1) % len(self._gateways)
            if time.monotonic() >= deadline:
                break
            if tried % len(self._gateways) == 0:  # every endpoint failed once: back off
                time.sleep(min(backoff, max(deadline - time.monotonic(), 0.0)))
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
        detail = str(last).splitlines()[0][:300] if last is not None and str(last) else type(last).__name__
        hint = (
            "check --rdzv-endpoint (etcd's client URLs, host:2379[,host:2379]), that a quorum of etcd "
            "members is up, and firewalls; raise the wait with --rdzv-conf read_timeout=SECONDS"
        )
        if not self.security.tls and "closed connection without response" in detail:
            hint = "etcd closes plain-http connections when it speaks https: give --rdzv-conf ca_file=PATH; " + hint
        raise StoreConnectionError(
            f"etcd at {self.endpoint_list} did not answer within {self.timeout_s:g} s: {detail}", hint=hint
        ) from last


class _TokenRejected(Exception):
    """etcd answered 401: the auth token expired or was revoked (authenticate again)."""


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": token} if token else {}


def _failure_kvs(result: dict[str, Any]) -> list[dict[str, Any]]:
    for response in result.get("responses", []):
        ranged = response.get("response_range")
        if ranged is not None:
            return list(ranged.get("kvs", []))
    return []


def open_etcd(endpoint: str, *, timeout: timedelta, security: EtcdSecurity | None = None) -> EtcdBackend:
    """An :class:`EtcdBackend` for ``--rdzv-endpoint host:2379[,host:2379...]``, checked reachable.

    Raises:
        StoreConnectionError: no endpoint answered within ``timeout`` (or TLS or the user failed).
    """
    backend = EtcdBackend(parse_endpoints(endpoint), timeout=timeout, security=security)
    try:
        backend.post("/maintenance/status", {})
    except StoreConnectionError as exc:
        with contextlib.suppress(Exception):
            backend.close()
        if "did not answer" not in exc.message:
            raise  # TLS, the user or its permissions: the message says which
        raise StoreConnectionError(
            f"could not reach etcd at {backend.endpoint_list} within {timeout.total_seconds():g} s",
            hint=exc.hint,
        ) from exc.__cause__
    return backend
