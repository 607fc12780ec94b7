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

With ``--replicate-every auto`` too, a snapshot is either kept in node memory only or also copied to
the peers, and the two kinds cost different amounts (a replica's traffic shares the bus and the
network with training, and its commit waits for the previous replicas). Each period is counted for
the kind of the snapshot that began its interval, so a window measures both: ``c_m`` for a snapshot,
``c_r`` more for a replicated one. Every ``k``-th snapshot is replicated, and (``s``, ``k``) is the pair
under the budget, ``(c_m + c_r / k) / (s * quiet) <= budget``, that minimises ``s + s * k``: the steps
a worker failure and a node loss would redo, weighed alike (without rates of either, the neutral
choice). Its optimum, ``k = sqrt(c_r / c_m)``, is what a cheap memory snapshot and an expensive
replica call for: snapshots often, replicas every few of them. A push that outlasts its interval
makes the *next* snapshot's commit wait (the commit gate), and that wait counts for the next
snapshot's kind: ``c_m`` then comes out high and ``c_r`` low, which errs toward more replicas and a
higher total estimate, never past the budget.
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
# the quiet period drifts (longer sequences, a compiled graph), and a stale one hides that. The same
# for ``--replicate-every auto`` replicating every snapshot: one window replicates every other one,
# so the cost of a snapshot kept in node memory only is measured again.
REFRESH_WINDOWS = 4
# Replicating every k-th snapshot: at most this many snapshots between two replicas.
MAX_REPLICA_SPACING = 64
# Snapshot kinds, as the measurement counts them (the second only with --replicate-every auto).
MEMORY, REPLICATED = 0, 1


@dataclass(frozen=True)
class Measured:
    """One rank's window, as the all-gather carries it (microseconds: integers travel exactly).

    Totals, steps, snapshots and blocked time are per kind (``MEMORY``; ``REPLICATED`` only with
    ``--replicate-every auto``): a period counts for the kind of the snapshot that began its interval.
    """

    total_us: int  # the sum of the window's step periods
    steps: int
    quiet_us: int  # median quiet period; -1: no quiet step in this window
    snapshots: int
    blocked_us: int = 0  # the time the window's snapshots blocked inside the commit, in all
    replicated: tuple[int, int, int, int] | None = None  # (total_us, steps, snapshots, blocked_us)

    def row(self) -> list[int]:
        kinds = [self.total_us, self.steps, self.quiet_us, self.snapshots, self.blocked_us]
        return kinds + list(self.replicated) if self.replicated is not None else kinds


@dataclass(frozen=True)
class Decision:
    interval: int
    quiet_s: float | None  # the quiet step period the decision used
    cost_s: float | None  # what one snapshot adds to training time (the worst rank's)
    # --replicate-every auto: every ``replicate_every``-th snapshot is replicated, adding
    # ``replica_cost_s`` to it (None: replication is not scheduled here, and ``cost_s`` includes it)
    replicate_every: int = 1
    replica_cost_s: float | None = None

    @property
    def overhead(self) -> float | None:
        """The fraction of training time snapshots (and replicas) take at ``interval``."""
        if self.quiet_s is None or self.cost_s is None or self.quiet_s <= 0:
            return None
        per_snapshot = self.cost_s + (self.replica_cost_s or 0.0) / self.replicate_every
        return per_snapshot / (self.interval * self.quiet_s)

    @property
    def replica_interval(self) -> int:
        """Steps between replicas (about: an interval may change in between)."""
        return self.interval * self.replicate_every


