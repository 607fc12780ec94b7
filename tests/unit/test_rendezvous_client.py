"""RendezvousClient over a MemoryBackend, with time driven by a fake clock (nothing sleeps)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import pytest

from resilrun import keys
from resilrun.errors import ExitCode, RendezvousClosedError, RendezvousTimeoutError
from resilrun.rendezvous import protocol
from resilrun.rendezvous.api import RendezvousBackend
from resilrun.rendezvous.executor import Joining, RendezvousClient
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import NodeInfo, RdzvState

RUN = "job-1"


class FakeClock:
    """Monotonic time that only moves when someone sleeps; safe to share between threads."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()
        self.sleeps = 0

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
            self.sleeps += 1


def node(name: str, rank: int | None = None) -> NodeInfo:
    return NodeInfo(node_id=name, addr=f"{name}.local", local_world_size=1, requested_rank=rank, hostname=name)


def client(
    backend: MemoryBackend,
    me: NodeInfo,
    clock: FakeClock,
    *,
    lo: int,
    hi: int,
    join_s: float = 600.0,
    last_call_s: float = 30.0,
) -> RendezvousClient:
    return RendezvousClient(
        backend,
        RUN,
        me,
        min_nodes=lo,
        max_nodes=hi,
        join_timeout=timedelta(seconds=join_s),
        last_call_timeout=timedelta(seconds=last_call_s),
        clock=clock,
    )


def write_state(backend: MemoryBackend, state: RdzvState) -> None:
    backend.set(keys.rdzv_state(RUN), state.to_bytes())


def test_a_single_node_job_joins_without_waiting() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    state = client(backend, node("a"), clock, lo=1, hi=1).join()
    assert state.complete
    assert [p.node_id for p in state.participants] == ["a"]
    assert clock.sleeps == 0


def test_two_nodes_joining_concurrently_form_one_complete_round() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    results: dict[str, RdzvState] = {}
    errors: list[BaseException] = []

    def run(me: NodeInfo) -> None:
        try:
            # A day of fake time: the spinning thread cannot time out before the other one runs.
            results[me.node_id] = client(backend, me, clock, lo=2, hi=2, join_s=86400).join()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(node(name),)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert results["a"] == results["b"]
    state = results["a"]
    assert state.complete and state.round == 0
    assert sorted(p.node_id for p in state.participants) == ["a", "b"]
    assert {state.node_rank("a"), state.node_rank("b")} == {0, 1}


def test_two_nodes_get_the_node_ranks_they_asked_for() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    first = client(backend, node("a", rank=1), clock, lo=2, hi=2)
    second = client(backend, node("b", rank=0), clock, lo=2, hi=2)
    waits = []
    # a joins first and waits; on its first poll b joins and completes the round.
    state = first.join(on_wait=lambda: waits.append(second.join()) if not waits else None)
    assert [p.node_id for p in state.participants] == ["b", "a"]
    assert waits == [state]


def test_join_timeout_raises_and_removes_the_node_from_the_round() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    start = clock.monotonic()
    with pytest.raises(RendezvousTimeoutError) as info:
        client(backend, node("a"), clock, lo=2, hi=2, join_s=10).join()
    assert "only 1 of 2 required nodes joined round 0 within 10 s" in info.value.message
    assert info.value.hint
    assert info.value.exit_code == ExitCode.RENDEZVOUS
    assert clock.monotonic() - start >= 10
    state = RdzvState.from_bytes(backend.get(keys.rdzv_state(RUN)))
    assert state.participants == ()
    assert not state.complete


def test_last_call_completes_a_round_with_min_nodes_after_the_last_call_timeout() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    seen: list[tuple[float, bool]] = []
    rdzv = client(backend, node("a"), clock, lo=1, hi=2, last_call_s=30)

    def on_wait() -> None:
        seen.append((clock.monotonic(), rdzv.state().complete))

    start = clock.monotonic()
    state = rdzv.join(on_wait=on_wait)
    assert state.complete
    assert [p.node_id for p in state.participants] == ["a"]
    waited = clock.monotonic() - start
    assert 30 <= waited < 31
    assert seen and not any(complete for _, complete in seen)


