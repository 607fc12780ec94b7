"""The worker<->agent channel refuses strangers: no token, a wrong token, another uid.

The channel hands out node-memory file descriptors and accepts commits, so a process that is not
one of the agent's workers must get nothing. (resilrun.agent.state.channel explains the three layers.)
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from resilrun import channel_protocol as proto
from resilrun import wire
from resilrun.agent.state.channel import AUTH_TIMEOUT_S, TOKEN_ENV, AgentChannel, channel_env
from resilrun.agent.state.tiers import NodeTiers
from resilrun.agent.workers.control import WorkerControl
from resilrun.errors import CheckpointError
from resilrun.snapshot.layout import parse_header
from resilrun.snapshot.selection import Selection
from resilrun.snapshot.shm import SharedBuffer
from resilrun.storage import LocalStorage
from resilrun.tiers import durable
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.worker.agent_client import AgentClient
from tests.conftest import make_snapshot, wait_until


@pytest.fixture
def channel() -> Iterator[AgentChannel]:
    memory = NodeMemoryTier("channel-test")
    agent = AgentChannel(memory, NodeTiers(memory, None), WorkerControl())
    try:
        yield agent
    finally:
        agent.close()
        memory.close()


def _raw(channel: AgentChannel, first: dict | None) -> tuple[dict, list[int]] | None:  # type: ignore[type-arg]
    """Connect without the client library, send ``first`` (if any) then an attach request."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(channel.path)
        if first is not None:
            wire.send(sock, first)
            reply, _ = wire.receive(sock)
            if not reply.get("ok"):
                return reply, []
        wire.send(sock, proto.Attach(rank=0).to_message())
        try:
            return wire.receive(sock)
        except (wire.ChannelError, OSError):
            return None


def test_a_client_with_the_agents_token_is_served(channel: AgentChannel) -> None:
    client = AgentClient(channel.path, token=channel.token)
    try:
        response, fds = client.call(proto.Attach(rank=0))
        assert isinstance(response, proto.Attached) and len(fds) == 1  # the rank's control page
        for fd in fds:
            os.close(fd)
    finally:
        client.close()


def test_a_connection_without_a_token_gets_no_file_descriptors(channel: AgentChannel) -> None:
    # Given a process that found the socket but does not authenticate: its first request is refused
    reply = _raw(channel, None)
    assert reply is not None
    response, fds = reply
    assert response == {"ok": False, "error": "refused: no agent token"}
    assert fds == []


def test_a_wrong_token_is_refused_and_the_connection_closed(channel: AgentChannel) -> None:
    reply = _raw(channel, proto.Auth(token="0" * 64).to_message())
    assert reply == ({"ok": False, "error": "refused: a wrong agent token"}, [])
    with pytest.raises(CheckpointError, match="wrong agent token"):
        AgentClient(channel.path, token="f" * 64)


