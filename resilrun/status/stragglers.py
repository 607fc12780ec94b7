"""Which ranks the others wait for: the rule that names a straggler, from each rank's compute time.

Input is each rank's ``compute_s`` (worker/_compute_probe.py: the step's start to its last
gradient, without the wait for the others; smoothed by its agent over about the last ten steps).
Every rank of a synchronous job has the same step time, so step times cannot tell; compute times
can: the rank the others wait for has the longest.

The rule, and why each part:

- A rank is compared with the **median of the other ranks**, not of all: with two ranks the
  median of all is their mean, which a slow rank drags toward itself; without itself the
  comparison is well defined from two ranks up, and a few slow ranks among many do not move it.
- It must be at least ``RATIO`` (1.5) times that median: a factor, because compute times scale
  with the model, and 1.5 because on a shared machine ranks differ by tens of percent from noise
  (the operating system, a DataLoader worker, allocator growth) while a throttled GPU, a bad host
  or a noisy neighbour costs a factor.
- And at least ``MIN_GAP_S`` (5 ms) longer: on steps of a few milliseconds, a factor of 1.5 is a
  single scheduling hiccup; a straggler worth acting on costs the job real time per step.
- Smoothing over about ten steps (the agent's) means one slow step (a garbage collection, a
  checkpoint) does not count; a rank slow for the last several steps does.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

RATIO = 1.5
MIN_GAP_S = 0.005


@dataclass(frozen=True, slots=True)
class Straggler:
    """A rank slower than the others, with the evidence."""

    rank: int
    compute_s: float
    others_median_s: float

    @property
    def ratio(self) -> float:
        return self.compute_s / self.others_median_s if self.others_median_s > 0 else float("inf")


def stragglers(compute: Mapping[int, float], *, ratio: float = RATIO, min_gap_s: float = MIN_GAP_S) -> list[Straggler]:
    """The ranks among ``compute`` (rank -> compute seconds per step) the rule names, slowest first."""
    found = []
    for rank, seconds in compute.items():
        others = [s for r, s in compute.items() if r != rank]
        if not others:
            continue
        median = statistics.median(others)
        if seconds >= ratio * median and seconds - median >= min_gap_s:
            found.append(Straggler(rank, seconds, median))
    return sorted(found, key=lambda s: (-s.ratio, s.rank))
