"""Shared fixtures: a clean environment for every test, free loopback ports, snapshots, and S3 (moto)."""

from __future__ import annotations

import http.client
import importlib.util
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["tests.timeline"]

_STRIP_PREFIXES = ("RESILRUN_", "PET_", "TORCHELASTIC_")
_STRIP_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tests never inherit a launcher's variables from the shell that runs them."""
    for name in list(os.environ):
        if name.startswith(_STRIP_PREFIXES) or name in _STRIP_NAMES:
            monkeypatch.delenv(name, raising=False)
    yield
    # cli.main() configures the "resilrun" logger for a real process (its own stderr handler, no
    # propagation); undo it so a later test in this worker can capture records again.
    package_logger = logging.getLogger("resilrun")
    package_logger.handlers.clear()
    package_logger.propagate = True
    package_logger.setLevel(logging.NOTSET)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def port() -> int:
    return free_port()


def wait_until(predicate: Callable[[], object], timeout: float = 5.0, what: str = "the condition") -> None:
    """Return once ``predicate()`` is true; fail the test if it is not within ``timeout`` seconds.

    For what another thread or process does with no event to wait on: a deadline, never a fixed sleep."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        time.sleep(0.01)


# -- snapshots -------------------------------------------------------------------------------------
def make_snapshot(tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> bytes:
    """A snapshot buffer (a safetensors file) laid out by resilrun.snapshot.layout, as a worker makes one."""
    import torch

    from resilrun.snapshot.layout import TORCH_TO_CODE, build_layout

    specs = [(name, TORCH_TO_CODE[str(t.dtype).removeprefix("torch.")], tuple(t.shape)) for name, t in tensors.items()]
    layout = build_layout(specs, metadata)
    buffer = bytearray(layout.total_bytes)
    buffer[: layout.data_start] = layout.header
    for entry in layout.entries:
        raw = tensors[entry.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        buffer[layout.data_start + entry.begin : layout.data_start + entry.end] = raw
    return bytes(buffer)


# The storage tests' payload: 1 KiB holding every byte value (the contract and the per-backend files).
STORAGE_DATA = bytes(range(256)) * 4


# -- S3: a real moto server on loopback, and a fault-injecting proxy in front of it ------------------
# Obviously fake credentials: tests grep every error message for them.
FAKE_ACCESS_KEY_ID = "AKIARESILRUNFAKE0001"
FAKE_SECRET_ACCESS_KEY = "resilrunFakeSecretKey0123456789abcdefGHIJ"
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": FAKE_ACCESS_KEY_ID,
    "AWS_SECRET_ACCESS_KEY": FAKE_SECRET_ACCESS_KEY,
    "AWS_SESSION_TOKEN": "resilrunFakeSessionToken",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Never read the developer's real profile, config or an instance role.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
_AWS_STRIP = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE")


@dataclass(frozen=True)
class S3Server:
    """A moto S3 server in this process, on 127.0.0.1 and a port the OS chose."""

    endpoint_url: str

    def client(self) -> Any:
        """A plain boto3 client, for arranging and inspecting state behind the Storage's back."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto in server mode (real HTTP, not in-process mocks); skipped without moto, except in CI."""
    if importlib.util.find_spec("moto") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("moto is required in CI")
        pytest.skip("moto is not installed")
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as patch:
        for name in _AWS_STRIP:
            patch.delenv(name, raising=False)
        for name, value in _AWS_ENV.items():
            patch.setenv(name, value)
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield S3Server(f"http://{host}:{port}")
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket per test (moto's state is shared by the whole session)."""
    name = f"resilrun-test-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name


@dataclass
class Fault:
    """Answer matching requests with ``status`` and an S3 error body, ``remaining`` times (None: always)."""

    status: int
    code: str
    remaining: int | None
    match: Callable[[str, str, dict[str, str]], bool]
    message: str = "injected by the test proxy"


class FaultProxy:
    """An HTTP proxy on loopback in front of moto that fails chosen requests, like a flaky S3.

    moto has no fault injection of its own, so this is how tests show retries after 5xx/throttling,
    bounded failure, multipart abort, and (emulated) ExpectedBucketOwner enforcement.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.failures_served = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _ProxyHandler)
        self.server.daemon_threads = True
        self.server.proxy = self  # type: ignore[attr-defined]  # read by the handler
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def fail(
        self,
        status: int,
        code: str,
        *,
        times: int | None = None,
        match: Callable[[str, str, dict[str, str]], bool] = lambda method, path, headers: True,
        message: str = "injected by the test proxy",
    ) -> None:
        with self.lock:
            self.faults.append(Fault(status, code, times, match, message))

    def take_fault(self, method: str, path: str, headers: dict[str, str]) -> Fault | None:
        with self.lock:
            self.requests.append((method, path, headers))
            for fault in self.faults:
                if (fault.remaining is None or fault.remaining > 0) and fault.match(method, path, headers):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                    self.failures_served += 1
                    return fault
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        pass

    def _handle(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        fault = proxy.take_fault(self.command, self.path, headers)
        if fault is not None:
            message = fault.message.format(authorization=headers.get("authorization", ""))
            payload = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                f"<Message>{message}</Message><RequestId>test</RequestId></Error>"
            ).encode()
            self.send_response(fault.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            return
        forward = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")}
        conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
        try:
            conn.request(self.command, self.path, body=body, headers=forward)
            response = conn.getresponse()
            data = response.read()
            self.send_response(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() in ("transfer-encoding", "connection"):
                    continue
                if key.lower() == "content-length" and self.command != "HEAD":
                    continue
                self.send_header(key, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle  # noqa: N815 - http.server's naming


@pytest.fixture
def s3_proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3_server.endpoint_url)
    try:
        yield proxy
    finally:
        proxy.close()


# -- etcd: real servers on loopback (skipped without the etcd binary, except in CI) -----------------
def _require_etcd() -> None:
    from tests.etcd_server import etcd_binary

    if etcd_binary() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("etcd is required in CI (make test-tools installs Debian's etcd-server as root)")
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One single-member etcd for the session; tests keep apart by their keys (fresh run ids)."""
    _require_etcd()
    from tests.etcd_server import EtcdCluster

    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"), size=1).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[Any]:
    """A fresh three-member etcd cluster on loopback (tests may kill members)."""
    _require_etcd()
    from tests.etcd_server import EtcdCluster

    cluster = EtcdCluster(tmp_path / "etcd", size=3).start()
    try:
        yield cluster
    finally:
        cluster.stop()