def test_last_call_lets_a_late_node_in_before_the_round_completes() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    late = client(backend, node("b"), clock, lo=1, hi=3, last_call_s=30)
    joined: list[bool] = []

    def on_wait() -> None:
        if clock.monotonic() >= 1010 and not joined:
            # b arrives 10 s into a's last call: it is appended, the round stays open
            state = late.state()
            assert not state.complete
            decision = protocol.decide_join(state, late.me, min_nodes=1, max_nodes=3, last_call_elapsed=False)
            assert decision.state is not None
            backend.set(keys.rdzv_state(RUN), decision.state.to_bytes())
            joined.append(True)

    state = client(backend, node("a"), clock, lo=1, hi=3, last_call_s=30).join(on_wait=on_wait)
    assert [p.node_id for p in state.participants] == ["a", "b"]


def test_join_on_a_closed_job_raises_closed_with_its_outcome() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    write_state(backend, RdzvState(round=3, closed=True, outcome="failed"))
    with pytest.raises(RendezvousClosedError) as info:
        client(backend, node("a"), clock, lo=1, hi=2).join()
    assert info.value.outcome == "failed"
    assert "(failed)" in info.value.message
    assert info.value.exit_code == ExitCode.RENDEZVOUS


def test_join_raises_closed_when_the_job_closes_while_waiting() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    rdzv = client(backend, node("a"), clock, lo=2, hi=2)
    other = client(backend, node("b"), clock, lo=2, hi=2)
    with pytest.raises(RendezvousClosedError) as info:
        rdzv.join(on_wait=lambda: other.close("stopped"))
    assert info.value.outcome == "stopped"


def test_on_wait_exceptions_propagate_out_of_join() -> None:
    backend, clock = MemoryBackend(), FakeClock()

    class Stop(Exception):
        pass

    def on_wait() -> None:
        raise Stop

    with pytest.raises(Stop):
        client(backend, node("a"), clock, lo=2, hi=2).join(on_wait=on_wait)


def test_a_node_arriving_at_a_complete_round_with_room_asks_to_join() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    write_state(backend, RdzvState(complete=True, participants=(node("a"),)))
    late = client(backend, node("b"), clock, lo=1, hi=2, join_s=1)
    seen: list[tuple[str, ...]] = []
    with pytest.raises(RendezvousTimeoutError):
        late.join(on_wait=lambda: seen.append(late.state().waiting))
    assert ("b",) in seen


def test_a_node_whose_join_times_out_while_waiting_leaves_the_waiting_list() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    write_state(backend, RdzvState(complete=True, participants=(node("a"),)))
    late = client(backend, node("b"), clock, lo=1, hi=2, join_s=1)
    with pytest.raises(RendezvousTimeoutError):
        late.join()
    assert late.state().waiting == ()


def test_next_round_after_a_failure_counts_a_restart_and_close_ends_the_job() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    rdzv = client(backend, node("a"), clock, lo=1, hi=1)
    first = rdzv.join()
    after = rdzv.next_round(first.round, failure={"message": "boom"}, max_restarts=1)
    assert (after.round, after.restarts, after.complete) == (1, 1, False)
    again = rdzv.join()
    assert again.round == 1 and again.complete
    closed = rdzv.next_round(again.round, failure={"message": "boom"}, max_restarts=1)
    assert closed.closed and closed.outcome == "failed"
    assert rdzv.close("succeeded") == closed  # the first close wins


def test_next_round_with_a_stale_round_returns_the_current_state_unchanged() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    write_state(backend, RdzvState(round=5, complete=True, participants=(node("a"),)))
    rdzv = client(backend, node("a"), clock, lo=1, hi=1)
    assert rdzv.next_round(4, failure=None, max_restarts=3) == rdzv.state()


def test_closed_acks_count_each_node_that_saw_the_close() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    rdzv = client(backend, node("a"), clock, lo=1, hi=1)
    assert rdzv.closed_acks() == 0
    assert rdzv.ack_closed() == 1
    assert rdzv.ack_closed() == 2
    assert rdzv.closed_acks() == 2


