"""Real etcd servers on loopback for tests and benchmarks: one member, or a three-member cluster.

Every member listens on free 127.0.0.1 ports with its own data directory; ``stop()`` kills the
processes by their recorded pids. Debian's ``etcd-server`` package provides the ``etcd`` binary
(``make test-tools`` installs it as root on Debian).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path


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


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as response:
                return b'"true"' in response.read()
        except (urllib.error.URLError, OSError):
            return False


@dataclass
class EtcdCluster:
    """One to three etcd members on loopback; ``endpoint`` is the ``--rdzv-endpoint`` value."""

    root: Path
    size: int = 1
    members: list[Member] = field(default_factory=list)

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.root.mkdir(parents=True, exist_ok=True)
        ports = _free_ports(2 * self.size)
        token = f"resilrun-test-{uuid.uuid4().hex[:8]}"
        for index in range(self.size):
            name = f"m{index}"
            self.members.append(
                Member(name, ports[2 * index], ports[2 * index + 1], self.root / name, self.root / f"{name}.log")
            )
        initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        for member in self.members:
            argv = [
                binary,
                "--name", member.name,
                "--data-dir", str(member.data_dir),
                "--listen-client-urls", f"http://127.0.0.1:{member.client_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{member.client_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{member.peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{member.peer_port}",
                "--initial-cluster", initial,
                "--initial-cluster-state", "new",
                "--initial-cluster-token", token,
                # etcd's defaults (100 ms heartbeats, 1 s election timeout): what users run.
                "--heartbeat-interval", "100",
                "--election-timeout", "1000",
                "--logger", "zap",
                "--log-level", "warn",
            ]  # fmt: skip
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
            time.sleep(0.1)
        return self

    @property
    def endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.members)

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
