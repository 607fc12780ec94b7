"""A flood of connections without the job secret cannot switch the heartbeat-hold defence off (issue 43, F2).

``NodeWatch.confirm_lost`` counts a node whose ALIVE probe fails as lost. If idle connections that
never prove the secret could fill the replica server's connection slots, anyone who can reach
the port could make every probe fail and, together with a held heartbeat counter, have a live
node judged lost. Unauthenticated connections therefore get a budget of their own (the
server's pre-auth stage) that authenticated peers and ALIVE never compete with.

Real sockets on loopback; the flood is held open while the probes and pushes run.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from resilrun.agent.liveness.heartbeat import StalenessJudge
from resilrun.agent.supervision.node_loss import NodeWatch, PeerLiveness
from resilrun.rendezvous.protocol import NodeInfo, RdzvState
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer, ReplicaStore, ReplicationError, alive, push
from resilrun.tiers.peer import server as peer_server
from resilrun.tiers.peer.wire import MAGIC, NONCE_BYTES, Announce, Deadline, client_handshake, snapshot_bounds
from tests.conftest import wait_until
from tests.socket.peer.harness import NODE_ID, SECRET, snapshot

pytestmark = pytest.mark.timeout(30)

FLOOD = 80  # more than the 64 connection slots the server had before the pre-auth stage
HELLO = len(MAGIC) + NONCE_BYTES


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def settled(sock: socket.socket) -> None:
    """Wait until the server has dealt with ``sock``: it sent its hello, or closed the connection."""
    sock.settimeout(5)
    received = b""
    with contextlib.suppress(OSError):
        while len(received) < HELLO and (chunk := sock.recv(HELLO - len(received))):
            received += chunk


@contextlib.contextmanager
def idle_flood(server: ReplicaServer, count: int, source: str = "127.0.0.1") -> Iterator[list[socket.socket]]:
    """``count`` connections from ``source`` that never prove the secret, held open; yielded once
    the server has accepted (or already dropped) every one of them."""
    flood: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((source, 0))
            sock.connect(("127.0.0.1", server.port))
            flood.append(sock)
        for sock in flood:
            settled(sock)
        yield flood
    finally:
        for sock in flood:
            sock.close()


def test_an_idle_flood_without_the_secret_neither_gets_a_live_node_judged_lost_nor_stops_pushes(
    server: ReplicaServer, store: ReplicaStore
) -> None:
    # Given a node whose heartbeat counter stood still past the timeout (held by a party at the store)
    state = RdzvState(participants=(NodeInfo(NODE_ID, "127.0.0.1", 1, peer_addr=server.address, hostname="h-a"),))
    clock = FakeClock()
    judge = StalenessJudge(5.0, clock)
    judge.observe(NODE_ID, 7)
    clock.now += 6.0
    watch = NodeWatch(None, None, None, None, None, PeerLiveness(SECRET, 1.0))  # type: ignore[arg-type]
    started = time.monotonic()
    # When more idle connections than the server ever had slots are held open against it
    with idle_flood(server, FLOOD):
        # Then the node proves it is alive, and an authenticated peer's push still lands
        assert watch.confirm_lost((state,), [NODE_ID], judge) == ()
        push(server.address, SECRET, 0, 1, None, snapshot(1), {"step": 1}, timeout=timedelta(seconds=5))
        assert store.steps(0) == [1]
        assert all(alive(server.address, SECRET, timedelta(seconds=1)) == NODE_ID for _ in range(5))
    assert time.monotonic() - started < 10


def test_a_flood_is_bounded_in_threads_and_its_oldest_connections_are_dropped_first(
    server: ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peer_server, "AUTH_TIMEOUT_S", 20.0)  # only drops close connections here, not the deadline
    before = threading.active_count()
    with idle_flood(server, 3 * peer_server.MAX_PENDING) as flood:
        # Each connection beyond the pre-auth budget pushed out the oldest one still waiting to
        # prove the secret: the first ones were closed, the newest ones are still waiting.
        closed = [is_closed(sock) for sock in flood]
        assert all(closed[: 2 * peer_server.MAX_PENDING])
        assert not any(closed[-peer_server.MAX_PENDING // 2 :])
        # the dropped connections' threads end at their next recv
        wait_until(lambda: threading.active_count() - before <= peer_server.MAX_PENDING, what="threads bounded")
        assert alive(server.address, SECRET, timedelta(seconds=1)) == NODE_ID


def test_a_flood_from_one_address_does_not_drop_a_slow_handshake_from_another(
    server: ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peer_server, "AUTH_TIMEOUT_S", 20.0)  # a slow machine must not time the honest peer out
    # Given an honest peer on 127.0.0.1 that has the server's hello but has not answered yet
    with socket.socket() as honest:
        honest.bind(("127.0.0.1", 0))
        honest.connect(("127.0.0.1", server.port))
        honest.settimeout(5)
        # When another address (127.0.0.2: loopback, another host as far as the server can tell)
        # opens several times the pre-auth budget of idle connections
        with idle_flood(server, 3 * peer_server.MAX_PENDING, source="127.0.0.2"):
            # Then the honest peer's handshake still completes, and its request is served
            session = client_handshake(honest, SECRET, Deadline.total(5))
            session.send({"op": "alive"}, Deadline.total(5))
            assert session.recv(Deadline.total(5)) == {"ok": True, "node": NODE_ID}


def is_closed(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (its hello, if sent, already read): EOF or a reset.

    Without waiting: the server drops a connection before it starts the next one's thread, and on
    loopback the FIN is delivered as it is sent, so once the newest one's hello came every drop shows.
    """
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except BlockingIOError:
        return False


def test_alive_is_answered_even_when_every_service_slot_is_busy(store: ReplicaStore, memory: NodeMemoryTier) -> None:
    server = ReplicaServer(SECRET, store, memory, node_id=NODE_ID, max_connections=1)
    try:
        data = snapshot(2)
        announce = Announce(0, 2, None, len(data), None, snapshot_bounds(memoryview(data)))
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as held_open:
            # Given the one slot taken by a push whose bytes have yet to come
            session = client_handshake(held_open, SECRET, Deadline.total(5))
            session.send({"op": "push", **announce.to_message()}, Deadline.total(5))
            assert session.recv(Deadline.total(5))["ok"] is True
            # Then another push is told the server is busy, and ALIVE is still answered
            with pytest.raises(ReplicationError, match="busy"):
                push(server.address, SECRET, 1, 2, None, data, None, timeout=timedelta(seconds=5))
            assert alive(server.address, SECRET, timedelta(seconds=1)) == NODE_ID
    finally:
        server.close()