# -- version-gated reads (the scale mode) ----------------------------------------------------------
def test_a_gated_reader_rereads_the_document_only_when_the_version_moves() -> None:
    backend, clock = MemoryBackend(), FakeClock()
    writer = client(backend, node("a"), clock, lo=1, hi=1)
    writer.refresh_s = 60.0
    reader = client(backend, node("b"), clock, lo=1, hi=1)
    reader.refresh_s = 60.0
    writer.join()
    first = reader.state()
    gets = []
    original = backend.get
    backend.get = lambda key: gets.append(key) or original(key)  # type: ignore[method-assign]  # counting spy
    assert reader.state() == first and gets == []  # unchanged: only the version counter was read
    writer.close("succeeded")
    assert reader.state().closed and gets == [keys.rdzv_state(RUN)]


def test_a_gated_reader_refreshes_after_refresh_s_even_without_a_bump() -> None:
    # A writer that died between its compare-and-set and its bump is covered by the periodic refresh.
    backend, clock = MemoryBackend(), FakeClock()
    reader = client(backend, node("b"), clock, lo=1, hi=1)
    reader.refresh_s = 5.0
    assert reader.state().round == 0
    write_state(backend, RdzvState(round=7))
    assert reader.state().round == 0
    clock.sleep(5.0)
    assert reader.state().round == 7


# -- the arrivals lane (issue 20) -------------------------------------------------------------------
class CountingWrites(MemoryBackend):
    """Counts compare-and-sets of the state document: what N racing joiners multiply."""

    def __init__(self) -> None:
        super().__init__()
        self.state_writes = 0

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        if key == keys.rdzv_state(RUN):
            self.state_writes += 1
        return super().compare_set(key, expected, desired)


def test_arrivals_are_admitted_in_one_write_by_the_first_pending_node_or_after_its_grace() -> None:
    """Fifteen nodes took their places in the lane and their first one died before admitting:
    the sixteenth waits one grace period, then admits all sixteen in one write, completing the round."""
    backend, clock = CountingWrites(), FakeClock()
    others = [client(backend, node(f"n{i:02d}"), clock, lo=16, hi=16) for i in range(15)]
    for other in others:
        other._arrive()
    start = clock.monotonic()
    state = client(backend, node("last"), clock, lo=16, hi=16).join()
    assert state.complete and len(state.participants) == 16
    assert sorted(p.node_id for p in state.participants) == sorted([o.me.node_id for o in others] + ["last"])
    assert backend.state_writes == 1
    assert 1.0 <= clock.monotonic() - start < 1.2  # the grace, not the join timeout
    assert all(o.join() == state for o in others)  # each reads its place; nobody writes again
    assert backend.state_writes == 1


def test_an_index_whose_node_never_wrote_it_is_passed_over_and_a_late_writer_still_joins() -> None:
    backend, clock = CountingWrites(), FakeClock()
    backend.add(keys.rdzv_arrivals(RUN), 1)  # a node took index 1 and died before writing it
    a, b = client(backend, node("a"), clock, lo=2, hi=2), client(backend, node("b"), clock, lo=2, hi=2)
    waits: list[RdzvState] = []
    # a (index 2) waits for index 1's admitter, then admits itself; b arrives while a waits
    state = a.join(on_wait=lambda: waits.append(b.join()) if not waits else None)
    assert state.complete and sorted(p.node_id for p in state.participants) == ["a", "b"]
    assert waits == [state]


def test_a_lane_node_left_out_by_the_admitter_writes_itself_in() -> None:
    """The admitter only makes moves that need no observation of time: a spare waiting out its
    grace in a newly opened round is passed over, and joins by itself once its grace elapsed."""
    backend, clock = MemoryBackend(), FakeClock()
    spare = node("s")
    write_state(backend, RdzvState(round=1, spares=(spare,)))
    state = client(backend, spare, clock, lo=1, hi=1).join()
    assert state.complete and [p.node_id for p in state.participants] == ["s"]
    assert int(backend.get(keys.rdzv_admitted(RUN)) or 0) >= 1


