"""The address other nodes reach this node at, and the interface its workers' collectives use.

torchrun advertises the host's FQDN and leaves gloo/NCCL to pick an interface from the host name.
On Debian and Ubuntu the host name maps to 127.0.1.1 in /etc/hosts, so a multi-host job forms its
round and then every first collective fails ("connection refused, remote=127.0.1.1"), or no node
hosts the store. Here, when the user gave no ``--local-addr`` and the host name resolves only to a
loopback address while the job spans nodes, the node advertises the address its kernel uses to
reach the rendezvous endpoint (or its only non-loopback address), and its workers get
``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` for that interface unless the user set them. When
that cannot be decided, the agent stops at once with a one-line error and a hint, not after a gloo
timeout.

A job whose endpoint is a loopback address runs all its nodes on this machine: loopback is right
there, and nothing changes.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from resilrun.errors import ConfigError

# The variables gloo and NCCL read to choose their interface (set for the workers only when unset).
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True, slots=True)
class Advertised:
    """What this node tells the others and its workers."""

    addr: str  # MASTER_ADDR when it hosts the worker store, its replica server, its status
    ifname: str | None = None  # the interface for the workers' collectives (None: leave gloo/NCCL to choose)
    chosen: str | None = None  # why, logged when resilrun chose (None: the user's or torchrun's choice)


class HostNetwork(Protocol):
    """What is read of this machine's network (a fake in the unit tests)."""

    def fqdn(self) -> str: ...

    def resolve(self, host: str) -> list[str]: ...

    def route_source(self, ip: str) -> str | None: ...

    def interfaces(self) -> dict[str, list[str]]: ...


class SystemNetwork:
    def fqdn(self) -> str:
        return socket.getfqdn()

    def resolve(self, host: str) -> list[str]:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return []
        return list(dict.fromkeys(str(info[4][0]) for info in infos))

    def route_source(self, ip: str) -> str | None:
        """The source address the kernel picks to reach ``ip`` (a UDP connect sends nothing)."""
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((ip, 9))
            return str(probe.getsockname()[0])
        return None

    def interfaces(self) -> dict[str, list[str]]:
        import psutil

        up = {name for name, stats in psutil.net_if_stats().items() if stats.isup}
        families = (socket.AF_INET, socket.AF_INET6)
        return {
            name: [a.address.split("%")[0] for a in addrs if a.family in families]
            for name, addrs in psutil.net_if_addrs().items()
            if name in up
        }


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def _interface_of(ip: str, interfaces: Mapping[str, list[str]]) -> str | None:
    return next((name for name, addrs in interfaces.items() if ip in addrs), None)


def choose_address(
    local_addr: str | None,
    endpoint_hosts: Sequence[str],
    multi_node: bool,
    environ: Mapping[str, str],
    net: HostNetwork | None = None,
) -> Advertised:
    """See the module docstring; ``environ``: the agent's (the user's *_SOCKET_IFNAME win).

    Raises:
        ConfigError: a multi-node job where the host name resolves only to loopback and no single
            address can be told to be the one other nodes reach.
    """
    net = net or SystemNetwork()
    user_ifname = any(environ.get(var) for var in SOCKET_IFNAME_VARS)
    fqdn = net.fqdn()
    host_ips = net.resolve(fqdn)
    name_is_loopback = not host_ips or all(is_loopback(ip) for ip in host_ips)
    if local_addr:
        # The user named the address; when the host name would send gloo to loopback, its
        # interface is where the collectives go too (what users otherwise set by hand).
        if not (multi_node and name_is_loopback and not user_ifname):
            return Advertised(local_addr)
        ifname = _interface_of(local_addr, net.interfaces())
        if ifname is None or is_loopback(local_addr):
            return Advertised(local_addr)
        return Advertised(local_addr, ifname, f"--local-addr {local_addr} is on {ifname}")
    if not multi_node or not name_is_loopback:
        return Advertised(fqdn)
    endpoint_ips = [ip for host in endpoint_hosts for ip in net.resolve(host)]
    if endpoint_ips and all(is_loopback(ip) for ip in endpoint_ips) and not _names_this_host(endpoint_hosts, fqdn):
        # 127.0.0.1 or localhost: every node of the job runs on this machine, where loopback is right.
        return Advertised(fqdn)
    interfaces = net.interfaces()
    for ip in endpoint_ips:
        if is_loopback(ip):
            continue
        source = net.route_source(ip)
        if source is not None and not is_loopback(source):
            ifname = _interface_of(source, interfaces)
            why = f"the route to the rendezvous endpoint {ip} leaves from {source}" + (f" ({ifname})" if ifname else "")
            return Advertised(source, None if user_ifname else ifname, why)
    candidates = {ip: name for name, addrs in interfaces.items() for ip in addrs if not is_loopback(ip) and _usable(ip)}
    if len(candidates) == 1:
        ip, name = next(iter(candidates.items()))
        return Advertised(ip, None if user_ifname else name, f"{ip} ({name}) is this machine's only network address")
    shown = ", ".join(f"{ip} ({name})" for ip, name in candidates.items()) or "none"
    raise ConfigError(
        f"cannot tell which address the other nodes reach this one at: host name '{fqdn}' resolves to "
        f"{', '.join(host_ips) or 'nothing'} (loopback) and this machine's addresses are: {shown}",
        hint="give --local-addr ADDRESS (this node's address on the cluster network), or map the host name "
        "to it in /etc/hosts",
    )


def _names_this_host(hosts: Sequence[str], fqdn: str) -> bool:
    """Whether an endpoint is this machine's own name: it resolves to loopback here (/etc/hosts) but
    to this node's real address on the other nodes, so loopback says nothing about where they are."""
    own = {fqdn.lower(), fqdn.split(".")[0].lower()} - {"localhost"}
    return any(host.lower() in own or host.split(".")[0].lower() in own for host in hosts)


def _usable(ip: str) -> bool:
    """Not link-local (fe80::/10, 169.254/16): such an address needs a scope and is not a cluster address."""
    try:
        return not ipaddress.ip_address(ip).is_link_local
    except ValueError:
        return False


def worker_network_env(advertised: Advertised, environ: Mapping[str, str]) -> dict[str, str]:
    """The *_SOCKET_IFNAME variables to give the workers (none the user already set)."""
    if advertised.ifname is None:
        return {}
    return {var: advertised.ifname for var in SOCKET_IFNAME_VARS if not environ.get(var)}
