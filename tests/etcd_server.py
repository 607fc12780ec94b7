"""Real etcd servers on loopback for tests and benchmarks: one member, or a three-member cluster.

Every member listens on free 127.0.0.1 ports with its own data directory; ``stop()`` kills the
processes by their recorded pids. With ``tls`` (tests/helpers/tls_certs.py) clients speak https,
with ``client_cert_auth`` they must show a certificate the CA signed, and ``enable_auth`` turns on
etcd's users (a root and one user allowed a key prefix), as an administrator would.
Debian's ``etcd-server`` package provides the ``etcd`` binary
(``make test-tools`` installs it as root on Debian).
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.helpers.tls_certs import TlsFiles


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probe.bind(("127.0.0.1", 0))
            sockets.append(probe)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for probe in sockets:
            probe.close()


# A member's health, asked from inside its host's network namespace (the test's own cannot reach it).
_PROBE = (
    "import sys, urllib.request\n"
    "try:\n"
    "    body = urllib.request.urlopen(f'http://{sys.argv[1]}/health', timeout=1).read()\n"
    "except OSError:\n"
    "    sys.exit(1)\n"
    "sys.exit(0 if b'\"true\"' in body else 1)\n"
)


@dataclass(frozen=True)
class Placement:
    """Where a member runs: an address of its own, and how a command is run there (a netns host)."""

    addr: str
    command: Callable[[list[str]], list[str]]


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    placement: Placement | None = None
    tls: TlsFiles | None = None
    client_cert_auth: bool = False

    @property
    def addr(self) -> str:
        return self.placement.addr if self.placement is not None else "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.client_port}"

    def healthy(self) -> bool:
        if self.placement is not None:
            argv = self.placement.command([sys.executable, "-c", _PROBE, self.endpoint])
            return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
        try:
            if self.tls is None:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as response:
                    return b'"true"' in response.read()
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            if self.client_cert_auth:
                context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
            with urllib.request.urlopen(f"https://{self.endpoint}/health", timeout=1, context=context) as response:
                return b'"true"' in response.read()
        except (urllib.error.URLError, OSError):
            return False


@dataclass
class EtcdCluster:
    """One to three etcd members on loopback, or one per ``placements`` (each on its own host, with
    etcd's default ports); ``endpoint`` is the ``--rdzv-endpoint`` value."""

    root: Path
    size: int = 1
    members: list[Member] = field(default_factory=list)
    placements: Sequence[Placement] = ()
    tls: TlsFiles | None = None
    client_cert_auth: bool = False

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.root.mkdir(parents=True, exist_ok=True)
        if self.placements:
            self.size = len(self.placements)
        ports = [2379, 2380] * self.size if self.placements else _free_ports(2 * self.size)
        token = f"resilrun-test-{uuid.uuid4().hex[:8]}"
        for index in range(self.size):
            name = f"m{index}"
            placement = self.placements[index] if self.placements else None
            paths = self.root / name, self.root / f"{name}.log"
            self.members.append(
                Member(
                    name,
                    ports[2 * index],
                    ports[2 * index + 1],
                    *paths,
                    placement=placement,
                    tls=self.tls,
                    client_cert_auth=self.client_cert_auth,
                )
            )
        scheme = "https" if self.tls is not None else "http"
        initial = ",".join(f"{m.name}=http://{m.addr}:{m.peer_port}" for m in self.members)
        for member in self.members:
            addr = member.addr
            argv = [
                binary,
                "--name", member.name,
                "--data-dir", str(member.data_dir),
                "--listen-client-urls", f"{scheme}://{addr}:{member.client_port}",
                "--advertise-client-urls", f"{scheme}://{addr}:{member.client_port}",
                "--listen-peer-urls", f"http://{addr}:{member.peer_port}",
                "--initial-advertise-peer-urls", f"http://{addr}:{member.peer_port}",
                "--initial-cluster", initial,
                "--initial-cluster-state", "new",
                "--initial-cluster-token", token,
                # etcd's defaults (100 ms heartbeats, 1 s election timeout): what users run.
                "--heartbeat-interval", "100",
                "--election-timeout", "1000",
                "--logger", "zap",
                "--log-level", "warn",
            ]  # fmt: skip
            if self.tls is not None:
                argv += ["--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key)]
                if self.client_cert_auth:
                    argv += ["--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
            if member.placement is not None:
                argv = member.placement.command(argv)
            with open(member.log, "wb") as log:
                member.popen = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
                )
        deadline = time.monotonic() + timeout
        while not all(m.healthy() for m in self.members):
            for member in self.members:
                if member.popen is not None and member.popen.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"etcd {member.name} exited: {member.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd did not become healthy within {timeout} s")
            time.sleep(0.1 if not self.placements else 0.5)
        return self

    @property
    def endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def enable_auth(self, user: str, password: str, prefix: str) -> None:
        """Turn on etcd's authentication: a root user, and ``user`` allowed to read and write the keys
        under ``prefix`` only (through the gateway, as ``etcdctl user/role add``, ``auth enable``)."""
        import requests

        assert self.tls is not None and not self.client_cert_auth  # the gateway ignores CNs with auth
        url = f"https://{self.members[0].endpoint}/v3"

        def post(path: str, body: dict[str, object]) -> None:
            response = requests.post(url + path, json=body, timeout=10, verify=str(self.tls.ca))  # type: ignore[union-attr]
            response.raise_for_status()

        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        encoded = (base64.b64encode(prefix.encode()).decode(), base64.b64encode(end.encode()).decode())
        post("/auth/role/add", {"name": "root"})
        post("/auth/user/add", {"name": "root", "password": os.urandom(16).hex()})
        post("/auth/user/grant", {"user": "root", "role": "root"})
        post("/auth/role/add", {"name": "jobs"})
        post("/auth/role/grant", {"name": "jobs", "perm": {"permType": "READWRITE", "key": encoded[0],
                                                           "range_end": encoded[1]}})  # fmt: skip
        post("/auth/user/add", {"name": user, "password": password})
        post("/auth/user/grant", {"user": user, "role": "jobs"})
        post("/auth/enable", {})

    def kill(self, index: int) -> None:
        """SIGKILL one member (a crashed etcd machine)."""
        popen = self.members[index].popen
        if popen is not None:
            popen.kill()
            popen.wait(10)

    def stop(self) -> None:
        for member in self.members:
            if member.popen is not None and member.popen.poll() is None:
                member.popen.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    member.popen.wait(10)