def test_admit_applies_each_arrival_as_it_would_join_itself() -> None:
    a, b, c = node("a"), node("b"), node("c", rank=0)
    joined = protocol.admit(RdzvState(), [a, b, c], min_nodes=2, max_nodes=3)
    assert joined is not None and joined.complete and [p.node_id for p in joined.participants] == ["c", "a", "b"]
    assert protocol.admit(joined, [a, b], min_nodes=2, max_nodes=3) is None  # already in: nothing to write
    full = protocol.admit(joined, [node("d")], min_nodes=2, max_nodes=3)
    assert full is not None and [n.node_id for n in full.spares] == ["d"]  # a full round: a spare node
    clash = protocol.admit(RdzvState(), [node("x", rank=0), node("y", rank=0)], min_nodes=2, max_nodes=2)
    assert clash is not None and [p.node_id for p in clash.participants] == ["x"]  # y hears it itself


class CountingReads(RendezvousBackend):
    """One node's connection to a shared store, counting that node's reads of the state document."""

    def __init__(self, shared: MemoryBackend) -> None:
        self.shared = shared
        self.state_reads = 0

    def get(self, key: str) -> bytes | None:
        if key == keys.rdzv_state(RUN):
            self.state_reads += 1
        return self.shared.get(key)

    def set(self, key: str, value: bytes) -> None:
        self.shared.set(key, value)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        return self.shared.compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self.shared.add(key, amount)


def test_a_participant_waiting_in_an_open_round_rereads_the_document_only_when_its_phase_moves() -> None:
    """Each arrival admitted rewrites the document; a thousand waiting nodes re-reading it each
    time would be O(N^2) bytes. They look again only when the round's phase moves (complete here)."""
    shared, clock = MemoryBackend(), FakeClock()
    seen_by_a = CountingReads(shared)

    def gated(name: str, backend: RendezvousBackend) -> RendezvousClient:
        return RendezvousClient(
            backend, RUN, node(name), min_nodes=3, max_nodes=3, join_timeout=timedelta(seconds=600),
            last_call_timeout=timedelta(seconds=30), clock=clock, refresh_s=100.0,
        )  # fmt: skip

    b, c = Joining(gated("b", shared)), Joining(gated("c", shared))
    reads: list[int] = []

    def on_wait() -> None:
        reads.append(seen_by_a.state_reads)
        if len(reads) == 3:
            while b.step() is None and not b.waits:
                pass  # b arrives and admits itself: the document moves, its phase does not
        if len(reads) == 8:
            while c.step() is None and not c.waits:
                pass  # c completes the round: the phase moves

    state = gated("a", seen_by_a).join(on_wait=on_wait)
    assert state.complete and sorted(p.node_id for p in state.participants) == ["a", "b", "c"]
    assert reads[2] == reads[7]  # b's admission rewrote the document: a did not read it again
    assert seen_by_a.state_reads == reads[7] + 1  # the completion: read once
    assert b.step() is not None and c.step() is not None


class PushedKey:
    """A watch the test drives: ``current`` False is a broken stream, ``lag`` keeps pushing what
    the key held when it was set (the store's event still on its way)."""

    def __init__(self, read: Callable[[], bytes | None]) -> None:
        self.read, self.current = read, True
        self.lagging: tuple[bytes | None] | None = None

    def lag(self) -> None:
        self.lagging = (self.read(),)

    def seen(self) -> tuple[bytes | None, float] | None:
        if not self.current:
            return None
        return (self.lagging[0] if self.lagging is not None else self.read()), 0.0

    def close(self) -> None:
        self.current = False


