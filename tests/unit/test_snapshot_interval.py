"""``--snapshot-every auto``: the interval chosen from measured periods, agreed by every rank.

Periods come from a fake clock the tests advance the way a training loop spends time: a quiet
step costs its period, a snapshot step adds the blocking copy, and the steps after it carry the
background work (checksums, replication) that shares the machine with training.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from resilrun.worker._interval import (
    AUTO,
    MAX_INTERVAL,
    PROBE_INTERVAL,
    REFRESH_WINDOWS,
    Decision,
    Schedule,
    choose,
)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _cost(stall: float, after: tuple[float, ...] = ()) -> Callable[[int], float]:
    """Seconds a snapshot adds to the step ``position`` steps after it (0: the snapshot step)."""
    return lambda position: stall if position == 0 else after[position - 1] if position <= len(after) else 0.0


def _train(
    schedule: Schedule,
    clock: _Clock,
    steps: range,
    *,
    quiet: Callable[[int], float] = lambda step: 1.0,
    cost: Callable[[int], float] | None = None,
) -> tuple[list[int], list[Decision]]:
    """Run ``steps`` through ``schedule``; the steps snapshotted and the decisions taken. The
    default cost: 0.2 s of copy, 0.1 s of background work on the step after."""
    cost = cost or _cost(0.2, (0.1,))
    saved: list[int] = []
    decisions: list[Decision] = []
    last = steps.start - 1
    for step in steps:
        due = schedule.due(step)
        clock.now += quiet(step) + cost(0 if due else step - last)
        if due:
            saved.append(step)
            last = step
        decision = schedule.finished(step, due)
        if decision is not None:
            decisions.append(decision)
    return saved, decisions


def test_the_interval_keeps_the_measured_cost_under_the_budget() -> None:
    clock = _Clock()
    schedule = Schedule(AUTO, budget=0.03, clock=clock)
    saved, decisions = _train(schedule, clock, range(400))
    # a snapshot costs 0.2 s of copy + 0.1 s of background work on the next step, 1 s quiet steps:
    # 0.3 / (k * 1.0) <= 3% -> every 10 steps
    assert saved[:4] == [5, 11, 17, 23]  # the probe interval first: quiet steps to measure against
    assert decisions[0].quiet_s == pytest.approx(1.0)
    assert decisions[0].cost_s == pytest.approx(0.3)
    assert [d.interval for d in decisions] == [10] * len(decisions)
    assert decisions[-1].overhead == pytest.approx(0.03)
    gaps = {b - a for a, b in zip(saved, saved[1:], strict=False) if a > 40}
    assert gaps == {10}


def test_a_cheap_snapshot_is_taken_every_step_and_the_quiet_period_is_measured_again() -> None:
    clock = _Clock()
    schedule = Schedule(AUTO, budget=0.03, clock=clock)
    saved, decisions = _train(schedule, clock, range(600), cost=_cost(0.001))
    intervals = [d.interval for d in decisions]
    assert intervals[0] == 1
    # interval 1 has no quiet steps: every REFRESH_WINDOWS windows one probes again
    assert PROBE_INTERVAL in intervals[1 : REFRESH_WINDOWS + 2]
    assert intervals[-1] == 1  # the fake clock makes the run end between two probes, at step 599
    assert all(d.quiet_s == pytest.approx(1.0) for d in decisions)


def test_a_step_time_that_drops_later_is_noticed_by_the_refresh() -> None:
    clock = _Clock()
    schedule = Schedule(AUTO, budget=0.03, clock=clock)
    # 0.01 s of cost: every step at 1 s steps; at 0.1 s steps 0.01 / (k * 0.1) <= 3% needs k >= 4
    quiet = lambda step: 1.0 if step < 200 else 0.1  # noqa: E731
    _, decisions = _train(schedule, clock, range(1200), quiet=quiet, cost=_cost(0.01))
    assert decisions[0].interval == 1
    assert decisions[-1].interval >= 4
    assert decisions[-1].quiet_s == pytest.approx(0.1)


def test_an_expensive_snapshot_is_capped() -> None:
    clock = _Clock()
    schedule = Schedule(AUTO, budget=0.001, clock=clock)
    _, decisions = _train(schedule, clock, range(60), cost=_cost(50.0))
    assert decisions[0].interval == MAX_INTERVAL


def test_the_slowest_rank_decides_and_every_rank_decides_the_same() -> None:
    """Two ranks in threads, the gather a real rendezvous of both rows: rank 1's snapshots cost
    twice rank 0's (a slower disk, a busier node); both pick rank 1's interval, step for step."""
    barrier = threading.Barrier(2)
    rows: dict[int, list[int]] = {}

    def gather(rank: int) -> Callable[[list[int]], list[list[int]]]:
        def all_gather(row: list[int]) -> list[list[int]]:
            rows[rank] = row
            barrier.wait()
            gathered = [rows[0], rows[1]]
            barrier.wait()
            return gathered

        return all_gather

    results: dict[int, tuple[list[int], list[Decision]]] = {}

    def rank(r: int) -> None:
        clock = _Clock()
        schedule = Schedule(AUTO, budget=0.03, gather=gather(r), clock=clock)
        results[r] = _train(schedule, clock, range(300), cost=_cost(0.3 * (r + 1)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results[0] == results[1]
    assert results[1][1][0].interval == 20  # 0.6 s per snapshot at 3% of 1 s steps


def test_choose_is_a_pure_function_of_the_gathered_rows() -> None:
    # rows: total period us, steps, quiet median us, snapshots, blocked us
    rows = [[26_000_000, 24, 1_000_000, 4, 0], [25_000_000, 24, 1_000_000, 4, 0]]
    decision = choose(rows, 0.03, 6, None)
    assert decision == choose(list(rows), 0.03, 6, None)
    assert (decision.interval, decision.cost_s) == (17, pytest.approx(0.5))  # the worse rank: 2 s over 4 snapshots
    smoothed = choose([[24_400_000, 24, 1_000_000, 4, 0]], 0.03, 17, decision)
    assert smoothed.cost_s == pytest.approx(0.3)  # half the new 0.1 s, half the old 0.5 s
    assert choose([[24_000_000, 24, -1, 24, 0]], 0.03, 1, None).interval == PROBE_INTERVAL  # nothing quiet yet


def test_a_snapshot_costs_at_least_what_it_blocked_when_noise_hides_the_rest() -> None:
    # a window whose periods happen to add nothing above the quiet median (noisy steps), while each
    # of its 4 snapshots blocked training for 0.1 s inside the commit
    decision = choose([[23_000_000, 24, 1_000_000, 4, 400_000]], 0.03, 6, None)
    assert decision.cost_s == pytest.approx(0.1) and decision.interval == 4


def test_a_restore_starts_the_schedule_after_the_restored_step() -> None:
    clock = _Clock()
    schedule = Schedule(AUTO, budget=0.03, clock=clock)
    schedule.start(41)
    saved, _ = _train(schedule, clock, range(42, 60))
    assert saved == [47, 53, 59]
    assert schedule.at_risk(62) == 3  # steps 60-62 finished since the newest snapshot


def test_a_fixed_interval_never_gathers() -> None:
    def refuse(row: list[int]) -> list[list[int]]:
        raise AssertionError("a fixed interval needs no agreement")

    clock = _Clock()
    schedule = Schedule(4, gather=refuse, clock=clock)
    saved, decisions = _train(schedule, clock, range(100))
    assert saved == list(range(3, 100, 4)) and decisions == []


def test_the_first_snapshots_of_a_generation_allocating_node_memory_are_not_measured() -> None:
    clock = _Clock()
    schedule = Schedule(AUTO, budget=0.03, clock=clock)
    allocating = {5, 11, 17}  # the ring's slots are allocated and pre-faulted by these commits

    def cost(position: int) -> float:
        return 0.2 if position == 0 else 0.1 if position == 1 else 0.0

    saved: list[int] = []
    for step in range(120):
        due = schedule.due(step)
        clock.now += 1.0 + cost(0 if due else step - (saved[-1] if saved else -1)) + (5.0 if step in allocating else 0)
        saved += [step] if due else []
        decision = schedule.finished(step, due)
        if decision is not None:
            assert decision.cost_s == pytest.approx(0.3) and decision.interval == 10
            return
    raise AssertionError("no decision in 120 steps")


def _train_replicating(
    schedule: Schedule, clock: _Clock, steps: range, *, memory: float, replica: float
) -> tuple[list[tuple[int, bool]], list[Decision]]:
    """``_train`` with ``--replicate-every auto``: a snapshot blocks ``memory`` seconds, and a
    replicated one ``replica`` more, half on its step and half on the step after (the push)."""
    taken: list[tuple[int, bool]] = []
    decisions: list[Decision] = []
    after = 0.0
    for step in steps:
        due = schedule.due(step)
        replicated = schedule.replicates() if due else None
        clock.now += 1.0 + after
        after = 0.0
        if due:
            clock.now += memory + (replica / 2 if replicated else 0.0)
            after = replica / 2 if replicated else 0.0
            taken.append((step, bool(replicated)))
        decision = schedule.finished(step, due)
        if decision is not None:
            decisions.append(decision)
    return taken, decisions


def test_replicate_every_auto_spaces_expensive_replicas_among_cheap_snapshots() -> None:
    clock = _Clock()
    schedule = Schedule(AUTO, budget=0.03, replicas=True, clock=clock)
    taken, decisions = _train_replicating(schedule, clock, range(600), memory=0.02, replica=0.5)
    # the first window replicates every other snapshot, so both kinds are measured
    assert [r for _, r in taken[:6]] == [True, False, True, False, True, False]
    final = decisions[-1]
    # (0.02 + 0.5 / k) / s <= 3% minimising s + s * k: k = 5 (~sqrt(0.5 / 0.02)), s = 4
    assert (final.interval, final.replicate_every) == (4, 5), decisions
    assert final.cost_s == pytest.approx(0.02, abs=0.005) and final.replica_cost_s == pytest.approx(0.5, abs=0.05)
    assert final.overhead is not None and final.overhead <= 0.03 + 1e-9
    late = [r for s, r in taken if s > 300]
    assert sum(late) / len(late) == pytest.approx(1 / 5, abs=0.05)
    assert final.replica_interval == 20


def test_replicate_every_auto_replicates_every_snapshot_when_replicas_cost_nothing_more() -> None:
    clock = _Clock()
    schedule = Schedule(AUTO, budget=0.03, replicas=True, clock=clock)
    _, decisions = _train_replicating(schedule, clock, range(1200), memory=0.3, replica=0.0)
    spacings = [d.replicate_every for d in decisions]
    assert spacings[0] == 1 and decisions[0].interval == 10
    # replicating every snapshot leaves the memory-only cost unmeasured: now and then a window
    # replicates every other snapshot to measure it again
    assert 2 in spacings[1 : REFRESH_WINDOWS + 2] and spacings[-1] == 1  # the run ends between two probes


def test_without_replicate_every_auto_the_schedule_does_not_choose_replicas() -> None:
    clock = _Clock()
    schedule = Schedule(AUTO, budget=0.03, clock=clock)
    assert schedule.replicates() is None
    fixed = Schedule(4, replicas=True, clock=clock)  # replicas are scheduled with auto snapshots only
    assert fixed.replicates() is None


def test_choose_for_replicas_is_a_pure_function_of_rows_with_both_kinds() -> None:
    # memory kind: 12 steps, 2 snapshots, 0.04 s above quiet; replicated kind: 12 steps, 2, 1.04 s
    rows = [[12_040_000, 12, 1_000_000, 2, 0, 13_040_000, 12, 2, 0]]
    decision = choose(rows, 0.03, 6, None, replicas=True)
    assert decision == choose([list(rows[0])], 0.03, 6, None, replicas=True)
    assert decision.cost_s == pytest.approx(0.02) and decision.replica_cost_s == pytest.approx(0.5)
    assert (decision.interval, decision.replicate_every) == (4, 5)
    spread = choose(rows, 0.03, 6, None, replicas=True, spread_replicas=True)
    assert spread.replicate_every >= 2
