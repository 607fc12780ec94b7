"""The Replicator over real loopback sockets: newest step only, lag, torn slots, dead and slow peers.

Each test plays two nodes in one process: a "local" NodeMemoryTier that a fake worker commits to,
and one or more peers (their own store and ReplicaServer) that the Replicator targets.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import torch

from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer, ReplicaStore, Replicator
from resilrun.tiers.peer.wire import ReplicationError
from tests.conftest import free_port, make_snapshot, wait_until

pytestmark = pytest.mark.timeout(30)


def fed_by(memory: NodeMemoryTier, *args: Any, hold_commits: bool = True, **kwargs: Any) -> Replicator:
    """A replicator fed by node memory's announcements and holding its commits, as the agent's
    commit pipeline (agent/state/commits.py) wires it; ``hold_commits=False``: without the gate."""
    replicator = Replicator(memory, *args, **kwargs)
    memory.add_listener(replicator.on_commit)
    if hold_commits:
        memory.add_commit_gate(replicator.hold_commit)
    return replicator


SECRET = b"replicator-test-secret-0123456789"
TIMEOUT = timedelta(seconds=2)
REFRESH = timedelta(milliseconds=20)  # the targets callable is asked this often


def snapshot(seed: int, numel: int = 2048) -> bytes:
    return make_snapshot({"w": torch.full((numel,), float(seed)), "step": torch.tensor([seed])})


def eventually(condition: Callable[[], object]) -> None:
    wait_until(condition, timeout=10.0)


def handled(replicator: Replicator, rank: int) -> int:
    """How many of ``rank``'s commits every current target has dealt with: replicated, or looked at
    and passed over (a slot overwritten first). ``status()`` shows only confirmed steps, so this
    reads the Replicator's private per-target record; 0 while there is no target."""
    with replicator._cond:
        targets = list(replicator._targets.values())
        return min((t.done.get(rank, 0) for t in targets), default=0)


def lags(replicator: Replicator) -> dict[int, dict[str, object]]:
    """``status()`` without the gate's waiting time (which the tests that commit directly never pass)."""
    return {rank: {k: v for k, v in info.items() if k != "held_s"} for rank, info in replicator.status().items()}


def write_slot(memory: NodeMemoryTier, rank: int, slot: int, data: bytes) -> None:
    buffer = memory.rank(rank).slots[slot]
    if buffer is None or buffer.nbytes < len(data):
        buffer = memory.allocate(rank, slot, len(data))
    seq = memory.rank(rank).seq
    seq.begin(slot)
    buffer.view()[: len(data)] = data
    seq.end(slot)


def commit(memory: NodeMemoryTier, rank: int, step: int, data: bytes) -> float:
    """Write and commit as a worker does (slot = step % 2); returns how long commit() took."""
    write_slot(memory, rank, step % 2, data)
    started = time.monotonic()
    memory.commit(rank, step, step % 2, len(data), {"step": step})
    return time.monotonic() - started


@dataclass
class Peer:
    memory: NodeMemoryTier
    store: ReplicaStore
    server: ReplicaServer

    def close(self) -> None:
        self.server.close()
        self.store.close()
        self.memory.close()


@pytest.fixture
def memory() -> Iterator[NodeMemoryTier]:
    tier = NodeMemoryTier(f"t{uuid.uuid4().hex[:8]}")
    yield tier
    tier.close()


@pytest.fixture
def make_peer() -> Iterator[Callable[[], Peer]]:
    peers: list[Peer] = []

    def make() -> Peer:
        peer_memory = NodeMemoryTier(f"p{uuid.uuid4().hex[:8]}")
        store = ReplicaStore("peer")
        peers.append(Peer(peer_memory, store, ReplicaServer(SECRET, store, peer_memory)))
        return peers[-1]

    yield make
    for peer in peers:
        peer.close()


@pytest.fixture
def replicators() -> Iterator[list[Replicator]]:
    made: list[Replicator] = []
    yield made
    for replicator in made:
        replicator.close()