class CountingStore(MemoryBackend):
    """A store that cannot push (as the c10d store), counting the reads asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.counter_reads = 0
        self.reads = 0

    def add(self, key: str, amount: int) -> int:
        if amount == 0:
            self.counter_reads += 1
        return super().add(key, amount)

    def get(self, key: str) -> bytes | None:
        self.reads += 1
        return super().get(key)


class PushingStore(CountingStore):
    """A store that can push keys (as etcd's watch does), counting the reads asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.watches: list[PushedKey] = []
        self.watched: list[str] = []  # the key of each watch, in order

    def watch_key(self, key: str) -> PushedKey:
        watch = PushedKey(lambda: MemoryBackend.get(self, key))  # pushed: not a read asked of the store
        self.watches.append(watch)
        self.watched.append(key)
        return watch

    def watch_counter(self, key: str) -> PushedKey:
        return self.watch_key(key)  # the memory store keeps counters as their digits, unsealed


def _gated(store: MemoryBackend, name: str, clock: FakeClock | None = None) -> RendezvousClient:
    return RendezvousClient(
        store, RUN, node(name), min_nodes=1, max_nodes=2, join_timeout=timedelta(seconds=5),
        last_call_timeout=timedelta(seconds=1), clock=clock or FakeClock(), refresh_s=100.0,
    )  # fmt: skip


def test_a_gated_reader_checks_a_pushed_document_without_asking_the_store_and_polls_when_the_push_breaks() -> None:
    store = PushingStore()
    writer, reader = _gated(store, "a"), _gated(store, "b")
    first = reader.state()
    store.counter_reads = store.reads = 0
    # Given a store that pushes the document: checking it a thousand times asks nothing
    for _ in range(1000):
        assert reader.state() == first
    assert store.counter_reads == 0 and store.reads == 0 and len(store.watches) == 1
    # and a write is seen at the next check, still without a read
    writer.next_round(first.round, failure=None, max_restarts=0)
    store.counter_reads = store.reads = 0
    moved = reader.state()
    assert moved.round == first.round + 1
    assert store.counter_reads == 0 and store.reads == 0
    # When the push breaks, the reader asks the store instead, and still sees what moves
    store.watches[0].current = False
    writer.close("stopped")
    assert reader.state().closed and store.counter_reads == 1


def test_a_pushed_document_needs_no_version_bump_nor_refresh() -> None:
    """The safety net's case: a writer that died between its write and its version bump."""
    store = PushingStore()
    writer, reader = _gated(store, "a"), _gated(store, "b")
    first = reader.state()
    # Given a new document written with no version bump after it
    state, raw = writer.read()
    moved = replace(state, round=state.round + 1, seq=state.seq + 1)
    assert store.compare_set(keys.rdzv_state(RUN), raw, moved.to_bytes())
    # Then the reader sees it at once, the refresh interval far off
    assert reader.state().round == first.round + 1


def test_a_push_lagging_behind_the_readers_own_write_is_not_taken_for_a_replay() -> None:
    store = PushingStore()
    reader = _gated(store, "a")
    first = reader.state()
    # Given a push that still carries the document from before this node's own write
    store.watches[0].lag()
    written = reader.next_round(first.round, failure=None, max_restarts=0)
    # Then the reader sees its own write (asking the store), refuses nothing and writes nothing back
    doc = store.get(keys.rdzv_state(RUN))
    assert reader.state() == written and reader.replayed == 0
    assert store.get(keys.rdzv_state(RUN)) == doc
    # and once the push catches up it is served from the push again, without a read
    store.watches[0].lagging = None
    store.reads = 0
    assert reader.state() == written and store.reads == 0


def test_a_join_watches_no_document_and_the_first_read_after_it_does() -> None:
    """N nodes forming a round would open N streams of the O(N) document (pushed at every
    admission) while the store is busiest; the few bytes a joining node waits on are watched
    only while it waits."""
    store = PushingStore()
    joining = RendezvousClient(
        store, RUN, node("a"), min_nodes=1, max_nodes=1, join_timeout=timedelta(seconds=5),
        last_call_timeout=timedelta(seconds=1), clock=FakeClock(), refresh_s=100.0,
    )  # fmt: skip
    assert joining.join().complete
    assert keys.rdzv_state(RUN) not in store.watched and not joining.document_watched
    assert all(not watch.current for watch in store.watches)  # what the join followed, let go
    joining.state()
    assert store.watched[-1] == keys.rdzv_state(RUN) and joining.document_watched


@pytest.mark.parametrize("pushing", [True, False])
def test_nodes_waiting_to_be_admitted_and_for_the_round_follow_pushed_counters_not_the_store(pushing: bool) -> None:
    # Given a store that pushes keys (etcd) or one that does not (the c10d store), and a round of 3
    store = PushingStore() if pushing else CountingStore()
    clock = FakeClock()

    def joining(name: str) -> Joining:
        return Joining(
            RendezvousClient(
                store, RUN, node(name), min_nodes=3, max_nodes=3, join_timeout=timedelta(seconds=60),
                last_call_timeout=timedelta(seconds=1), clock=clock, refresh_s=100.0,
            )
        )  # fmt: skip

    def polls(*waiting: Joining) -> int:
        """Reads asked of the store by 50 polls of each waiting node, after its first."""
        for attempt in waiting:
            assert attempt.step() is None and attempt.waits
        before = _reads(store)
        for _ in range(50):
            for attempt in waiting:
                assert attempt.step() is None and attempt.waits
            clock.sleep(0.005)  # within the lane's grace: b waits for a to admit it
        return _reads(store) - before

    a, b = joining("a"), joining("b")
    assert a.step() is None and b.step() is None  # both took their places in the arrivals lane
    # When b waits in the lane for a to admit it
    in_lane = polls(b)
    # and then both wait in the open round for a third node
    assert a.step() is None  # a admits both
    in_round = polls(a, b)
    # Then on a pushing store the waits asked the store nothing; on the other, a read per poll
    if pushing:
        assert (in_lane, in_round) == (0, 0)
    else:
        assert (in_lane, in_round) == (50, 100)
    # and the third node completes the round for all, each letting go of what it followed
    c = joining("c")
    states = [None, None, None]
    for _ in range(20):
        states = [s if s is not None else j.step() for s, j in zip(states, (a, b, c), strict=True)]
        clock.sleep(0.05)
    assert all(state is not None and state.complete for state in states), states
    for attempt in (a, b, c):
        attempt.close()
    assert all(not watch.current for watch in getattr(store, "watches", []))


def _reads(store: PushingStore | CountingStore) -> int:
    return store.reads + store.counter_reads


def test_arrivals_of_an_earlier_round_are_not_admitted_again_when_the_hint_is_gone() -> None:
    """Issue 43, F4: anyone at the store can delete the ``admitted`` hint (or, sealed, make it read
    as absent); the next admitter must not read the lane from its start again and put a node that
    arrived for an earlier round (and died since) into the new one."""
    backend, clock = MemoryBackend(), FakeClock()
    a, b = (client(backend, node(name), clock, lo=1, hi=2, last_call_s=5) for name in "ab")
    first = a.join(on_wait=lambda: b.join())
    assert first.complete and sorted(p.node_id for p in first.participants) == ["a", "b"]
    # b dies; a opens the next round; the hint is wiped
    a.next_round(first.round, failure={"node": "b"}, max_restarts=3)
    backend.set(keys.rdzv_admitted(RUN), b"0")
    state = a.join()
    assert state.complete and [p.node_id for p in state.participants] == ["a"]


@pytest.mark.timeout(30)
def test_one_unauthenticated_bump_of_the_arrivals_counter_does_not_stall_any_join() -> None:
    """Issue 43, F5: after ``add(arrivals, 10**12)`` every joiner's index lies far past the hint;
    one admit pass reads at most a batch, so the lane could never reach them. A gap no real
    arrival could make sends the joiner straight to the document, which decides as before."""
    backend, clock = MemoryBackend(), FakeClock()
    backend.add(keys.rdzv_arrivals(RUN), 10**12)
    a, b = (client(backend, node(name), clock, lo=2, hi=2, last_call_s=5) for name in "ab")
    start = clock.monotonic()
    joined: list[RdzvState] = []
    state = a.join(on_wait=lambda: joined.append(b.join()) if not joined else None)
    assert state.complete and sorted(p.node_id for p in state.participants) == ["a", "b"]
    assert joined == [state]
    assert clock.monotonic() - start <= 5 + 1  # within last_call_timeout + 1 s
