"""A cluster of "hosts" on one machine: each a network namespace with its own hostname and /etc/hosts.

Shared by the tests (``tests/integration/test_multi_host.py``) and the benchmarks. Needs root
(CAP_NET_ADMIN, CAP_SYS_ADMIN), iproute2's ``ip`` and util-linux's ``unshare``.

Layout: a switch namespace holds one bridge; every host namespace has an ``eth0`` (one end of a
veth pair, the other end on the bridge) with an address in 198.18.0.0/24 (RFC 2544's benchmarking
range: only ever inside these namespaces, never routed anywhere), loopback up, and an /etc/hosts
the way Debian and Ubuntu write it: its own name on 127.0.1.1, the other hosts by their addresses
(the cluster's DNS). Nothing is added to the machine's own namespace. A process runs on a host
through ``command()``: ``ip netns exec`` (which bind-mounts /etc/netns/NS/hosts over /etc/hosts)
and a new UTS namespace carrying the host's name. ``enter_host()`` does the same to the calling
process itself (a process forked for it: the tests' launch server moves its launches onto their
hosts this way instead of starting a new interpreter).

Faults: ``cut(host)`` takes the host off the network (its link down: every peer sees silence, as
on a lost node or a pulled cable); ``heal(host)`` puts it back. With nftables (``nft``; see
``nft_available``), finer ones, each a rule in the sending or receiving host's own namespace:
``block(src, dst, port=)`` drops what ``src`` sends to ``dst`` (one way; a TCP port of ``dst``'s
alone: one service, as a cut data plane); ``lose(percent)`` drops that share of the packets every
host receives (random loss on every link); ``clear()`` removes them all.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SUBNET = "198.18.0"
_ids = itertools.count()


def available() -> str | None:
    """None when a cluster can be built here, else why not (the tests skip, or fail in CI)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = f"rrprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"cannot create a network namespace: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    return None


def nft_available() -> str | None:
    """None when nftables rules can be set in a host's namespace, else why not."""
    if shutil.which("nft") is None:
        return "nftables' nft is not installed"
    return None


def _kill_in(ns: str) -> None:
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in done.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _run(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def _await_carrier(ns: str, timeout_s: float = 10.0) -> None:
    """Wait until ``eth0`` in ``ns`` is operationally up. ``ip link set up`` returns before the kernel
    reports the link running (its link-state events are batched, up to a second apart): an agent
    started in that window finds no usable interface and stops ("this machine's addresses are:
    none"), where a real machine's network is up before anything is launched on it."""
    deadline = time.monotonic() + timeout_s
    while True:
        command = ["ip", "-n", ns, "-o", "link", "show", "eth0"]
        shown = subprocess.run(command, capture_output=True, text=True, timeout=5)
        if "state UP" in shown.stdout:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"eth0 in {ns} not up after {timeout_s:g} s: {shown.stdout.strip()}")
        time.sleep(0.02)


_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
_MS_RDONLY, _MS_BIND, _MS_REC, _MS_SLAVE, _MNT_DETACH = 1, 0x1000, 0x4000, 1 << 19, 2