class Switch:
    """Targets that the test turns on when it wants replication to start."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.on = threading.Event()

    def __call__(self) -> list[str]:
        return self.addresses if self.on.is_set() else []


def test_only_the_newest_of_several_quick_commits_is_replicated(
    memory: NodeMemoryTier, make_peer: Callable[[], Peer], replicators: list[Replicator]
) -> None:
    peer = make_peer()
    targets = Switch(peer.server.address)
    replicator = fed_by(memory, SECRET, targets, world_size=lambda: 2, timeout=TIMEOUT, refresh=REFRESH)
    replicators.append(replicator)

    for step in range(1, 6):  # the replicator is behind (no target yet) while these commit
        commit(memory, 1, step, snapshot(step))
    targets.on.set()

    eventually(lambda: replicator.status()[1]["replicated"] == 5)
    assert peer.store.steps(1) == [5]  # 1..4 were skipped, not sent late
    assert peer.store.read(1, 5) == (snapshot(5), {"step": 5})
    replica = peer.store.replica(1, 5)
    assert replica is not None and replica.world_size == 2
    assert lags(replicator) == {1: {"committed": 5, "replicated": 5, "lag_steps": 0}}


def test_every_local_rank_reaches_every_target(
    memory: NodeMemoryTier, make_peer: Callable[[], Peer], replicators: list[Replicator]
) -> None:
    peers = [make_peer(), make_peer()]
    replicator = fed_by(memory, SECRET, lambda: [p.server.address for p in peers], timeout=TIMEOUT, refresh=REFRESH)
    replicators.append(replicator)

    for step in (1, 2, 3):
        for rank in (0, 1):
            commit(memory, rank, step, snapshot(10 * rank + step))

    eventually(lambda: all(s["lag_steps"] == 0 for s in replicator.status().values()) and len(replicator.status()) == 2)
    for peer in peers:
        assert peer.store.steps(0)[0] == 3 and peer.store.steps(1)[0] == 3
        assert peer.store.read(0, 3) == (snapshot(3), {"step": 3})
        assert peer.store.read(1, 3) == (snapshot(13), {"step": 3})


def test_a_dead_target_makes_replicas_lag_without_slowing_commits(
    memory: NodeMemoryTier,
    make_peer: Callable[[], Peer],
    replicators: list[Replicator],
    caplog: pytest.LogCaptureFixture,
) -> None:
    live = make_peer()
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    replicator = fed_by(memory, SECRET, lambda: [dead, live.server.address], timeout=TIMEOUT, refresh=REFRESH)
    replicators.append(replicator)

    with caplog.at_level(logging.WARNING, logger="resilrun.tiers.peer.replicator"):
        commit_seconds = []
        for step in range(1, 21):
            commit_seconds.append(commit(memory, 0, step, snapshot(step)))
            time.sleep(0.02)  # a short training step, so that the dead peer is retried meanwhile
        eventually(lambda: live.store.steps(0)[:1] == [20])

    assert max(commit_seconds) < 0.05  # the listener only records; no I/O on the committing thread
    assert lags(replicator) == {0: {"committed": 20, "replicated": None, "lag_steps": None}}
    failures = [r for r in caplog.records if dead in r.getMessage()]
    assert len(failures) == 1  # logged once when the peer started failing, not once per step or retry


def test_lag_grows_while_a_peer_is_down_and_closes_on_a_new_peer(
    memory: NodeMemoryTier, make_peer: Callable[[], Peer], replicators: list[Replicator]
) -> None:
    first = make_peer()
    address = [first.server.address]
    replicator = fed_by(memory, SECRET, lambda: address, timeout=TIMEOUT, refresh=REFRESH)
    replicators.append(replicator)
    for step in (1, 2):  # each on the peer before the next commits: it holds both
        commit(memory, 0, step, snapshot(step))
        eventually(lambda step=step: replicator.status()[0]["replicated"] == step)

    first.server.close()  # the peer's agent dies; it stays a target until the membership changes
    commit(memory, 0, 3, snapshot(3))  # its commit gate waits until the push of 3 failed
    commit(memory, 0, 4, snapshot(4))
    assert lags(replicator) == {0: {"committed": 4, "replicated": 2, "lag_steps": 2}}

    second = make_peer()
    address[:] = [second.server.address]  # the lead hands the next node's address instead
    eventually(lambda: lags(replicator)[0] == {"committed": 4, "replicated": 4, "lag_steps": 0})
    assert second.store.steps(0) == [4]
    assert first.store.steps(0) == [2, 1]


def test_a_peer_that_fails_then_keeps_up_again_is_reported_behind_then_caught_up(
    memory: NodeMemoryTier,
    make_peer: Callable[[], Peer],
    replicators: list[Replicator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a peer whose first two pushes fail (a connection reset), with the agent's health hook
    peer = make_peer()
    health: list[tuple[str, bool, str]] = []
    replicator = fed_by(
        memory, SECRET, lambda: [peer.server.address], timeout=TIMEOUT, refresh=REFRESH,
        on_health=lambda *change: health.append(change),
    )  # fmt: skip
    replicators.append(replicator)
    push = replicator._replicate
    resets = [2]

    def flaky(target: Any, source: Any) -> bool:
        if resets[0]:
            resets[0] -= 1
            raise ReplicationError("connection reset by peer")
        return push(target, source)

    monkeypatch.setattr(replicator, "_replicate", flaky)
    # When a step is committed, the pushes fail twice, then the retry lands
    commit(memory, 0, 1, snapshot(1))
    eventually(lambda: replicator.status()[0]["replicated"] == 1)
    # Then the change is told once each way (the events' replica_behind and replica_caught_up)
    assert health == [(peer.server.address, False, "connection reset by peer"), (peer.server.address, True, "")]


def test_a_peer_slower_than_its_usual_pace_holds_a_commit_about_a_step_then_is_not_waited_for_until_it_keeps_up(
    memory: NodeMemoryTier, make_peer: Callable[[], Peer], replicators: list[Replicator]
) -> None:
    # Given a peer whose pushes the gate has timed at its usual pace (each commit waited for its push)
    peer = make_peer()
    relay = SlowRelay(peer.server.port, bytes_per_second=None)
    health: list[tuple[str, bool, str]] = []
    deadline = timedelta(seconds=5)  # a push's own deadline: what the gate waited before it learned
    replicator = fed_by(
        memory, SECRET, lambda: [relay.address], timeout=deadline, refresh=REFRESH,
        on_health=lambda *change: health.append(change),
    )  # fmt: skip
    replicators.append(replicator)
    try:
        eventually(lambda: relay.address in replicator._targets)
        for step in range(1, 9):
            commit(memory, 0, step, snapshot(step))
            memory.pass_gates(0, step)
            assert lags(replicator)[0]["lag_steps"] == 0
            time.sleep(0.01)  # the worker's step
        # When the link slows to a crawl (a step's push would take seconds)
        relay.rate = 2_000
        commit(memory, 0, 9, snapshot(9))
        held = memory.pass_gates(0, 9)
        # Then that commit waited about a step, not the push's deadline, and the peer is reported behind
        assert 0.01 < held < 1.0
        assert [(address, keeps_up) for address, keeps_up, _ in health] == [(relay.address, False)]
        assert "slower than training" in health[0][2]
        # and the next commits do not wait for it: its replica lags more than one step meanwhile
        commit(memory, 0, 10, snapshot(10))
        assert memory.pass_gates(0, 10) < 0.05
        assert lags(replicator)[0]["replicated"] == 8
        # When the link is fast again, a push at the usual pace lands: caught up, waited for again
        relay.rate = None
        eventually(lambda: len(health) == 2)
        assert health[1] == (relay.address, True, "")
        eventually(lambda: lags(replicator)[0]["replicated"] == 10)
        commit(memory, 0, 11, snapshot(11))
        memory.pass_gates(0, 11)
        assert lags(replicator)[0]["lag_steps"] == 0
    finally:
        replicator.close()
        relay.close()


def test_a_peer_slower_than_the_steps_still_gets_complete_replicas(
    memory: NodeMemoryTier, make_peer: Callable[[], Peer], replicators: list[Replicator]
) -> None:
    # Every stream straight from the slot is torn by the worker's next-but-one write, so the
    # replicator falls back to a private copy per push; the peer still gets whole, verified steps.
    peer = make_peer()
    relay = SlowRelay(peer.server.port, bytes_per_second=80_000_000)
    replicator = fed_by(memory, SECRET, lambda: [relay.address], timeout=TIMEOUT, refresh=REFRESH)
    replicators.append(replicator)
    numel = 2 * 1024 * 1024  # 8 MiB: ~100 ms through the relay, more than the socket buffers hold
    try:
        step = 0
        deadline = time.monotonic() + 15
        while (replicator.status().get(0, {}).get("replicated") or 0) < 3 and time.monotonic() < deadline:
            step += 1
            commit(memory, 0, step, snapshot(step, numel))
            time.sleep(0.01)
        replicated = replicator.status()[0]["replicated"]
        assert replicated is not None and replicated >= 3
        assert peer.store.read(0, replicated) == (snapshot(replicated, numel), {"step": replicated})
    finally:
        replicator.close()
        relay.close()


class SlowRelay:
    """Forwards every connection to a port at a limited rate (client to server only); ``rate`` may
    change at any time (None: unlimited), taking effect at the next chunk of every connection."""

    def __init__(self, port: int, bytes_per_second: int | None) -> None:
        self._port = port
        self.rate = bytes_per_second
        self._listener = socket.socket()
        # A small receive buffer, so that the sender feels the limited rate instead of filling buffers.
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self._listener.settimeout(0.1)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self._port), timeout=5)
            for source, sink, limited in ((client, upstream, True), (upstream, client, False)):
                thread = threading.Thread(target=self._pump, args=(source, sink, limited), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, source: socket.socket, sink: socket.socket, limited: bool) -> None:
        source.settimeout(0.2)
        try:
            while not self._stop.is_set():
                try:
                    chunk = source.recv(1 << 16)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                if limited and (rate := self.rate):
                    time.sleep(len(chunk) / rate)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self._listener.close()


def test_a_slot_being_overwritten_is_never_replicated_as_the_committed_step(
    memory: NodeMemoryTier, make_peer: Callable[[], Peer], replicators: list[Replicator]
) -> None:
    peer = make_peer()
    targets = Switch(peer.server.address)
    replicator = fed_by(memory, SECRET, targets, timeout=TIMEOUT, refresh=REFRESH)
    replicators.append(replicator)
    commit(memory, 0, 1, snapshot(1))  # slot 1
    # The worker has started writing step 3 into step 1's slot (it committed nothing yet): torn.
    seq = memory.rank(0).seq
    seq.begin(1)
    memory.rank(0).slots[1].view()[:64] = b"\xee" * 64  # type: ignore[union-attr]
    targets.on.set()
    eventually(lambda: handled(replicator, 0) == 1)  # the target looked at step 1's commit

    assert peer.store.held() == {}
    assert replicator.status()[0]["replicated"] is None

    seq.end(1)  # then a worker finishes step 3 into the same slot: the same counter parity, new bytes
    write_slot(memory, 0, 1, snapshot(3))
    # Nothing is committed, so nothing is sent: step 1's commit was dealt with, and its counter no
    # longer matches the slot anyway
    assert peer.store.held() == {}

    memory.commit(0, 3, 1, len(snapshot(3)), {"step": 3})
    eventually(lambda: replicator.status()[0]["replicated"] == 3)
    assert peer.store.read(0, 3) == (snapshot(3), {"step": 3})


def test_a_blackholed_peer_never_blocks_commits_and_close_cuts_it_off(
    memory: NodeMemoryTier, replicators: list[Replicator]
) -> None:
    # A peer that accepts TCP connections and never answers: each push waits for its deadline.
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        replicator = fed_by(memory, SECRET, lambda: [address], timeout=timedelta(seconds=20))
        commit_seconds = [commit(memory, 0, step, snapshot(step)) for step in range(1, 11)]
        eventually(lambda: len(accepted) >= 1)

        assert max(commit_seconds) < 0.05
        started = time.monotonic()
        replicator.close(timeout=timedelta(seconds=5))
        assert time.monotonic() - started < 2  # the in-flight handshake was cut, not waited out
        assert lags(replicator)[0] == {"committed": 10, "replicated": None, "lag_steps": None}
        commit(memory, 0, 11, snapshot(11))  # the listener stays registered and does nothing now
    finally:
        stop.set()
        thread.join(5)
        listener.close()
        for conn in accepted:
            conn.close()


def test_a_push_that_connects_while_close_runs_is_cut_off_too(
    memory: NodeMemoryTier, replicators: list[Replicator], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A peer that accepts TCP connections and never answers, and a push held back until close()
    # has begun: its socket exists only after close() looked for sockets to cut.
    from resilrun.tiers.peer import replicator as peer_module

    listener = socket.create_server(("127.0.0.1", 0))
    real_push_view = peer_module.push_view
    closing, taken = threading.Event(), threading.Event()

    def push_after_close_began(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a pass-through
        taken.set()
        closing.wait(10)
        return real_push_view(*args, **kwargs)

    monkeypatch.setattr(peer_module, "push_view", push_after_close_began)
    try:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        replicator = fed_by(memory, SECRET, lambda: [address], timeout=timedelta(seconds=20))
        commit(memory, 0, 1, snapshot(1))
        assert taken.wait(10)  # the push is taken and waiting in push_after_close_began
        started = time.monotonic()
        threading.Timer(0.05, closing.set).start()  # during close()'s join
        replicator.close(timeout=timedelta(seconds=5))
        assert time.monotonic() - started < 2  # the late socket was cut as soon as it was registered
    finally:
        closing.set()
        listener.close()


def test_a_broken_targets_callable_keeps_the_current_targets(
    memory: NodeMemoryTier, make_peer: Callable[[], Peer], replicators: list[Replicator]
) -> None:
    peer = make_peer()
    calls = []

    def targets() -> list[str]:
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("rendezvous unreachable")
        return [peer.server.address]

    replicator = fed_by(memory, SECRET, targets, timeout=TIMEOUT, refresh=REFRESH)
    replicators.append(replicator)
    eventually(lambda: len(calls) > 3)
    commit(memory, 0, 1, snapshot(1))

    eventually(lambda: peer.store.steps(0) == [1])


class _Watched:
    """A rank's sequence counters that note when a thread other than the test's reads them."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.read_elsewhere = threading.Event()

    def read(self, slot: int) -> int:
        if threading.current_thread() is not threading.main_thread():
            self.read_elsewhere.set()
        return self.inner.read(slot)  # type: ignore[attr-defined, no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_a_torn_slot_whose_counter_reads_stable_is_never_replicated(
    memory: NodeMemoryTier, make_peer: Callable[[], Peer], replicators: list[Replicator]
) -> None:
    # Given rank 0's step 1 and rank 1's step 1 committed (slot 1 each)
    peer = make_peer()
    targets = Switch(peer.server.address)
    replicator = fed_by(memory, SECRET, targets, timeout=TIMEOUT, refresh=REFRESH)
    replicators.append(replicator)
    commit(memory, 0, 1, snapshot(1))
    commit(memory, 1, 1, snapshot(1))
    watched = _Watched(memory.rank(0).seq)
    memory.rank(0).seq = watched  # type: ignore[assignment]
    # When half of rank 0's next step lands in that slot ahead of its counter (stores a weakly
    # ordered CPU made visible before the counter's): the counter reads stable, the bytes are torn
    torn = snapshot(3)
    memory.rank(0).slots[1].view()[: len(torn) // 2] = torn[: len(torn) // 2]  # type: ignore[union-attr]
    targets.on.set()
    # Then the replicator tries rank 0 first (round robin), then rank 1: once rank 1's step is there,
    # rank 0's attempt is over, and it sent nothing the peer kept
    eventually(lambda: replicator.status()[1]["replicated"] == 1)
    assert watched.read_elsewhere.is_set()
    assert peer.store.steps(0) == []
    assert replicator.status()[0]["replicated"] is None


# -- the commit gate: training waits for replicas that keep up, never for failing ones ------------------
def test_the_gate_holds_a_commit_until_its_step_is_on_the_peer_so_replicas_lag_one_step_at_most(
    memory: NodeMemoryTier, make_peer: Callable[[], Peer], replicators: list[Replicator]
) -> None:
    # Given a peer whose pushes take longer than the worker's steps
    peer = make_peer()
    replicator = fed_by(
        memory, SECRET, lambda: [peer.server.address], timeout=TIMEOUT, refresh=REFRESH, push_delay_s=0.1
    )
    replicators.append(replicator)
    eventually(lambda: peer.server.address in replicator._targets)  # the target's thread runs
    held = []
    for step in range(1, 6):
        # When a worker commits each step and then waits for the answer as its next snapshot does
        assert lags(replicator).get(0, {}).get("replicated") in (None, step - 1)  # the lag before this commit
        commit(memory, 0, step, snapshot(step))
        held.append(memory.pass_gates(0, step))
        # Then the answer comes once the step is on the peer: the next commit finds no lag
        assert lags(replicator)[0] == {"committed": step, "replicated": step, "lag_steps": 0}
    assert min(held) >= 0.09  # each answer waited for its push (the hook's delay), ...
    assert replicator.status()[0]["held_s"] == pytest.approx(sum(held), abs=0.01)  # ... and status says so
    assert peer.store.steps(0)[0] == 5


@pytest.mark.parametrize(
    ("every", "says", "steps", "pushed"),
    [
        # --replicate-every 4: the ends of intervals of 4, chosen by the agent from each commit's previous step
        (4, lambda step: None, 10, (3, 7)),
        # --replicate-every auto: the agent's interval is left at 1 and the workers' commits choose
        # (every third snapshot here)
        (1, lambda step: step % 3 == 2, 9, (2, 5, 8)),
    ],
    ids=["every-4", "auto"],
)
def test_only_the_snapshots_chosen_for_replicas_are_pushed_and_the_others_pass_the_gate_at_once(
    memory: NodeMemoryTier,
    make_peer: Callable[[], Peer],
    replicators: list[Replicator],
    every: int,
    says: Callable[[int], bool | None],
    steps: int,
    pushed: tuple[int, ...],
) -> None:
    # Given pushes slower than the worker's steps
    peer = make_peer()
    replicator = fed_by(
        memory, SECRET, lambda: [peer.server.address], timeout=TIMEOUT, refresh=REFRESH, push_delay_s=0.1, every=every
    )
    replicators.append(replicator)
    eventually(lambda: peer.server.address in replicator._targets)
    held = {}
    for step in range(steps):
        # When a worker commits each step, saying which step it snapshotted before (and, under
        # auto, whether this one goes to the peers)
        write_slot(memory, 0, step % 2, snapshot(step))
        memory.commit(0, step, step % 2, len(snapshot(step)), {"step": step}, previous=step - 1, replicate=says(step))
        held[step] = memory.pass_gates(0, step)
    # Then the chosen steps were pushed, each answer waiting for its push,
    assert min(held[s] for s in pushed) >= 0.09
    # and no other commit waited for anything
    assert max(t for s, t in held.items() if s not in pushed) < 0.05
    assert lags(replicator)[0]["replicated"] == pushed[-1]
    assert sorted(peer.store.steps(0)) == list(pushed[-2:])  # the peer keeps a rank's newest two


def test_the_gate_does_not_wait_for_a_peer_that_refuses_connections(
    memory: NodeMemoryTier, replicators: list[Replicator]
) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    replicator = fed_by(memory, SECRET, lambda: [dead], timeout=TIMEOUT, refresh=REFRESH)
    replicators.append(replicator)
    eventually(lambda: dead in replicator._targets)
    waits = []
    for step in range(1, 5):
        commit(memory, 0, step, snapshot(step))
        waits.append(memory.pass_gates(0, step))
    assert waits[0] < 1  # the first push failed at once: training does not wait for a dead peer ...
    assert max(waits[1:]) < 0.05  # ... nor for one in backoff


@contextlib.contextmanager
def replicating_to_a_silent_peer(
    memory: NodeMemoryTier, replicators: list[Replicator], **options: object
) -> Iterator[Replicator]:
    """A Replicator whose one target accepts TCP connections and never answers (each push fails at
    its deadline), running once its target's thread does."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        replicator = fed_by(memory, SECRET, lambda: [address], refresh=REFRESH, **options)  # type: ignore[arg-type]
        replicators.append(replicator)
        eventually(lambda: address in replicator._targets)
        yield replicator
    finally:
        listener.close()


def test_the_gate_waits_out_a_blackholed_peer_once_then_no_longer(
    memory: NodeMemoryTier, replicators: list[Replicator]
) -> None:
    with replicating_to_a_silent_peer(memory, replicators, timeout=timedelta(seconds=0.5)) as replicator:
        commit(memory, 0, 1, snapshot(1))
        first = memory.pass_gates(0, 1)
        later = []
        for step in range(2, 6):
            commit(memory, 0, step, snapshot(step))
            later.append(memory.pass_gates(0, step))
        assert 0.3 < first < 2  # the push's deadline, once
        assert max(later) < 0.05  # a failing peer is not waited for: replicas lag, training goes on
        assert lags(replicator)[0]["replicated"] is None


def test_without_the_gate_commits_are_never_held(memory: NodeMemoryTier, replicators: list[Replicator]) -> None:
    with replicating_to_a_silent_peer(memory, replicators, timeout=timedelta(seconds=5), hold_commits=False):
        commit(memory, 0, 1, snapshot(1))
        assert memory.pass_gates(0, 1) == 0


def test_a_peer_behind_that_stops_being_a_target_is_told_dropped_not_left_behind(
    memory: NodeMemoryTier, make_peer: Callable[[], Peer], replicators: list[Replicator]
) -> None:
    # Given a peer reported behind (its server gone: a lost node) and a new peer replacing it
    gone, new = make_peer(), make_peer()
    targets = [gone.server.address]
    health: list[tuple[str, bool, str]] = []
    dropped: list[str] = []
    replicator = fed_by(
        memory, SECRET, lambda: list(targets), timeout=TIMEOUT, refresh=REFRESH,
        on_health=lambda *change: health.append(change), on_dropped=dropped.append,
    )  # fmt: skip
    replicators.append(replicator)
    gone.server.close()
    commit(memory, 0, 1, snapshot(1))
    eventually(lambda: [keeps_up for _, keeps_up, _ in health] == [False])
    # When the replica peers are chosen again without it (the spare node took the lost one's place)
    targets[:] = [new.server.address]
    # Then it is told dropped once (status no longer lists it behind), and never caught up
    eventually(lambda: dropped == [gone.server.address])
    assert [keeps_up for _, keeps_up, _ in health] == [False]


def test_a_push_that_fails_after_its_peer_stopped_being_a_target_reports_nothing(
    memory: NodeMemoryTier, replicators: list[Replicator]
) -> None:
    # Given a push in flight to a peer that never answers (it fails at its deadline)
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    targets = [address]
    health: list[tuple[str, bool, str]] = []
    dropped: list[str] = []
    replicator = fed_by(
        memory, SECRET, lambda: list(targets), timeout=timedelta(seconds=1.5), refresh=REFRESH,
        on_health=lambda *change: health.append(change), on_dropped=dropped.append,
    )  # fmt: skip
    replicators.append(replicator)
    try:
        eventually(lambda: address in replicator._targets)
        thread = replicator._targets[address].thread
        commit(memory, 0, 1, snapshot(1))
        # When the peers are chosen again without it while the push is still in flight
        targets.clear()
        eventually(lambda: address not in replicator._targets)
        # Then the push's failure, once it comes, reports nothing: the peer is no longer a target,
        # and a "behind" told now would stay in the status until the job ends
        assert thread is not None
        eventually(lambda: not thread.is_alive())
        assert health == [] and dropped == []
    finally:
        listener.close()


# -- a node's ranks at one peer: a step common to all of them is never overwritten ----------------------
class Holdings:
    """What a peer's store holds for ``ranks`` after each replica it publishes."""

    def __init__(self, store: ReplicaStore, ranks: tuple[int, ...]) -> None:
        self.seen: list[dict[int, set[int]]] = []
        publish = store.publish

        def recording(*args: Any) -> None:
            publish(*args)
            self.seen.append({rank: set(store.steps(rank)) for rank in ranks})

        store.publish = recording  # type: ignore[method-assign]

    def without_a_common_step(self) -> list[dict[int, set[int]]]:
        """The holdings, once every rank held something, in which no step was held for every rank."""
        started = [held for held in self.seen if all(held.values())]
        return [held for held in started if not set.intersection(*held.values())]


def test_a_rank_whose_commit_arrives_before_another_local_ranks_older_one_waits_for_it_at_the_peer(
    memory: NodeMemoryTier, make_peer: Callable[[], Peer], replicators: list[Replicator]
) -> None:
    # Given two local ranks replicated to one peer that keeps two steps per rank
    peer = make_peer()
    holdings = Holdings(peer.store, (0, 1))
    replicator = fed_by(memory, SECRET, lambda: [peer.server.address], timeout=TIMEOUT, refresh=REFRESH)
    replicators.append(replicator)
    for rank in (0, 1):
        commit(memory, rank, 1, snapshot(10 * rank + 1))
    eventually(lambda: peer.store.steps(0) == peer.store.steps(1) == [1])  # pushed, not skipped for a newer one
    commit(memory, 0, 2, snapshot(2))
    eventually(lambda: peer.store.steps(0) == [2, 1] and peer.store.steps(1) == [1])
    # When rank 0's step 3 reaches the agent before rank 1's step 2 (a worker's commit message is
    # late on a loaded node: rank 1 already trains step 3 beside rank 0)
    commit(memory, 0, 3, snapshot(3))
    with contextlib.suppress(AssertionError):  # give rank 0's push the time to go (it should not)
        wait_until(lambda: 3 in peer.store.steps(0), timeout=0.5)
    commit(memory, 1, 2, snapshot(12))
    eventually(lambda: peer.store.steps(0)[0] == 3 and peer.store.steps(1)[0] == 2)
    # Then the peer held a step of both ranks at every moment: a node lost at any point could be
    # resumed from it (rank 0's step 1 was not dropped for step 3 while rank 1 held step 1 only)
    assert holdings.without_a_common_step() == []
    assert peer.store.steps(0) == [3, 2] and peer.store.steps(1) == [2, 1]


def test_a_rank_that_left_the_node_holds_no_other_back(
    memory: NodeMemoryTier, make_peer: Callable[[], Peer], replicators: list[Replicator]
) -> None:
    # Given rank 1 committed here in generation 0 only (its node rank went to another node since:
    # this node now runs rank 0 alone)
    peer = make_peer()
    local = {0, 1}
    replicator = fed_by(
        memory, SECRET, lambda: [peer.server.address], timeout=TIMEOUT, refresh=REFRESH, local_ranks=lambda: local
    )
    replicators.append(replicator)
    for rank, step in ((1, 1), (0, 1)):
        write_slot(memory, rank, step % 2, snapshot(10 * rank + step))
        memory.commit(rank, step, step % 2, len(snapshot(1)), {"step": step}, round=0)
    eventually(lambda: peer.store.steps(1) == [1] and peer.store.steps(0) == [1])
    local.discard(1)
    # When rank 0 trains on in generation 1
    for step in (2, 3, 4):
        write_slot(memory, 0, step % 2, snapshot(step))
        memory.commit(0, step, step % 2, len(snapshot(step)), {"step": step}, round=1)
        assert memory.pass_gates(0, step) < 5
    # Then each of its steps reaches the peer
    eventually(lambda: peer.store.steps(0) == [4, 3])


def test_in_a_new_generation_a_rank_that_has_not_committed_yet_still_holds_the_others_back(
    memory: NodeMemoryTier, make_peer: Callable[[], Peer], replicators: list[Replicator]
) -> None:
    # Given ranks 0 and 1 both at step 9 of generation 0 at the peer
    peer = make_peer()
    holdings = Holdings(peer.store, (0, 1))
    replicator = fed_by(
        memory, SECRET, lambda: [peer.server.address], timeout=TIMEOUT, refresh=REFRESH, local_ranks=lambda: (0, 1)
    )
    replicators.append(replicator)

    def commit_in(round_: int, rank: int, step: int) -> None:
        write_slot(memory, rank, step % 2, snapshot(10 * rank + step))
        memory.commit(rank, step, step % 2, len(snapshot(1)), {"step": step}, round=round_)

    for step in (8, 9):
        for rank in (0, 1):
            commit_in(0, rank, step)
        eventually(lambda step=step: peer.store.steps(0)[:1] == peer.store.steps(1)[:1] == [step])
    # When, after a recovery into generation 1, rank 0 commits steps 10 and 11 before rank 1's
    # first commit of the new generation reaches the agent
    commit_in(1, 0, 10)
    eventually(lambda: peer.store.steps(0)[0] == 10)
    commit_in(1, 0, 11)
    with contextlib.suppress(AssertionError):  # give rank 0's push the time to go (it should not)
        wait_until(lambda: 11 in peer.store.steps(0), timeout=0.5)
    commit_in(1, 1, 10)
    eventually(lambda: peer.store.steps(0)[0] == 11 and peer.store.steps(1)[0] == 10)
    # Then the peer held a step of both ranks at every moment
    assert holdings.without_a_common_step() == []
