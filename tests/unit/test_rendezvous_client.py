"""RendezvousClient over a MemoryBackend, with time driven by a fake clock (nothing sleeps)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from resilrun import keys
from resilrun.errors import ExitCode, RendezvousClosedError, RendezvousTimeoutError
from resilrun.rendezvous import protocol
from resilrun.rendezvous.executor import RendezvousClient
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
