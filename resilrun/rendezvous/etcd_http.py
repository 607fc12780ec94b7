"""HTTP/1.1 to etcd's v3 JSON gateway, on kept-alive connections of the standard library.

Why not a general HTTP client: every agent renews its liveness lease and reads heartbeats every
second or so, and on a host running many agents (or an agent whose cores train) the client's own
CPU per request is what a request costs there. ``requests`` (through ``etcd3gw``, which this
replaced) spent about 3.4x the client CPU of ``http.client`` on the same kept-alive request to a
local etcd (`benchmarks/etcd_grpc_vs_gateway.py` reports the client CPU per request kind), and
answered later; a gRPC client sits between the two and would bring grpcio and protobuf. What a
general client adds, this does not need: etcd is reached directly (proxy variables are never
read, as for the TCPStore), TLS trusts the job's ``ca_file`` only (or the system's CAs without
one), and answers are small JSON documents or a watch's stream of them.

Invariants: a connection serves one request at a time (a pool per endpoint, taken and given back);
a connection the server may have closed while idle is retried once on a fresh one before the
request counts as failed (etcd never saw it); any other failure closes the connection, so a
half-read answer never reaches the next request.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

# Idle connections kept per endpoint: one per thread that talks to etcd at once (an agent has a
# handful); more are opened when needed and closed instead of kept.
_POOL = 8
# Failures of a kept-alive connection that mean the server closed it while it was idle: the
# request never reached etcd, so it is sent again on a fresh connection.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class TLSFailure(Exception):
    """The TLS handshake (or etcd's demand for a client certificate) failed: no retry fixes it."""


class GatewayEndpoint:
    """One etcd member's gateway, ``host:port``, over http or https."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext | None, connect_timeout_s: float) -> None:
        """``context``: TLS (None: plain http)."""
        self.host, self.port = host, port
        self._context = context
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float) -> tuple[int, bytes]:
        """POST ``body`` as JSON; the status and the whole answer.

        Raises:
            TLSFailure: the handshake or a TLS alert failed the request on a fresh connection.
            TimeoutError: no answer within ``timeout_s`` (connecting: the connect timeout).
            OSError, http.client.HTTPException: the connection failed (refused, reset, garbage).
        """
        payload = json.dumps(body, separators=(",", ":")).encode()
        conn, reused = self._take()
        try:
            try:
                response = self._send(conn, path, payload, headers, timeout_s)
            except (*_STALE, ssl.SSLError):
                if not reused:
                    raise
                conn.close()  # closed by the server while idle: no answer began, etcd never saw it
                conn = self._connection()
                response = self._send(conn, path, payload, headers, timeout_s)
            data = response.read()  # a failure from here on is the request's own: never sent again
        except BaseException as exc:
            _fail(conn, exc)
        if response.will_close:
            conn.close()
        else:
            self._give(conn)
        return response.status, data

    def open_stream(self, path: str, body: dict[str, Any], headers: dict[str, str], idle_s: float) -> GatewayStream:
        """POST ``body`` on a connection of its own and return the answer as it streams (a watch);
        a read that waits ``idle_s`` for the next line raises TimeoutError.

        Raises:
            as ``post``.
        """
        conn = self._connection()
        try:
            response = self._send(conn, path, json.dumps(body).encode(), headers, idle_s)
        except BaseException as exc:
            _fail(conn, exc)
        return GatewayStream(conn, response)

    def close(self) -> None:
        """Close the idle connections (ones in use are closed when given back)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _send(
        self, conn: http.client.HTTPConnection, path: str, payload: bytes, headers: dict[str, str], timeout_s: float
    ) -> http.client.HTTPResponse:
        if conn.sock is None:
            conn.connect()  # under the connect timeout the connection was made with
        conn.sock.settimeout(timeout_s)
        conn.request("POST", path, body=payload, headers={"Content-Type": "application/json", **headers})
        return conn.getresponse()

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connection(), False

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < _POOL:
                self._idle.append(conn)
                return
        conn.close()

    def _connection(self) -> http.client.HTTPConnection:
        if self._context is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=self._connect_timeout_s)
        return http.client.HTTPSConnection(self.host, self.port, timeout=self._connect_timeout_s, context=self._context)


def _fail(conn: http.client.HTTPConnection, exc: BaseException) -> NoReturn:
    """Close ``conn`` (a half-read answer must never reach the next request) and raise ``exc``,
    a TLS failure as ``TLSFailure``."""
    conn.close()
    if isinstance(exc, ssl.SSLError):
        raise TLSFailure(str(exc)) from exc
    raise exc


class GatewayStream:
    """A streamed answer (a watch): its status, its lines as they come, and a ``close`` that
    another thread may call to end a read blocked on it."""

    def __init__(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        self._conn = conn
        self._response = response
        self.status = response.status

    def lines(self) -> Iterator[bytes]:
        """The answer's lines until it ends; TimeoutError when one is longer in coming than the idle time."""
        while True:
            line = self._response.readline()
            if not line:
                return
            yield line

    def close(self) -> None:
        """Shut the socket down first: closing a socket that another thread reads does not wake that
        thread on Linux, shutting it down does."""
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(Exception):
            self._response.close()
        self._conn.close()


def tls_context(ca_file: str | None, cert_file: str | None, key_file: str | None) -> ssl.SSLContext:
    """Verify etcd against ``ca_file`` only where one is given (else the system's CAs; never
    ``REQUESTS_CA_BUNDLE``), hostname included; present the client certificate where given.

    Raises:
        OSError, ssl.SSLError: a file is missing or is not a certificate or key.
    """
    context = ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context