def choose(
    rows: list[list[int]],
    budget: float,
    interval: int,
    previous: Decision | None,
    *,
    probe: bool = False,
    replicas: bool = False,
    spread_replicas: bool = False,
) -> Decision:
    """The interval for the next window, from every rank's ``Measured.row()`` (a pure function).

    ``previous`` supplies the quiet period when no rank had quiet steps (interval 1 or 2) and
    smooths the cost (half the new measurement, half the old). ``probe``: the next window must
    re-measure the quiet period (at least ``PROBE_INTERVAL``). ``replicas``: choose the replica
    spacing too (``--replicate-every auto``); ``spread_replicas``: the next window must replicate at
    most every other snapshot, so that a snapshot kept in memory only is measured again."""
    quiets = [row[2] for row in rows if row[2] > 0]
    quiet_us = statistics.median(quiets) if quiets else None
    if quiet_us is None and previous is not None and previous.quiet_s is not None:
        quiet_us = previous.quiet_s * 1e6
    if quiet_us is None:
        # nothing quiet measured yet: replicate every other snapshot, so both kinds get measured
        return Decision(max(interval, PROBE_INTERVAL), None, None, 2 if replicas else 1)
    memory = _kind_cost(rows, quiet_us, (0, 1, 3, 4))
    replicated = _kind_cost(rows, quiet_us, (5, 6, 7, 8)) if replicas else None
    if memory is None and replicated is None:  # no snapshot in the window (an interval longer than it)
        return previous if previous is not None else Decision(interval, quiet_us / 1e6, None)
    old = previous if previous is not None and previous.cost_s is not None else None
    if not replicas:
        cost_us = _smoothed(memory, None if old is None else old.cost_s)
        chosen = _interval(cost_us, budget, quiet_us)
        if probe:
            chosen = max(chosen, PROBE_INTERVAL)
        return Decision(chosen, quiet_us / 1e6, cost_us / 1e6)
    # A kind not seen in this window keeps its previous estimate; a replica never seen costs nothing
    # more than a snapshot until it is (the first window replicates every other snapshot: it is).
    old_memory = None if old is None else old.cost_s
    old_full = None if old is None else old.cost_s + (old.replica_cost_s or 0.0)
    memory_us = _smoothed(memory, old_memory) if memory is not None or old_memory is not None else None
    full_us = _smoothed(replicated, old_full) if replicated is not None or old_full is not None else None
    if memory_us is None:
        memory_us = full_us or 0.0
    extra_us = max(0.0, (full_us if full_us is not None else memory_us) - memory_us)
    chosen, spacing = _pair(memory_us, extra_us, budget, quiet_us, probe=probe, spread=spread_replicas)
    return Decision(chosen, quiet_us / 1e6, memory_us / 1e6, spacing, extra_us / 1e6)


def _kind_cost(rows: list[list[int]], quiet_us: float, at: tuple[int, int, int, int]) -> float | None:
    """The worst rank's cost of one snapshot of a kind (its row's total, steps, snapshots and
    blocked time at ``at``), or None when no rank took one."""
    total, steps, snapshots, blocked = at
    costs = [
        max(row[total] - row[steps] * quiet_us, row[blocked]) / row[snapshots]
        for row in rows
        if len(row) > blocked and row[snapshots] > 0 and row[steps] > 0
    ]
    return max(0.0, max(costs)) if costs else None


def _smoothed(measured: float | None, previous_s: float | None) -> float:
    if measured is None:
        return (previous_s or 0.0) * 1e6
    return measured if previous_s is None else (measured + previous_s * 1e6) / 2


def _interval(cost_us: float, budget: float, quiet_us: float) -> int:
    return min(MAX_INTERVAL, max(1, math.ceil(cost_us / (budget * quiet_us))))


def _pair(
    memory_us: float, extra_us: float, budget: float, quiet_us: float, *, probe: bool, spread: bool
) -> tuple[int, int]:
    """(snapshot interval s, replica spacing k) under the budget minimising ``s + s * k``."""
    best: tuple[int, int, int] | None = None  # (score, s, k)
    for spacing in range(2 if spread else 1, MAX_REPLICA_SPACING + 1):
        chosen = _interval(memory_us + extra_us / spacing, budget, quiet_us)
        if probe:
            chosen = max(chosen, PROBE_INTERVAL)
        if chosen * spacing > MAX_INTERVAL and best is not None:
            break
        score = chosen * (1 + spacing)
        if best is None or score < best[0]:
            best = (score, chosen, spacing)
    assert best is not None  # the loop's first pass always sets it
    return best[1], best[2]


@dataclass
class _Kind:
    """What a window measured of the intervals begun by one kind of snapshot."""

    total: float = 0.0
    steps: int = 0
    snapshots: int = 0
    blocked: float = 0.0

    def row(self) -> tuple[int, int, int, int]:
        return round(self.total * 1e6), self.steps, self.snapshots, round(self.blocked * 1e6)


@dataclass
class _Window:
    start: int  # its first step
    replicas: bool = False  # the replicated kind is measured apart (--replicate-every auto)
    kinds: tuple[_Kind, _Kind] = field(default_factory=lambda: (_Kind(), _Kind()))
    quiet: list[float] = field(default_factory=list)

    def add(self, kind: int, period: float, saved: bool, blocked: float) -> None:
        measured = self.kinds[kind if self.replicas else MEMORY]
        measured.total += period
        measured.steps += 1
        measured.snapshots += saved
        measured.blocked += blocked

    def measured(self) -> Measured:
        quiet = statistics.median(self.quiet) if len(self.quiet) >= 3 else -1
        total, steps, snapshots, blocked = self.kinds[MEMORY].row()
        return Measured(
            total,
            steps,
            round(quiet * 1e6) if quiet > 0 else -1,
            snapshots,
            blocked,
            self.kinds[REPLICATED].row() if self.replicas else None,
        )


