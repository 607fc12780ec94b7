"""A heartbeat verdict is confirmed on the node's replica server before it counts (issue 19).

Heartbeat counters carry no MAC, so a party that writes the store can hold a live node's counter
still. ``NodeWatch.confirm_lost`` asks the node's agent to prove the job secret and its node id over
the peer channel: one that does is not lost; a node whose server is gone, answers as another node,
or holds another secret is.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from resilrun.agent.liveness.heartbeat import StalenessJudge
from resilrun.agent.supervision.node_loss import NodeWatch, PeerLiveness
from resilrun.rendezvous.protocol import NodeInfo, RdzvState
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer, ReplicaStore, ReplicationError, alive

SECRET = os.urandom(32)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def serve() -> Iterator[Any]:
    """serve(node_id, secret=SECRET) -> a running replica server answering as that node."""
    opened: list[tuple[ReplicaServer, ReplicaStore, NodeMemoryTier]] = []

    def start(node_id: str, secret: bytes = SECRET) -> ReplicaServer:
        memory = NodeMemoryTier(f"t{uuid.uuid4().hex[:8]}")
        store = ReplicaStore("liveness-test")
        server = ReplicaServer(secret, store, memory, node_id=node_id)
        opened.append((server, store, memory))
        return server

    yield start
    for server, store, memory in opened:
        server.close()
        store.close()
        memory.close()


def watch() -> NodeWatch:
    # confirm_lost reads nothing but the liveness check: the rest of the agent is not needed here.
    return NodeWatch(None, None, None, None, None, PeerLiveness(SECRET, 1.0))  # type: ignore[arg-type]


def stale_judge(clock: FakeClock, *nodes: str) -> StalenessJudge:
    judge = StalenessJudge(5.0, clock)
    for node in nodes:
        judge.observe(node, 7)
    clock.now += 6.0  # the counters stood still past the timeout
    assert judge.stale() == sorted(nodes)
    return judge


def test_the_server_answers_alive_with_its_node_id_only_to_a_holder_of_the_secret(serve: Any) -> None:
    server = serve("node-a")
    assert alive(server.address, SECRET, timedelta(seconds=2)) == "node-a"
    with pytest.raises(ReplicationError):
        alive(server.address, os.urandom(32), timedelta(seconds=2))


def test_a_stalled_counter_of_a_node_that_proves_itself_is_not_lost_and_is_watched_afresh(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    live = serve("node-a")
    state = RdzvState(participants=(NodeInfo("node-a", "127.0.0.1", 1, peer_addr=live.address, hostname="h-a"),))
    clock = FakeClock()
    judge = stale_judge(clock, "node-a")
    node_watch = watch()
    with caplog.at_level(logging.WARNING):
        assert node_watch.confirm_lost((state,), ["node-a"], judge) == ()
        assert judge.stale() == []  # its silence starts over
        clock.now += 6.0
        assert node_watch.confirm_lost((state,), judge.stale(), judge) == ()
    warnings = [r.getMessage() for r in caplog.records if "not judged lost" in r.getMessage()]
    assert len(warnings) == 1 and "h-a" in warnings[0]  # said once, not every interval


def test_a_node_that_cannot_answer_is_lost(serve: Any) -> None:
    impostor = serve("node-x")  # another agent serves where node-b did: it answers as itself
    stranger = serve("node-c", secret=os.urandom(32))  # another job's agent
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{closed.getsockname()[1]}"  # nothing listens there once closed
    state = RdzvState(
        participants=(
            NodeInfo("node-a", "127.0.0.1", 1, peer_addr=gone),
            NodeInfo("node-b", "127.0.0.1", 1, peer_addr=impostor.address),
            NodeInfo("node-c", "127.0.0.1", 1, peer_addr=stranger.address),
            NodeInfo("node-d", "127.0.0.1", 1),  # no replica server (replication off)
        )
    )
    clock = FakeClock()
    nodes = ("node-a", "node-b", "node-c", "node-d")
    judge = stale_judge(clock, *nodes)
    started = time.monotonic()
    assert watch().confirm_lost((state,), nodes, judge) == nodes
    assert time.monotonic() - started < 4.0  # each costs at most the one-interval timeout
    assert judge.stale() == list(nodes)  # still stale: the verdict stands


def test_a_frozen_agent_is_lost_within_the_timeout() -> None:
    # A listener that never accepts: the connection opens (the kernel's backlog), no handshake comes,
    # as with a SIGSTOPped agent.
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(1)
        address = f"127.0.0.1:{frozen.getsockname()[1]}"
        state = RdzvState(participants=(NodeInfo("node-a", "127.0.0.1", 1, peer_addr=address),))
        judge = stale_judge(FakeClock(), "node-a")
        started = time.monotonic()
        assert watch().confirm_lost((state,), ["node-a"], judge) == ("node-a",)
        assert time.monotonic() - started < 2.5


def test_without_a_liveness_check_the_counter_alone_decides() -> None:
    judge = stale_judge(FakeClock(), "node-a")
    plain = NodeWatch(None, None, None, None, None)  # type: ignore[arg-type]
    assert plain.confirm_lost((RdzvState(),), ["node-a"], judge) == ("node-a",)
