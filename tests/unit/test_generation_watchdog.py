"""The generation watchdog aborts exactly the generation it was armed for, and leaves no thread behind."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from resilrun.channel_protocol import NewEnv
from resilrun.errors import CheckpointError
from resilrun.worker import _abort, _torch_compat
from resilrun.worker import membership as job
from resilrun.worker._compute_probe import ComputeProbe


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

    def call(self, request: object) -> tuple[NewEnv, list[int]]:
        while not self.release.wait(0.01):
            if self.interrupted.is_set():
                raise CheckpointError("the agent channel failed during 'await_generation': shut down")
        return NewEnv(env={"RANK": "0"}), []

    def interrupt(self) -> None:
        self.interrupted.set()

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def nccl(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """torch.distributed as worker/membership.py sees it: an NCCL default group that a test can replace."""
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
    model = torch.nn.Linear(2, 1)  # kept across the re-run (as @resilrun.once keeps it)
    probe = ComputeProbe()
    probe.watch([model])
    monkeypatch.setattr(job, "_JOB", SimpleNamespace(_watchdog=watchdog, _snapshotter=None, _probe=probe))
    # When the process leaves the generation to run the script again
    job.reset_for_reentry()
    # Then the watchdog is gone (not one more blocked thread per generation), its channel closed,
    assert not watchdog.is_alive()
    # the compute probe's hooks are off the kept model (the next job's probe adds its own),
    assert probe._handles == [] and not model.weight._post_accumulate_grad_hooks
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


class _Next:
    """``wait_for_next`` of a setup guard: blocks until the generation is superseded, or interrupted."""

    def __init__(self) -> None:
        self.superseded = threading.Event()
        self.interrupted = threading.Event()

    def __call__(self) -> bool:
        while not self.superseded.wait(0.01):
            if self.interrupted.is_set():
                raise CheckpointError("interrupted")
        return True


def _connected_pair() -> tuple[socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    with listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


def test_a_setup_that_returns_before_any_newer_generation_is_left_alone() -> None:
    old_client, old_server = _connected_pair()
    before = _abort.tcp_sockets()
    new_client, new_server = _connected_pair()
    nxt, exits = _Next(), []
    guard = _abort.SetupGuard(nxt, nxt.interrupted.set, before, grace_s=0.2, exit=exits.append)
    guard.start()
    guard.finish()
    assert not guard.is_alive() and not guard.superseded.is_set() and exits == []
    new_client.settimeout(0.2)
    with pytest.raises(TimeoutError):  # still connected: nothing was shut down
        new_client.recv(1)
    for sock in (old_client, old_server, new_client, new_server):
        sock.close()


def test_a_setup_blocked_when_its_generation_is_superseded_fails_at_once() -> None:
    old_client, old_server = _connected_pair()
    before = _abort.tcp_sockets()
    nxt, exits = _Next(), []
    guard = _abort.SetupGuard(nxt, nxt.interrupted.set, before, grace_s=5.0, exit=exits.append)
    guard.start()
    nxt.superseded.set()
    assert guard.superseded.wait(2)
    # a connection the setup opens after the news (the store's, a gloo pair) is shut down as it appears
    store_client, store_server = _connected_pair()
    store_client.settimeout(2)
    assert store_client.recv(1) == b""  # the blocked wait fails: the setup raises, the bootstrap moves on
    guard.finish()
    assert not guard.is_alive() and exits == []
    old_client.settimeout(0.2)
    with pytest.raises(TimeoutError):  # a connection from before the setup is not the setup's
        old_client.recv(1)
    for sock in (old_client, old_server, store_client, store_server):
        sock.close()


def test_a_setup_still_stuck_after_the_grace_ends_the_process() -> None:
    # A connect retrying against a store that is gone opens no lasting socket to shut down.
    nxt, exits = _Next(), []
    guard = _abort.SetupGuard(nxt, nxt.interrupted.set, _abort.tcp_sockets(), grace_s=0.3, exit=exits.append)
    guard.start()
    nxt.superseded.set()
    guard.join(3)
    assert exits == [_abort.SUPERSEDED_SETUP_EXIT_CODE]
