"""Heartbeat staleness is judged on the watcher's own clock, from counters that stop moving."""

from __future__ import annotations

import pytest

from resilrun.agent.heartbeat import StalenessJudge, watched_nodes
from resilrun.agent.policy import Action, AgentView, decide
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