def enter_host(ns: str, name: str) -> None:
    """Put the calling process on a host, as ``command()``'s ``ip netns exec`` and ``unshare --uts``
    put a new one: the host's network namespace, a mount namespace of its own (a slave of the
    machine's) with a sysfs of that network and /etc/netns/NS's files bound over /etc's, and a UTS
    namespace carrying the host's name. Only for a single-threaded process (``setns`` and
    ``unshare`` of a mount namespace refuse otherwise); raises OSError when a step fails."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), f"setns {ns}")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWUTS), "unshare")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    # As iproute2 does: a /sys that cannot be unmounted gets the new sysfs mounted over it (read-only
    # if the old one was), and a file of /etc/netns that cannot be bound is only warned about.
    flags = 0
    if libc.umount2(b"/sys", _MNT_DETACH) != 0 and os.statvfs("/sys").f_flag & os.ST_RDONLY:
        flags = _MS_RDONLY  # a read-only sysfs cannot be shadowed by a read-write one
    check(libc.mount(ns.encode(), b"/sys", b"sysfs", flags, None), "mount sysfs")
    etc = Path("/etc/netns") / ns
    for entry in sorted(etc.iterdir()) if etc.is_dir() else []:
        if libc.mount(str(entry).encode(), f"/etc/{entry.name}".encode(), None, _MS_BIND, None) != 0:
            os.write(2, f"Bind {entry} -> /etc/{entry.name} failed: {os.strerror(ctypes.get_errno())}\n".encode())
    encoded = name.encode()
    check(libc.sethostname(encoded, len(encoded)), "sethostname")


@dataclass(frozen=True)
class Host:
    name: str  # its hostname
    ns: str  # its network namespace
    addr: str  # its eth0 address


def host_command(host: Host, argv: Sequence[str]) -> list[str]:
    """``argv`` as run on ``host``: its network, its /etc/hosts, its hostname."""
    script = 'hostname "$0" && exec "$@"'
    return ["ip", "netns", "exec", host.ns, "unshare", "--uts", "--", "sh", "-c", script, host.name, *argv]


class Cluster:
    """``Cluster(3)`` builds hosts h0, h1, h2; use as a context manager (it removes everything)."""

    def __init__(self, count: int, prefix: str = "h") -> None:
        tag = f"rr{os.getpid() % 100000}x{next(_ids)}"
        self.tag = tag
        self.switch = f"{tag}sw"
        self.hosts = [Host(f"{prefix}{i}", f"{tag}{prefix}{i}", f"{SUBNET}.{i + 1}") for i in range(count)]
        self._made: list[str] = []
        self._filtered: list[Host] = []  # hosts whose namespace has the fault table

    def __enter__(self) -> Cluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _run("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for index, host in enumerate(self.hosts):
            _run("ip", "netns", "add", host.ns)
            self._made.append(host.ns)
            outside = f"p{index}"
            # Created inside the host's namespace, so no interface ever appears in the machine's own.
            _run("ip", "-n", host.ns, "link", "add", "eth0", "type", "veth", "peer", "name", outside)
            _run("ip", "-n", host.ns, "link", "set", outside, "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", outside, "master", "br0", "up")
            _run("ip", "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _run("ip", "-n", host.ns, "link", "set", "eth0", "up")
            _run("ip", "-n", host.ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / host.ns
            etc.mkdir(parents=True, exist_ok=True)
            others = "".join(f"{h.addr}\t{h.name}\n" for h in self.hosts if h != host)
            (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{host.name}\n{others}")
        for host in self.hosts:
            _await_carrier(host.ns)

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def command(self, host: Host | str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on ``host``: its network, its /etc/hosts, its hostname."""
        return host_command(self.host(host) if isinstance(host, str) else host, argv)

    def daemon_command(self, host: Host | str, argv: Sequence[str]) -> list[str]:
        """As ``command``, but keeping the machine's /sys (``ip netns exec`` mounts a fresh one, which
        lacks the cgroup mounts a daemon such as slurmd insists on): the host's network, its own
        mount namespace with the host's /etc/hosts bound over /etc/hosts, and its hostname."""
        h = self.host(host) if isinstance(host, str) else host
        script = 'mount --bind "/etc/netns/$1/hosts" /etc/hosts && hostname "$0" && shift && exec "$@"'
        unshare = ["unshare", "--mount", "--uts", "--propagation", "private", "--"]
        return ["nsenter", f"--net=/run/netns/{h.ns}", *unshare, "sh", "-c", script, h.name, h.ns, *argv]

    def kill_host(self, host: Host | str) -> None:
        """SIGKILL every process in ``host``'s network namespace: the machine died."""
        h = self.host(host) if isinstance(host, str) else host
        _kill_in(h.ns)

    def kill_all(self) -> None:
        """SIGKILL every process still in one of the hosts' network namespaces (daemons, strays)."""
        for ns in self._made:
            _kill_in(ns)

    # -- faults ----------------------------------------------------------------------------------
    def cut(self, host: Host | str) -> None:
        h = self.host(host) if isinstance(host, str) else host
        _run("ip", "-n", h.ns, "link", "set", "eth0", "down")

    def heal(self, host: Host | str) -> None:
        h = self.host(host) if isinstance(host, str) else host
        _run("ip", "-n", h.ns, "link", "set", "eth0", "up")
        _await_carrier(h.ns)

    def block(self, src: Host | str, dst: Host | str, *, port: int | None = None) -> None:
        """Drop every packet ``src`` sends to ``dst`` (to that TCP port of ``dst`` only, if given)."""
        source, target = (self.host(h) if isinstance(h, str) else h for h in (src, dst))
        match = ["ip", "daddr", target.addr] + (["tcp", "dport", str(port)] if port is not None else [])
        self._nft(source, "output", *match, "drop")

    def lose(self, percent: float, hosts: Sequence[Host | str] | None = None) -> None:
        """Every host (or those named) drops ``percent`` % of the packets it receives, at random."""
        per_mille = round(percent * 10)
        if not 0 < per_mille < 1000:
            raise ValueError(f"a loss of {percent} % cannot be set (0.1-99.9)")
        for host in hosts if hosts is not None else self.hosts:
            h = self.host(host) if isinstance(host, str) else host
            self._nft(h, "input", "iifname", "eth0", "numgen", "random", "mod", "1000", "<", str(per_mille), "drop")

    def clear(self) -> None:
        """Remove every rule ``block`` and ``lose`` set."""
        for host in self._filtered:
            _run("ip", "netns", "exec", host.ns, "nft", "flush", "table", "inet", "resilrun_faults")

    def _nft(self, host: Host, chain: str, *rule: str) -> None:
        if host not in self._filtered:
            table = (
                "table inet resilrun_faults {\n"
                " chain input { type filter hook input priority 0; policy accept; }\n"
                " chain output { type filter hook output priority 0; policy accept; }\n}\n"
            )
            done = subprocess.run(
                ["ip", "netns", "exec", host.ns, "nft", "-f", "-"], input=table, capture_output=True, text=True
            )
            if done.returncode != 0:
                raise RuntimeError(f"nft on {host.name}: {done.stderr.strip()}")
            self._filtered.append(host)
        _run("ip", "netns", "exec", host.ns, "nft", "add", "rule", "inet", "resilrun_faults", chain, *rule)

    def close(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self._made = []
