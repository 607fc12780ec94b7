"""The rendezvous protocol (RendezvousClient) end to end on every backend, nodes as threads.

The unit tests drive the same code on a MemoryBackend with a fake clock; here real stores and real
time show that the compare-and-set protocol holds on each backend's actual concurrency.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import timedelta

import pytest

from resilrun.agent.liveness.heartbeat import HeartbeatSender, StalenessJudge, read_heartbeats
from resilrun.errors import RendezvousClosedError
from resilrun.rendezvous import document
from resilrun.rendezvous.api import RendezvousBackend
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import NodeInfo, RdzvState

pytestmark = pytest.mark.timeout(60)


# Whole-document reads, and reads gated by the version counter (the scale mode): same behaviour.
_REFRESH: list[float | None] = [None]


@pytest.fixture(autouse=True, params=[None, 30.0], ids=["full-reads", "version-gated"])
def refresh(request: pytest.FixtureRequest) -> None:
    _REFRESH[0] = request.param


@pytest.fixture(autouse=True, params=["inline", "apart"], ids=["members-inline", "members-apart"])
def members(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The member list in the document (small jobs), or apart from it (large ones: document.py)."""
    if request.param == "apart":
        monkeypatch.setattr(document, "BLOB_MIN", 1)


def _client(backend: RendezvousBackend, run_id: str, name: str, nodes: tuple[int, int]) -> RendezvousClient:
    me = NodeInfo(node_id=name, addr="127.0.0.1", local_world_size=2, hostname=name)
    return RendezvousClient(
        backend,
        run_id,
        me,
        min_nodes=nodes[0],
        max_nodes=nodes[1],
        join_timeout=timedelta(seconds=30),
        last_call_timeout=timedelta(seconds=0.3),
        refresh_s=_REFRESH[0],
    )


def _join_all(clients: list[RendezvousClient]) -> list[RdzvState]:
    results: list[RdzvState | BaseException] = [RuntimeError("not joined")] * len(clients)

    def join(index: int) -> None:
        try:
            results[index] = clients[index].join()
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[index] = exc

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(45)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]  # every entry is a state after the check above


def test_four_nodes_form_one_round_with_distinct_ranks(connect: Callable[[], RendezvousBackend]) -> None:
    # Given four nodes joining concurrently, each through its own connection
    run_id = f"proto-{uuid.uuid4().hex[:8]}"
    clients = [_client(connect(), run_id, f"n{i}", (4, 4)) for i in range(4)]
    states = _join_all(clients)
    # Then all agree on one complete round and every node has its own rank
    assert {s.round for s in states} == {0}
    assert all(s.complete for s in states)
    assert len({s.participants for s in states}) == 1
    ranks = sorted(s.node_rank(c.me.node_id) for s, c in zip(states, clients, strict=True))
    assert ranks == [0, 1, 2, 3]


def test_a_failure_opens_the_next_round_once_and_everyone_rejoins(connect: Callable[[], RendezvousBackend]) -> None:
    run_id = f"proto-{uuid.uuid4().hex[:8]}"
    clients = [_client(connect(), run_id, f"n{i}", (2, 3)) for i in range(3)]
    first = _join_all(clients)[0]
    # When two nodes report the same failure concurrently, one restart is counted
    threads = [
        threading.Thread(target=c.next_round, args=(first.round,), kwargs={"failure": {"m": "x"}, "max_restarts": 3})
        for c in clients[:2]
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert clients[2].state().restarts == 1
    second = _join_all(clients)
    assert {s.round for s in second} == {first.round + 1}
    # And an in-process recovery keeps the same nodes and ranks in a new generation
    recovered = clients[1].recover(second[0].round, failure=None)
    assert recovered.recovering and recovered.complete and recovered.participants == second[0].participants


def test_close_is_seen_by_every_node_and_acknowledged(connect: Callable[[], RendezvousBackend]) -> None:
    run_id = f"proto-{uuid.uuid4().hex[:8]}"
    clients = [_client(connect(), run_id, f"n{i}", (2, 2)) for i in range(2)]
    _join_all(clients)
    clients[0].close("succeeded")
    assert clients[1].state().closed and clients[1].state().outcome == "succeeded"
    assert [c.ack_closed() for c in clients] == [1, 2]
    assert clients[0].closed_acks() == 2
    late = _client(connect(), run_id, "late", (2, 2))
    with pytest.raises(RendezvousClosedError):
        late.join()


def test_heartbeats_show_a_live_node_and_a_stopped_one(connect: Callable[[], RendezvousBackend]) -> None:
    """Counters on most stores; on etcd a liveness lease per node, its key followed by watch."""
    # Given two nodes heartbeating every 0.1 s, observed by a third
    run_id = f"proto-{uuid.uuid4().hex[:8]}"
    senders = [HeartbeatSender(connect(), run_id, name, 0.1, timeout_s=0.6) for name in ("alive", "dies")]
    judge = StalenessJudge(timeout_s=0.6)
    observer = connect()

    def observe() -> None:
        for node, reading in read_heartbeats(observer, run_id, ["alive", "dies"]).items():
            judge.observe_reading(node, reading)

    try:
        import time

        for _ in range(5):
            observe()
            time.sleep(0.1)
        # When one stops heartbeating
        senders[1].close()
        deadline = time.monotonic() + 10
        while "dies" not in judge.stale() and time.monotonic() < deadline:
            observe()
            time.sleep(0.1)
        # Then only it goes stale
        assert judge.stale() == ["dies"]
    finally:
        for sender in senders:
            sender.close()
        observer.close()
