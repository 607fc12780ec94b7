"""The rule that names a straggler from each rank's compute time (resilrun/status/stragglers.py):
a factor over the other ranks' median, an absolute floor, and nothing from noise."""

from __future__ import annotations

import random

import pytest

from resilrun.status.stragglers import MIN_GAP_S, RATIO, Straggler, stragglers


def test_a_rank_twice_as_slow_as_the_others_is_named_with_its_evidence() -> None:
    found = stragglers({0: 0.100, 1: 0.104, 2: 0.210, 3: 0.098})
    assert found == [Straggler(rank=2, compute_s=0.210, others_median_s=0.100)]
    assert found[0].ratio == pytest.approx(2.1)


def test_two_ranks_are_enough_and_only_the_slow_one_is_named() -> None:
    # (against the median of all ranks, the slow one would drag the reference to the mean)
    assert [s.rank for s in stragglers({0: 0.05, 1: 0.12})] == [1]
    assert stragglers({0: 0.05}) == []  # alone: nothing to compare with


def test_a_whole_slow_host_among_many_is_named_rank_by_rank() -> None:
    compute = dict.fromkeys(range(16), 0.04) | {8: 0.090, 9: 0.088}  # a host's two ranks
    assert [s.rank for s in stragglers(compute)] == [8, 9]


def test_below_the_factor_or_the_floor_nobody_is_named() -> None:
    assert stragglers({0: 0.100, 1: 0.100, 2: 0.149}) == []  # 1.49x
    assert stragglers({0: 0.002, 1: 0.002, 2: 0.006}) == []  # 3x, but 4 ms: a scheduling hiccup
    assert [s.rank for s in stragglers({0: 0.010, 1: 0.010, 2: 0.010 * RATIO + MIN_GAP_S})] == [2]


def test_tunable_and_slowest_first() -> None:
    compute = {0: 0.1, 1: 0.1, 2: 0.13, 3: 0.3}
    assert [s.rank for s in stragglers(compute)] == [3]
    assert [s.rank for s in stragglers(compute, ratio=1.25)] == [3, 2]


def test_noise_of_a_shared_machine_names_nobody() -> None:
    # Smoothed compute times of 32 ranks with up to +-20 % noise each, many draws: never a straggler
    rng = random.Random(7)
    for _ in range(2000):
        compute = {r: 0.050 * rng.uniform(0.8, 1.2) for r in range(32)}
        assert stragglers(compute) == []
