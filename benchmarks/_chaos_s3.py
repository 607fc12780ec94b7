"""S3 for the chaos run: moto's real HTTP server on loopback, and a proxy in front that fails requests.

Why a proxy: moto has no fault injection, and the point is to fail the real HTTP path boto3 uses
(retries, connection handling), not a mock. The proxy answers the next N requests with a 500, a 503
SlowDown, a dropped connection (what a timeout looks like to the client, in milliseconds instead of
the 60 s read timeout) or a delay, then forwards again. Loopback only; every upstream call is bounded.
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# Obviously fake credentials; the run's logs are grepped for them.
FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIACHAOSFAKEKEY0001",
    "AWS_SECRET_ACCESS_KEY": "chaosFakeSecretKey0123456789abcdefGHIJKL",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
MODES = ("500", "503", "drop", "slow")
_UPSTREAM_TIMEOUT_S = 30.0
_SLOW_S = 2.0


class S3Chaos:
    """A moto server, a bucket, and a fault-injecting proxy; ``endpoint_url`` is the proxy's."""

    def __init__(self, bucket: str = "chaos") -> None:
        from moto.server import ThreadedMotoServer

        os.environ.update(FAKE_ENV)  # moto and the harness's own client sign with the fake keys
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self.upstream = f"{host}:{port}"
        self.bucket = bucket
        self.client().create_bucket(Bucket=bucket)
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self.served: dict[str, int] = {}
        self.requests = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.chaos = self  # type: ignore[attr-defined]  # read by the handler
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=f"http://{self.upstream}", region_name="us-east-1")

    def inject(self, count: int, rng: random.Random) -> list[str]:
        """Fail the next ``count`` requests, each with a mode drawn from ``rng``; returns the modes."""
        modes = [rng.choice(MODES) for _ in range(count)]
        with self._lock:
            self._pending.extend(modes)
        return modes

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def take(self) -> str | None:
        with self._lock:
            self.requests += 1
            if not self._pending:
                return None
            mode = self._pending.pop(0)
            self.served[mode] = self.served.get(mode, 0) + 1
            return mode

    def completed_steps(self, prefix: str) -> list[int]:
        """Steps with a COMPLETE marker under ``prefix`` (read behind the proxy's back)."""
        keys = self.client().list_objects_v2(Bucket=self.bucket, Prefix=prefix).get("Contents", [])
        return sorted(
            int(k["Key"].split("/")[-2].removeprefix("step_")) for k in keys if k["Key"].endswith("COMPLETE.json")
        )

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._moto.stop()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        pass

    def _handle(self) -> None:
        chaos: S3Chaos = self.server.chaos  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        mode = chaos.take()
        if mode == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if mode in ("500", "503"):
            code = "InternalError" if mode == "500" else "SlowDown"
            payload = f"<Error><Code>{code}</Code><Message>chaos</Message></Error>".encode()
            self.send_response(int(mode))
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            return
        if mode == "slow":
            time.sleep(_SLOW_S)
        forward = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")}
        conn = http.client.HTTPConnection(chaos.upstream, timeout=_UPSTREAM_TIMEOUT_S)
        try:
            conn.request(self.command, self.path, body=body, headers=forward)
            response = conn.getresponse()
            data = response.read()
            self.send_response(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() in ("transfer-encoding", "connection"):
                    continue
                if key.lower() == "content-length" and self.command != "HEAD":
                    continue  # a HEAD's Content-Length is the object's size: passed through
                self.send_header(key, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle  # noqa: N815 - http.server's naming
