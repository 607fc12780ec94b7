"""Which finished steps ``Job.commit`` snapshots: every N-th (``--snapshot-every N``) or ``auto``.

With ``auto`` the interval is chosen from measured step periods so that what snapshots add to
training time stays under ``--max-overhead`` (CheckFreq's idea, FAST '21, done here without a
profiling phase that trains unprotected). What a snapshot costs is not only the worker's blocking
copy: the agent's checksums, replication and uploads share the memory bus and the cores with the
next steps, and in synchronous training one rank's stall is every rank's wait. So the cost is
measured where all of that shows, in the period between two commits:

- the *quiet* period is the median period of steps in the far half of an interval (not a snapshot
  step, at least ``k // 2 + 1`` steps after one): the background work of the previous snapshot is
  done by then on any machine where snapshots fit the budget at all;
- a snapshot costs what a window's periods add above ``n`` quiet periods, per snapshot in it, and
  never less than the blocking part measured inside the commit (the copy into node memory and the
  wait for the previous step's replicas): on a machine whose step times vary by more than the
  snapshot costs, a short window's excess can come out at zero, the blocking part cannot.

The interval that keeps ``cost / (k * quiet)`` under the budget is taken. Every rank must snapshot
the same steps (a restore needs a step every rank holds, and local ranks share DDP bytes), so the
decision is agreed: at the last step of each window all ranks all-gather their measurements and
apply the same pure function (``choose``) to the gathered rows. Windows and intervals are functions
of agreed state only (the restored step, the decided intervals), so a replacement rank joins the
same schedule: every generation starts over from that state, the interval re-measured.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from resilrun.env import SNAPSHOT_AUTO as AUTO  # --snapshot-every auto

# The first interval of a generation, and of a refresh of the quiet period: large enough that each
# interval has quiet steps (positions 4 and 5 of 6), small enough that few steps are at risk then.
PROBE_INTERVAL = 6
# Steps per decision window: at least this many, and at least WINDOW_INTERVALS intervals.
MIN_WINDOW = 24
WINDOW_INTERVALS = 4
# Intervals above this would leave more steps at risk than a failure-free hour of most jobs is
# worth re-measuring; the budget is then met with room to spare.
MAX_INTERVAL = 1000
# A generation's first snapshots allocate and pre-fault node memory's ring of slots (up to 3 per
# rank), and its first steps compile and warm caches: measuring starts after this many snapshots.
WARM_SNAPSHOTS = 3
# After this many windows at an interval too short to have quiet steps, one window probes again:
# the quiet period drifts (longer sequences, a compiled graph), and a stale one hides that.
REFRESH_WINDOWS = 4


@dataclass(frozen=True)
class Measured:
    """One rank's window, as the all-gather carries it (microseconds: integers travel exactly)."""

    total_us: int  # the sum of the window's step periods
    steps: int
    quiet_us: int  # median quiet period; -1: no quiet step in this window
    snapshots: int
    blocked_us: int = 0  # the time the window's snapshots blocked inside the commit, in all

    def row(self) -> list[int]:
        return [self.total_us, self.steps, self.quiet_us, self.snapshots, self.blocked_us]


@dataclass(frozen=True)
class Decision:
    interval: int
    quiet_s: float | None  # the quiet step period the decision used
    cost_s: float | None  # what one snapshot adds to training time (the worst rank's)

    @property
    def overhead(self) -> float | None:
        """The fraction of training time snapshots take at ``interval``."""
        if self.quiet_s is None or self.cost_s is None or self.quiet_s <= 0:
            return None
        return self.cost_s / (self.interval * self.quiet_s)


def choose(
    rows: list[list[int]], budget: float, interval: int, previous: Decision | None, *, probe: bool = False
) -> Decision:
    """The interval for the next window, from every rank's ``Measured.row()`` (a pure function).

    ``previous`` supplies the quiet period when no rank had quiet steps (interval 1 or 2) and
    smooths the cost (half the new measurement, half the old). ``probe``: the next window must
    re-measure the quiet period (at least ``PROBE_INTERVAL``)."""
    quiets = [row[2] for row in rows if row[2] > 0]
    quiet_us = statistics.median(quiets) if quiets else None
    if quiet_us is None and previous is not None and previous.quiet_s is not None:
        quiet_us = previous.quiet_s * 1e6
    if quiet_us is None:
        return Decision(max(interval, PROBE_INTERVAL), None, None)
    costs = [max(row[0] - row[1] * quiet_us, row[4]) / row[3] for row in rows if row[3] > 0 and row[1] > 0]
    if not costs:  # no snapshot in the window (an interval longer than it): nothing new measured
        return previous if previous is not None else Decision(interval, quiet_us / 1e6, None)
    cost_us = max(0.0, max(costs))
    if previous is not None and previous.cost_s is not None:
        cost_us = (cost_us + previous.cost_s * 1e6) / 2
    chosen = min(MAX_INTERVAL, max(1, math.ceil(cost_us / (budget * quiet_us))))
    if probe:
        chosen = max(chosen, PROBE_INTERVAL)
    return Decision(chosen, quiet_us / 1e6, cost_us / 1e6)