def test_the_client_library_without_the_environment_token_is_refused(
    channel: AgentChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(CheckpointError, match="no agent token|wrong agent token"):
        AgentClient(channel.path)
    monkeypatch.setenv(TOKEN_ENV, channel.token)
    AgentClient(channel.path).close()


def test_a_silent_connection_does_not_block_other_workers(channel: AgentChannel) -> None:
    # A peer that connects and says nothing holds one thread (until the auth timeout), not the agent
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
        idle.connect(channel.path)
        client = AgentClient(channel.path, token=channel.token)
        started = time.monotonic()
        client.call(proto.Beat(pid=1, step=3))
        client.close()
    assert time.monotonic() - started < AUTH_TIMEOUT_S / 2  # answered, not after the idle one timed out
    assert channel.control.newest_step([1]) == 3  # and the beat reached the agent


def test_the_socket_directory_is_private(channel: AgentChannel) -> None:
    mode = stat.S_IMODE(Path(channel.path).parent.stat().st_mode)
    assert mode == 0o700
    assert channel_env(channel) == {"RESILRUN_AGENT_SOCKET": channel.path, TOKEN_ENV: channel.token}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_another_uid_is_refused_even_with_the_token_and_an_open_directory(channel: AgentChannel) -> None:
    # Given the directory opened to everyone (a misconfiguration the uid check still covers)
    Path(channel.path).parent.chmod(0o777)
    Path(channel.path).chmod(0o777)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, then try with the right token
        code = 1
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            try:
                AgentClient(channel.path, token=channel.token)
                os.write(write, b"served")
            except CheckpointError as exc:
                os.write(write, exc.message.encode()[:200])
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    answer = os.read(read, 300).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert "refused: uid 65534 is not the agent's" in answer


def test_a_heartbeat_carries_the_newest_finished_step_as_progress(channel: AgentChannel) -> None:
    # With --snapshot-every N most steps send no commit: the heartbeat's step keeps the hang
    # detection fed (a step that no longer changes is a stall; one that changes is progress)
    client = AgentClient(channel.path, token=channel.token)
    try:
        client.call(proto.Beat(pid=7, step=-1))  # before the first step: no progress yet
        assert channel.control.stalled_for(7) is None
        client.call(proto.Beat(pid=7, step=4))
        assert channel.control.stalled_for(7) is not None
        assert channel.control.newest_step([7]) == 4
    finally:
        client.close()


def _memfds() -> int:
    """Shared-memory files this process holds open. Not every descriptor: other tests' threads
    in this process (a store's watch reconnecting, say) open and close sockets meanwhile."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # gone since the listing
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    return count


def test_a_worker_resuming_at_another_world_size_gets_only_the_rows_it_asked_for(tmp_path: Path) -> None:
    # Given a persisted step written by a world of 2, and an agent of a job at another size
    storage = LocalStorage(tmp_path)
    weight = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(3))  # 8 MiB
    data = make_snapshot({"model/w": weight, "step": torch.tensor([6])})
    for rank in range(2):
        durable.write_rank(storage, 6, rank, 2, data, {"world_size": 2, "rank": rank})
    durable.commit_step(storage, 6, 2)
    memory = NodeMemoryTier("channel-ranged")
    agent = AgentChannel(memory, NodeTiers(memory, storage), WorkerControl())
    client = AgentClient(agent.path, token=agent.token)
    before = _memfds()
    try:
        # When a worker asks for old rank 1's values, then 100 rows of its weight
        peeked, _ = client.call(proto.Peek(rank=1, step=6, world_size=2))
        select = Selection({"model/w": (1000, 1100)})
        response, fds = client.call(proto.GatherRanges(rank=1, step=6, world_size=2, select=select.to_message()))
        # Then it gets them, in a sparse memfd the agent no longer holds open, nothing else read
        assert peeked.values == {"world_size": 2, "rank": 1} and peeked.memory is False
        assert response.tier == "persistent" and len(fds) == 1
        buffer = SharedBuffer.attach(fds[0], populate=False)
        layout = parse_header(buffer.view(), buffer.nbytes)
        entry = next(e for e in layout.entries if e.name == "model/w")
        rows = buffer.tensor[layout.data_start + entry.begin : layout.data_start + entry.end].view(torch.float32)
        assert torch.equal(rows.view(2048, 1024)[1000:1100], weight[1000:1100])
        assert os.fstat(buffer.fd).st_blocks * 512 <= 3 * (1 << 20) < len(data) // 2
        assert response.nbytes <= 3 * (1 << 20)
        del rows
        buffer.close()
        # Neither the agent nor the worker keeps one. The agent closes its copy once the message
        # carrying it is sent, so the reply can arrive a moment before that close: wait for it.
        wait_until(lambda: _memfds() == before, timeout=10.0, what="the agent's copy closed")
        # And a rank no tier holds is a clear error, not a hang
        with pytest.raises(CheckpointError, match="no tier holds step 6 of rank 5"):
            client.call(proto.GatherRanges(rank=5, step=6, world_size=6, select=select.to_message()))
    finally:
        client.close()
        agent.close()
        memory.close()
