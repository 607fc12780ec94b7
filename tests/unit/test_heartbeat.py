"""Heartbeat staleness is judged on the watcher's own clock, from counters that stop moving."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from resilrun import keys
from resilrun.agent.liveness.heartbeat import Reading, StalenessJudge, lease_ttl_s, read_heartbeats, watched_nodes
from resilrun.agent.supervision.policy import Action, AgentView, decide
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import RdzvState


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_node_whose_counter_keeps_moving_is_never_stale() -> None:
    clock = FakeClock()
    judge = StalenessJudge(5.0, clock)
    for counter in range(20):
        judge.observe("a", counter)
        clock.sleep(1.0)
    assert judge.stale() == []


def test_a_node_whose_counter_stops_is_stale_after_the_timeout_and_not_before() -> None:
    clock = FakeClock()
    judge = StalenessJudge(5.0, clock)
    for _ in range(6):  # observed every second, as the supervisor does every heartbeat interval
        judge.observe("a", 7)
        clock.sleep(1.0)
    assert judge.stale() == ["a"]
    assert judge.age("a") == 6.0
    judge = StalenessJudge(5.0, clock)
    judge.observe("a", 7)
    clock.sleep(5.0)
    assert judge.stale() == []
    clock.sleep(0.5)
    assert judge.stale() == ["a"]


def test_a_counter_that_moves_again_clears_staleness() -> None:
    clock = FakeClock()
    judge = StalenessJudge(2.0, clock)
    judge.observe("a", 1)
    clock.sleep(3.0)
    assert judge.stale() == ["a"]
    judge.observe("a", 2)
    assert judge.stale() == []


def test_the_first_observation_starts_the_clock_whatever_the_counter_value() -> None:
    # A watcher that starts late must not judge a node by how long ago it started counting.
    clock = FakeClock()
    judge = StalenessJudge(2.0, clock)
    judge.observe("a", 1_000_000)
    assert judge.stale() == []


def test_forgetting_nodes_that_left_the_round() -> None:
    clock = FakeClock()
    judge = StalenessJudge(1.0, clock)
    judge.observe("a", 1)
    judge.observe("b", 1)
    judge.forget_all_but(["b"])
    clock.sleep(2.0)
    assert judge.stale() == ["b"]


def test_time_the_watcher_itself_was_blind_is_not_held_against_a_node() -> None:
    # Given a watcher observing every second whose own store reads then stall for 6 s (an etcd election)
    clock = FakeClock()
    judge = StalenessJudge(5.0, clock)
    judge.observe("a", 1)
    clock.sleep(1.0)
    judge.observe("a", 1)
    clock.sleep(6.0)
    # When its first read after the stall still shows the old counter (the sender was stalled too)
    judge.observe("a", 1)
    # Then only 1 s + half the timeout counts: not stale, and a counter that moves soon clears it
    assert judge.stale() == []
    assert judge.age("a") == 1.0 + 2.5
    clock.sleep(1.0)
    judge.observe("a", 2)
    assert judge.stale() == []


def test_a_dead_node_is_still_found_after_the_watcher_was_blind() -> None:
    clock = FakeClock()
    judge = StalenessJudge(4.0, clock)
    judge.observe("a", 1)
    clock.sleep(10.0)  # blind: counts as 2 s
    judge.observe("a", 1)
    for _ in range(3):  # watching again, the counter never moves
        clock.sleep(1.0)
        judge.observe("a", 1)
    assert judge.stale() == ["a"]


@pytest.mark.parametrize(("gap", "counted"), [(0.5, 0.5), (2.5, 2.5), (3.0, 2.5), (30.0, 2.5)])
def test_one_gap_between_observations_counts_at_most_half_the_timeout(gap: float, counted: float) -> None:
    clock = FakeClock()
    judge = StalenessJudge(5.0, clock)
    judge.observe("a", 1)
    clock.sleep(gap)
    judge.observe("a", 1)
    assert judge.age("a") == pytest.approx(counted)


def test_policy_reports_a_lost_node_before_local_worker_exits() -> None:
    state = RdzvState(round=3, complete=True)
    view = AgentView(round=3, exit_codes=(None, 1), state=state, lost_nodes=("b",))
    assert decide(view) is Action.NODE_LOST
    assert decide(AgentView(round=4, exit_codes=(None,), state=RdzvState(round=5), lost_nodes=("b",))) is Action.REJOIN


@pytest.mark.parametrize(
    ("me", "fanout", "watched"),
    [
        ("a", 1, ["b"]),
        ("d", 1, ["a"]),
        ("c", 2, ["d", "a"]),
        ("b", 0, ["a", "c", "d"]),
        ("b", 3, ["a", "c", "d"]),
        ("b", 9, ["a", "c", "d"]),
        ("z", 1, ["a", "b", "c", "d"]),
    ],
)
def test_each_node_watches_its_ring_successors(me: str, fanout: int, watched: list[str]) -> None:
    assert watched_nodes(["a", "b", "c", "d"], me, fanout) == watched


def test_every_node_is_watched_by_fanout_others_on_the_ring() -> None:
    nodes = [f"n{i}" for i in range(7)]
    watchers = {n: [w for w in nodes if n in watched_nodes(nodes, w, 2)] for n in nodes}
    assert all(len(found) == 2 for found in watchers.values())


def test_nodes_that_died_together_are_judged_lost_together() -> None:
    # Given two nodes killed in the same instant whose last heartbeats were seen 0.9 s apart
    clock = FakeClock()
    judge = StalenessJudge(3.0, clock)
    judge.observe("a", 1)
    judge.observe("b", 1)
    judge.observe("live", 1)
    clock.sleep(0.9)
    judge.observe("b", 2)
    for counter in range(2, 6):
        clock.sleep(0.6)
        judge.observe("live", counter)
    # When "a" is stale and "b" has been silent for over half the timeout
    assert judge.stale() == ["a"] and judge.age("b") == pytest.approx(2.4)
    # Then the verdict waits for "b", and names both once "b" is stale too
    assert judge.lost() == []
    clock.sleep(0.7)
    judge.observe("live", 6)
    assert judge.lost() == ["a", "b"]


def test_a_single_loss_is_not_delayed_by_live_nodes() -> None:
    clock = FakeClock()
    judge = StalenessJudge(3.0, clock)
    judge.observe("a", 1)
    for counter in range(1, 5):
        judge.observe("b", counter)
        clock.sleep(1.0)
    assert judge.lost() == ["a"]


def test_a_slow_node_that_moves_again_releases_the_verdict_on_the_lost_one() -> None:
    clock = FakeClock()
    judge = StalenessJudge(3.0, clock)
    judge.observe("a", 1)
    clock.sleep(1.0)
    judge.observe("slow", 1)
    clock.sleep(2.1)
    assert judge.stale() == ["a"] and judge.lost() == []
    judge.observe("slow", 2)
    assert judge.lost() == ["a"]


# -- liveness leases (stores with leases: etcd) ------------------------------------------------------
def test_a_node_whose_lease_expired_is_pending_at_once_and_stale_one_interval_later() -> None:
    # Given a 5 s timeout, 1 s interval: the lease's TTL is 4 s
    assert lease_ttl_s(1.0, 5.0) == 4 and lease_ttl_s(0.5, 1.0) == 1
    clock = FakeClock()
    judge = StalenessJudge(5.0, clock)
    judge.observe("a", 1)
    # When its key is gone (silent for the TTL at least)
    clock.sleep(2.0)
    judge.observe_silence("a", 4.0)
    # Then it is silent past half the timeout, not yet stale; stale once the timeout is reached
    assert judge.age("a") == pytest.approx(4.0) and judge.stale() == []
    clock.sleep(1.1)
    judge.observe_silence("a", 5.1)
    assert judge.stale() == ["a"]


def test_nodes_whose_leases_expired_together_are_judged_together() -> None:
    # Given two nodes killed at once, their last renewals 0.9 s apart (so their keys go 0.9 s apart)
    clock = FakeClock()
    judge = StalenessJudge(5.0, clock)
    judge.observe_silence("a", 4.0)
    judge.observe("b", 7)
    clock.sleep(0.9)
    judge.observe_silence("a", 4.9)
    judge.observe_silence("b", 4.0)
    clock.sleep(0.2)
    # When "a" is stale and "b" only pending, the verdict waits; then names both
    assert judge.stale() == ["a"] and judge.lost() == []
    clock.sleep(0.9)
    assert judge.lost() == ["a", "b"]


def test_a_revived_node_stays_revived_while_its_old_expiry_is_read_again() -> None:
    clock = FakeClock()
    judge = StalenessJudge(5.0, clock)
    judge.observe_silence("a", 6.0)
    assert judge.stale() == ["a"]
    judge.revive("a")  # it proved the job secret: someone deleted its key
    clock.sleep(1.0)
    judge.observe_silence("a", 7.0)  # the same expiry, read again
    assert judge.stale() == [] and judge.age("a") == pytest.approx(1.0)


class LeasingStore(MemoryBackend):
    """A store with leases whose presence watches the test sets by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.presence: dict[str, FakePresence] = {}
        self.reads = 0

    def leases(self) -> bool:
        return True

    def watch_presence(self, key: str) -> FakePresence:
        return self.presence.setdefault(key, FakePresence())

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self.reads += 1
        return super().get_many(keys)


