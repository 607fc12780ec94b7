"""Which address a node advertises and which interface its workers' collectives use, on fake hosts.

The case that matters: Debian/Ubuntu map the host name to 127.0.1.1, so torchrun's FQDN sends
every other node (and gloo) to loopback. The addresses are from 198.18.0.0/15 (benchmarking).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from resilrun.agent.addressing import Advertised, choose_address, worker_network_env
from resilrun.errors import ConfigError


@dataclass
class FakeNetwork:
    name: str = "h1"
    hosts: dict[str, list[str]] = field(default_factory=lambda: {"h1": ["127.0.1.1"], "h0": ["198.18.0.1"]})
    routes: dict[str, str] = field(default_factory=lambda: {"198.18.0.1": "198.18.0.2"})
    nics: dict[str, list[str]] = field(
        default_factory=lambda: {"lo": ["127.0.0.1", "::1"], "eth0": ["198.18.0.2", "fe80::1"]}
    )

    def fqdn(self) -> str:
        return self.name

    def resolve(self, host: str) -> list[str]:
        if host.replace(".", "").isdigit() or ":" in host:
            return [host]
        return self.hosts.get(host, [])

    def route_source(self, ip: str) -> str | None:
        return self.routes.get(ip)

    def interfaces(self) -> dict[str, list[str]]:
        return self.nics


def choose(net: FakeNetwork, endpoint: str = "h0", *, local_addr: str | None = None, **env: str) -> Advertised:
    return choose_address(local_addr, [endpoint], True, env, net)


def test_a_host_name_on_loopback_advertises_the_address_that_routes_to_the_endpoint() -> None:
    chosen = choose(FakeNetwork())
    assert (chosen.addr, chosen.ifname) == ("198.18.0.2", "eth0")
    assert chosen.chosen is not None and "198.18.0.1" in chosen.chosen
    assert worker_network_env(chosen, {}) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}


def test_the_store_host_named_by_its_own_host_name_uses_its_only_network_address() -> None:
    # On h0 itself, "h0" resolves to 127.0.1.1 too; the other nodes resolve it to its real address.
    net = FakeNetwork(
        name="h0", hosts={"h0": ["127.0.1.1"]}, routes={}, nics={"lo": ["127.0.0.1"], "e": ["198.18.0.1"]}
    )
    assert choose(net) == Advertised("198.18.0.1", "e", "198.18.0.1 (e) is this machine's only network address")


def test_a_host_name_that_resolves_to_a_real_address_is_kept_as_torchrun_does() -> None:
    net = FakeNetwork(hosts={"h1": ["198.18.0.2"], "h0": ["198.18.0.1"]})
    assert choose(net) == Advertised("h1")


@pytest.mark.parametrize("endpoint", ["127.0.0.1", "localhost"])
def test_a_loopback_endpoint_means_every_node_is_on_this_machine_and_nothing_changes(endpoint: str) -> None:
    net = FakeNetwork(hosts={"h1": ["127.0.1.1"], "localhost": ["127.0.0.1"]})
    assert choose(net, endpoint) == Advertised("h1")


def test_a_one_node_job_keeps_the_host_name() -> None:
    assert choose_address(None, ["h0"], False, {}, FakeNetwork()) == Advertised("h1")


def test_the_users_socket_ifname_wins() -> None:
    chosen = choose(FakeNetwork(), GLOO_SOCKET_IFNAME="ib0")
    assert (chosen.addr, chosen.ifname) == ("198.18.0.2", None)
    assert worker_network_env(chosen, {"GLOO_SOCKET_IFNAME": "ib0"}) == {}


def test_local_addr_is_kept_and_its_interface_given_to_the_workers_when_the_name_means_loopback() -> None:
    chosen = choose(FakeNetwork(), local_addr="198.18.0.2")
    assert (chosen.addr, chosen.ifname) == ("198.18.0.2", "eth0")
    net = FakeNetwork(hosts={"h1": ["198.18.0.2"], "h0": ["198.18.0.1"]})
    assert choose(net, local_addr="198.18.0.2") == Advertised("198.18.0.2")  # gloo finds it by name already


def test_two_candidate_addresses_and_no_route_to_tell_them_apart_is_a_usage_error() -> None:
    net = FakeNetwork(routes={}, nics={"lo": ["127.0.0.1"], "eth0": ["198.18.0.2"], "eth1": ["198.19.0.2"]})
    with pytest.raises(ConfigError, match=r"cannot tell which address .*198\.18\.0\.2 \(eth0\), 198\.19\.0\.2") as info:
        choose(net)
    assert "--local-addr" in (info.value.hint or "")
