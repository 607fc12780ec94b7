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
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
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
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as response:
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
            self.members.append(Member(name, ports[2 * index], ports[2 * index + 1], *paths, placement=placement))
        initial = ",".join(f"{m.name}=http://{m.addr}:{m.peer_port}" for m in self.members)
        for member in self.members:
            addr = member.addr
            argv = [
                binary,
                "--name", member.name,
                "--data-dir", str(member.data_dir),
                "--listen-client-urls", f"http://{addr}:{member.client_port}",
                "--advertise-client-urls", f"http://{addr}:{member.client_port}",
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