class FakePresence:
    def __init__(self) -> None:
        self.current: tuple[bytes | None, float] | None = None
        self.last_present: bytes | None = None

    def seen(self) -> tuple[bytes | None, float] | None:
        return self.current

    def close(self) -> None:
        self.current = None


def test_readings_on_a_store_with_leases_come_from_watches_and_from_one_read_while_a_watch_is_not_current() -> None:
    store = LeasingStore()
    clock = FakeClock()  # the watches' times and the reader's are on one monotonic clock
    now = clock.monotonic()
    alive, gone, never, unknown = (store.watch_presence(keys.node_alive("job", n)) for n in ("a", "g", "n", "u"))
    alive.current, alive.last_present = (b"4", now), b"4"
    gone.current, gone.last_present = (None, now - 1.0), b"4"
    never.current = (None, now)
    store.set(keys.node_alive("job", "u"), b"4")  # its watch is not current: read, and found
    readings = read_heartbeats(store, "job", ["a", "g", "n", "u"], clock=clock)
    assert readings["a"].silent_s is None and readings["u"].silent_s is None
    assert readings["g"].silent_s == pytest.approx(5.0, abs=0.2)  # the TTL, and a second since
    assert readings["n"] == Reading(-1)  # never seen alive: a counter standing still
    assert store.reads == 1
    clock.sleep(1.0)
    later = read_heartbeats(store, "job", ["a"], clock=clock)
    assert later["a"].counter != readings["a"].counter  # present: a counter that moves at every look
    # A store without leases: counters, as ever
    plain = MemoryBackend()
    plain.add(keys.node_heartbeat("job", "a"), 3)
    assert read_heartbeats(plain, "job", ["a"]) == {"a": Reading(3)}


