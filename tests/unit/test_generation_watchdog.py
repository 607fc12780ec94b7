"""The generation watchdog aborts exactly the generation it was armed for, and leaves no thread behind."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from resilrun.errors import CheckpointError
from resilrun.worker import _abort, _torch_compat, job


class _Group:
    def __init__(self, name: str) -> None:
        self.name = name
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class _Agent:
    """Stands in for the agent channel: ``await_generation`` blocks until told, or interrupted."""

    instances: list[_Agent] = []

    def __init__(self, path: str, token: str | None = None) -> None:
        self.release = threading.Event()
        self.interrupted = threading.Event()
        self.closed = False
        _Agent.instances.append(self)

    def request(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        while not self.release.wait(0.01):
            if self.interrupted.is_set():
                raise CheckpointError("the agent channel failed during 'await_generation': shut down")
        return {"ok": True, "env": {"RANK": "0"}}, []

    def interrupt(self) -> None:
        self.interrupted.set()

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def nccl(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """torch.distributed as job.py sees it: an NCCL default group that a test can replace."""
    fake = SimpleNamespace(
        is_initialized=lambda: True,
        get_backend=lambda group=None: "nccl",
        group=SimpleNamespace(WORLD=_Group("generation 0")),
        destroy_process_group=lambda: None,
    )
    monkeypatch.setattr(job, "dist", fake)
    monkeypatch.setattr(job, "AgentClient", _Agent)
    _Agent.instances.clear()
    return fake


def test_the_abort_hits_the_group_it_was_armed_for_not_the_next_generations(nccl: SimpleNamespace) -> None:
    # Given a watchdog armed in generation 0
    armed_for = nccl.group.WORLD
    watchdog = job._start_watchdog("agent.sock", 0, {}, {})
    # When the process already built generation 1's group by the time the news arrives
    newer = _Group("generation 1")
    nccl.group.WORLD = newer
    _Agent.instances[-1].release.set()
    watchdog.join(5)
    # Then generation 0's group was aborted, and the new one left alone
    assert armed_for.aborted
    assert not newer.aborted


def test_leaving_a_generation_ends_its_watchdog_thread(nccl: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a job whose watchdog waits (through the agent) for the next generation
    watchdog = job._start_watchdog("agent.sock", 0, {}, {})
    monkeypatch.setattr(job, "_JOB", SimpleNamespace(_watchdog=watchdog, _snapshotter=None))
    # When the process leaves the generation to run the script again
    job.reset_for_reentry()
    # Then the watchdog is gone (not one more blocked thread per generation), its channel closed,
    assert not watchdog.is_alive()
    assert _Agent.instances[-1].closed
    # and news of a generation arriving late aborts nothing
    _Agent.instances[-1].release.set()
    assert not nccl.group.WORLD.aborted


def test_with_nccl_the_subgroups_of_the_current_generation_are_aborted_too(
    nccl: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a generation whose script built two subgroups (a 2-D DeviceMesh) on its default group
    world, replicas, shards = nccl.group.WORLD, _Group("replicate"), _Group("shard")
    monkeypatch.setattr(_torch_compat, "process_groups", lambda newest_first=False: [shards, replicas, world])
    watchdog = job._start_watchdog("agent.sock", 0, {}, {})
    # When the next generation is announced
    _Agent.instances[-1].release.set()
    watchdog.join(5)
    # Then every one of its groups is aborted: a rank blocked in a subgroup's collective is released
    assert world.aborted and replicas.aborted and shards.aborted


@pytest.fixture
def listeners() -> Iterator[dict[str, socket.socket]]:
    """Two loopback listeners on different addresses: a job host and some other host."""
    made = {}
    for host in ("127.0.0.1", "127.0.0.2"):
        made[host] = socket.create_server((host, 0))
    yield made
    for server in made.values():
        server.close()


def test_with_gloo_connections_opened_later_to_the_groups_hosts_are_cut_too(
    listeners: dict[str, socket.socket],
) -> None:
    # Given the default group's connection to a job host, made as the generation began
    def connect(host: str) -> socket.socket:
        return socket.create_connection(listeners[host].getsockname()[:2])

    before = _abort.tcp_sockets()
    group = connect("127.0.0.1")
    group_sockets = {fd: inode for fd, inode in _abort.tcp_sockets().items() if before.get(fd) != inode}
    # and, later, a subgroup's connection to a job host and the script's own to another host
    subgroup, elsewhere = connect("127.0.0.1"), connect("127.0.0.2")
    try:
        hosts = _abort.peer_hosts(group_sockets)
        assert hosts == {"127.0.0.1"}
        # When the generation's connections are looked for, Then the subgroup's is among them, the other not
        found = _abort.opened_since(before, hosts)
        assert subgroup.fileno() in found and group.fileno() in found
        assert elsewhere.fileno() not in found
        # and shutting them down ends a blocked read at once
        _abort.shut_down(found)
        assert subgroup.recv(1) == b""
        elsewhere.settimeout(0.05)
        with pytest.raises(TimeoutError):
            elsewhere.recv(1)
    finally:
        for sock in (group, subgroup, elsewhere):
            sock.close()
