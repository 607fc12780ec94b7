"""resilrun's pure-Python TCPStore client and server speak torch's own protocol: each is checked
against torch's implementation of the other side, and torch's process groups form on our server."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from resilrun.rendezvous.c10d_wire import WireClient, WireServer, listen

TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def torch_server() -> Iterator:
    from torch.distributed import TCPStore

    yield TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


@pytest.fixture
def our_server() -> Iterator[WireServer]:
    server = WireServer(listen("127.0.0.1", 0))
    yield server
    server.close()


def test_our_client_reads_and_writes_what_torchs_server_holds(torch_server) -> None:  # noqa: ANN001
    ours = WireClient("127.0.0.1", torch_server.port, 10)
    ours.set("a", b"hello")
    torch_server.set("b", b"x")
    assert (torch_server.get("a"), ours.get("b")) == (b"hello", b"x")
    assert (ours.add("n", 3), torch_server.add("n", 2), ours.add("n", 0)) == (3, 5, 5)
    assert ours.multi_get(["a", "b"]) == [b"hello", b"x"]
    assert ours.num_keys() == torch_server.num_keys()
    assert ours.delete_key("a") and not ours.delete_key("a")
    assert ours.check(["b"]) and not ours.check(["b", "a"])


def test_compare_set_follows_torchs_rules_for_absent_and_present_keys(torch_server) -> None:  # noqa: ANN001
    ours = WireClient("127.0.0.1", torch_server.port, 10)
    assert ours.compare_set("absent", b"e", b"d") == b"e"  # absent, expected given: nothing written
    assert not ours.check(["absent"])
    assert ours.compare_set("k", b"", b"v1") == b"v1"  # absent, expected empty: written
    assert ours.compare_set("k", b"zz", b"v2") == b"v1"  # present, not equal: the current value
    assert ours.compare_set("k", b"v1", b"v2") == b"v2"
    assert torch_server.get("k") == b"v2"


def test_our_client_waits_for_a_key_and_gives_up_at_its_timeout(torch_server) -> None:  # noqa: ANN001
    ours = WireClient("127.0.0.1", torch_server.port, 10)
    threading.Timer(0.2, lambda: torch_server.set("later", b"1")).start()
    ours.wait(["later"])
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        ours.wait(["never"], 0.3)
    assert 0.3 <= time.monotonic() - started < 3
    ours.set("after", b"1")  # the connection is still in step after the cancelled wait
    assert ours.get("after") == b"1"


def test_torchs_client_uses_our_server_as_it_uses_its_own(our_server: WireServer) -> None:
    from torch.distributed import TCPStore

    theirs = TCPStore("127.0.0.1", our_server.port, is_master=False, timeout=TIMEOUT, wait_for_workers=False)
    ours = WireClient("127.0.0.1", our_server.port, 10)
    theirs.set("a", b"hello")
    assert (theirs.get("a"), ours.get("a")) == (b"hello", b"hello")
    assert (theirs.add("n", 3), theirs.add("n", 4)) == (3, 7)
    assert theirs.compare_set("cs", "", "v1") == b"v1" and theirs.compare_set("cs", "zz", "v2") == b"v1"
    threading.Timer(0.2, lambda: ours.set("later", b"1")).start()
    theirs.wait(["later"])
    with pytest.raises(Exception, match="[Tt]imeout|timed out"):
        theirs.wait(["never"], timedelta(seconds=0.3))
    theirs.multi_set(["m1", "m2"], ["1", "2"])
    theirs.append("ap", b"x")
    theirs.append("ap", b"y")
    assert theirs.multi_get(["m1", "m2", "ap"]) == [b"1", b"2", b"xy"]
    assert theirs.delete_key("a") and theirs.num_keys() == ours.num_keys()
    # the worker count a master-less client adds and waits for
    TCPStore("127.0.0.1", our_server.port, world_size=1, is_master=False, timeout=TIMEOUT, wait_for_workers=True)


_WORKER = r"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
dist.all_reduce(t, group=dist.new_group([0, 1]))
dist.barrier()
x = torch.ones(1)
dist.all_reduce(x, group=init_device_mesh("cpu", (2,)).get_group())
print(int(t.item()), int(x.item()))
dist.destroy_process_group()
"""


def test_torchs_process_groups_form_on_our_server(our_server: WireServer) -> None:
    env = {
        **os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(our_server.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
    }  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    assert [out.split() for out, _ in outputs] == [["6", "2"], ["6", "2"]]


def test_a_client_that_never_reads_its_answers_does_not_stop_the_store_for_the_others(our_server: WireServer) -> None:
    import select
    import socket
    import struct

    from resilrun.rendezvous.c10d_wire import MAGIC, Query, pack_bytes

    writer = WireClient("127.0.0.1", our_server.port, 10)
    writer.set("big", b"x" * (4 << 20))
    # Given a client that asks for a 4 MiB value again and again and never reads an answer
    greedy = socket.create_connection(("127.0.0.1", our_server.port))
    greedy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    greedy.sendall(struct.pack("<BI", Query.VALIDATE, MAGIC))
    request = struct.pack("<B", Query.GET) + pack_bytes(b"/big")
    greedy.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        for _ in range(200):
            greedy.send(request)
    readable, _, _ = select.select([greedy], [], [], 10)  # the server is answering it
    assert readable
    # When another client uses the store meanwhile, then it is served at once
    started = time.monotonic()
    other = WireClient("127.0.0.1", our_server.port, 10, connect_timeout_s=5)
    other.set("k", b"v")
    assert other.get("k") == b"v"
    assert time.monotonic() - started < 2
    greedy.close()


def test_a_peer_that_accepts_and_never_answers_fails_the_connection_within_its_timeout() -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody answers
        started = time.monotonic()
        with pytest.raises(OSError):
            WireClient("127.0.0.1", silent.getsockname()[1], 10, connect_timeout_s=0.5)
        assert time.monotonic() - started < 3


def test_a_hosted_store_on_a_host_name_is_reached_on_ipv4_loopback() -> None:
    from resilrun.rendezvous.c10d import host_store

    store = host_store("localhost", 0, timedelta(seconds=10))
    try:
        store.set("k", b"v")
        assert WireClient("127.0.0.1", store.port, 10).get("k") == b"v"
    finally:
        store.close()