def test_a_look_at_what_was_pushed_asks_the_store_nothing() -> None:
    """Taken at every monitor tick between the heartbeat checks: it must stay free."""
    store = LeasingStore()
    now = time.monotonic()
    gone, broken = (store.watch_presence(keys.node_alive("job", n)) for n in ("g", "b"))
    gone.current, gone.last_present = (None, now - 1.0), b"4"
    store.set(keys.node_alive("job", "b"), b"4")  # its watch is not current
    readings = read_heartbeats(store, "job", ["g", "b"], pushed_only=True)
    assert list(readings) == ["g"] and readings["g"].silent_s == pytest.approx(5.0, abs=0.2)
    assert store.reads == 0  # the node whose watch broke is left to the next full check
    # A store without leases pushes nothing: nothing is read either
    plain = MemoryBackend()
    plain.add(keys.node_heartbeat("job", "a"), 3)
    assert read_heartbeats(plain, "job", ["a"], pushed_only=True) == {}


def test_an_expired_node_read_as_absent_once_its_watch_broke_keeps_the_silence_counted_so_far() -> None:
    clock = FakeClock()
    judge = StalenessJudge(5.0, clock)
    judge.observe_reading("a", Reading(-1, 4.0))  # its key expired: silent 4 s
    clock.sleep(0.5)
    judge.observe_reading("a", Reading(-1))  # the watch broke: the key is read, and absent
    clock.sleep(0.6)
    assert judge.stale() == ["a"]  # 5.1 s of silence, not 0.6