@dataclass
class _Window:
    start: int  # its first step
    periods: list[float] = field(default_factory=list)
    quiet: list[float] = field(default_factory=list)
    snapshots: int = 0
    blocked: float = 0.0

    def measured(self) -> Measured:
        quiet = statistics.median(self.quiet) if len(self.quiet) >= 3 else -1
        total = sum(self.periods)
        return Measured(
            round(total * 1e6),
            len(self.periods),
            round(quiet * 1e6) if quiet > 0 else -1,
            self.snapshots,
            round(self.blocked * 1e6),
        )


class Schedule:
    """This rank's side of the snapshot schedule; ``Job.commit`` asks it, step by step."""

    def __init__(
        self,
        every: int,
        *,
        budget: float = 0.03,
        gather: Callable[[list[int]], list[list[int]]] = lambda row: [row],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``every``: N, or ``AUTO``; ``budget``: the overhead fraction ``auto`` keeps under;
        ``gather``: an all-gather of one row of ints over every rank (a collective: every rank
        reaches each decision at the same step)."""
        self.auto = every == AUTO
        self.interval = PROBE_INTERVAL if self.auto else max(1, every)
        self.budget = budget
        self.last_saved = -1  # the newest snapshotted step (or the restored one)
        self.decision: Decision | None = None
        self._gather = gather
        self._clock = clock
        self._window: _Window | None = None
        self._first = 0  # the generation's first step
        self._previous_end: float | None = None  # when the previous step's commit returned
        self._short_windows = 0  # windows in a row without quiet steps
        self._taken = 0  # snapshots taken in this generation
        self.start(-1)  # a fresh start unless a restore says otherwise

    def start(self, restored: int) -> None:
        """The generation resumes after ``restored`` (-1: from the beginning)."""
        self.last_saved = restored
        self._first = restored + 1
        self._taken = 0
        if self.auto:
            self.interval = PROBE_INTERVAL
            self._window = _Window(self._first)

    def due(self, step: int) -> bool:
        """Whether ``step``, just finished, is snapshotted. Fixed intervals keep absolute steps
        (N-1, 2N-1, ...): the same ones in every generation."""
        if not self.auto:
            return (step + 1) % self.interval == 0
        return step >= self.last_saved + self.interval

    def finished(self, step: int, saved: bool, blocked_s: float = 0.0) -> Decision | None:
        """``step``'s commit returned (``saved``: it was snapshotted, blocking training for
        ``blocked_s``); returns a new decision at the end of a window (after agreeing with every
        rank), else None."""
        now = self._clock()
        position = step - self.last_saved  # steps since the previous snapshot (before this one)
        if saved:
            self.last_saved = step
            self._taken += 1
        window = self._window
        if window is None:
            return None
        # Measured from the first snapshot after the warm ones on: each window then holds whole
        # intervals (a snapshot step, the steps its background work slows, the quiet ones).
        if self._taken <= WARM_SNAPSHOTS or self._previous_end is None:
            window.start = step + 1
        else:
            period = now - self._previous_end
            window.periods.append(period)
            window.snapshots += saved
            window.blocked += blocked_s
            if not saved and self.interval >= 3 and position > self.interval // 2:
                window.quiet.append(period)
        self._previous_end = now
        if step + 1 - window.start < max(MIN_WINDOW, WINDOW_INTERVALS * self.interval) or not self.due(step + 1):
            return None  # windows end where an interval does: each snapshot's aftermath in its own window
        rows = self._gather(window.measured().row())
        had_quiet = any(row[2] > 0 for row in rows)
        self._short_windows = 0 if had_quiet else self._short_windows + 1
        probe = self._short_windows >= REFRESH_WINDOWS
        if probe:
            self._short_windows = 0
        self.decision = choose(rows, self.budget, self.interval, self.decision, probe=probe)
        self.interval = self.decision.interval
        self._window = _Window(step + 1)
        self._previous_end = self._clock()  # the all-gather is not a step's time
        return self.decision

    def saved(self, step: int) -> None:
        """``step`` was snapshotted outside the schedule (the last step, at the end of training)."""
        self.last_saved = max(self.last_saved, step)

    def at_risk(self, step: int) -> int:
        """Steps a failure after ``step`` would redo."""
        return step - self.last_saved