class Schedule:
    """This rank's side of the snapshot schedule; ``Job.commit`` asks it, step by step."""

    def __init__(
        self,
        every: int,
        *,
        budget: float = 0.03,
        replicas: bool = False,
        gather: Callable[[list[int]], list[list[int]]] = lambda row: [row],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``every``: N, or ``AUTO``; ``budget``: the overhead fraction ``auto`` keeps under;
        ``replicas``: which snapshots the peers get is decided here too (``--replicate-every auto``
        with peer replicas; only with ``every=AUTO``); ``gather``: an all-gather of one row of ints
        over every rank (a collective: every rank reaches each decision at the same step)."""
        self.auto = every == AUTO
        self.replicas = replicas and self.auto
        self.interval = PROBE_INTERVAL if self.auto else max(1, every)
        self.replicate_every = 1  # every k-th snapshot goes to the peers (``replicas`` only)
        self.budget = budget
        self.last_saved = -1  # the newest snapshotted step (or the restored one)
        self.decision: Decision | None = None
        self._gather = gather
        self._clock = clock
        self._window: _Window | None = None
        self._first = 0  # the generation's first step
        self._previous_end: float | None = None  # when the previous step's commit returned
        self._short_windows = 0  # windows in a row without quiet steps
        self._dense_windows = 0  # windows in a row replicating every snapshot
        self._taken = 0  # snapshots taken in this generation
        self._since_replica = 0  # snapshots since the newest replicated one
        self._kind = MEMORY  # the kind of the newest snapshot: its interval's periods count for it
        self.start(-1)  # a fresh start unless a restore says otherwise

    def start(self, restored: int) -> None:
        """The generation resumes after ``restored`` (-1: from the beginning)."""
        self.last_saved = restored
        self._first = restored + 1
        self._taken = 0
        if self.auto:
            self.interval = PROBE_INTERVAL
            self._window = _Window(self._first, self.replicas)
        if self.replicas:
            self.replicate_every = 2  # both kinds measured in the first window
            self._since_replica = self.replicate_every - 1  # the first snapshot is replicated

    def due(self, step: int) -> bool:
        """Whether ``step``, just finished, is snapshotted. Fixed intervals keep absolute steps
        (N-1, 2N-1, ...): the same ones in every generation."""
        if not self.auto:
            return (step + 1) % self.interval == 0
        return step >= self.last_saved + self.interval

    def replicates(self) -> bool | None:
        """Whether the snapshot about to be taken goes to the peers too; None: the agent's
        ``--replicate-every N`` decides (this schedule does not choose replicas)."""
        if not self.replicas:
            return None
        return self._since_replica + 1 >= self.replicate_every

    def finished(self, step: int, saved: bool, blocked_s: float = 0.0) -> Decision | None:
        """``step``'s commit returned (``saved``: it was snapshotted, blocking training for
        ``blocked_s``); returns a new decision at the end of a window (after agreeing with every
        rank), else None."""
        now = self._clock()
        position = step - self.last_saved  # steps since the previous snapshot (before this one)
        if saved:
            replicated = self.replicates()
            self._kind = REPLICATED if replicated else MEMORY
            self._since_replica = 0 if replicated else self._since_replica + 1
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
            window.add(self._kind, period, saved, blocked_s)
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
        self._dense_windows = self._dense_windows + 1 if self.replicate_every == 1 else 0
        spread = self._dense_windows >= REFRESH_WINDOWS
        if spread:
            self._dense_windows = 0
        self.decision = choose(
            rows, self.budget, self.interval, self.decision, probe=probe, replicas=self.replicas, spread_replicas=spread
        )
        self.interval = self.decision.interval
        if self.replicas:
            self.replicate_every = self.decision.replicate_every
            # a shorter spacing takes effect at once: the snapshots since the last replica count
            self._since_replica = min(self._since_replica, self.replicate_every - 1)
        self._window = _Window(step + 1, self.replicas)
        self._previous_end = self._clock()  # the all-gather is not a step's time
        return self.decision

    def saved(self, step: int) -> None:
        """``step`` was snapshotted outside the schedule (the last step, at the end of training)."""
        self.last_saved = max(self.last_saved, step)

    def at_risk(self, step: int) -> int:
        """Steps a failure after ``step`` would redo."""
        return step - self.last_saved
