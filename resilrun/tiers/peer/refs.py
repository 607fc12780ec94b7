"""Replicas that keep their DDP-equal segments in this node's own snapshots instead of a copy.

Under DDP every rank holds the same parameters and optimizer state after a step, so a peer's
replica of step S shares most of its bytes with this node's own snapshot of S. The replica server
then takes only the sender's own bytes over the network and leaves the shared ranges where they
already are (``store.LocalRef``): no copy, no crc32 pass on the receiving node per step.

A reference lives as long as the slot it points into holds step S. Node memory tells us before a
slot may be rewritten (``NodeMemoryTier.add_overwrite_guard``: a worker writes its next step into
its older slot only after the answer to its commit, which waits for the guards). Each replica
referring to a released step is then:

- dropped, when every rank held here already has a newer replica (a restore resumes all ranks of
  a lost node at one step: while one rank's newest is this step, the others' copy of it is that
  common step, even when they hold a newer one);
- otherwise kept: the guard waits, up to most of a step, for those newer replicas (the usual case:
  they are on their way), and copies the referenced bytes into the replica's slot when they did
  not all come, so that a rank whose replication stalled, and the ranks beside it, keep a step in
  common.

The wait costs the worker nothing while it is shorter than a step: the worker reads its commit's
answer only when it is about to write its next snapshot. A push for a step whose slot has already
been released copies the shared bytes instead of referring to them.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer.store import LocalRef, ReplicaStore

logger = logging.getLogger(__name__)

# The guard waits at most this share of the interval between this node's steps (the median of the
# last few: a recovery or an evaluation between two steps is not the usual step) for a newer
# replica, and never longer than _MAX_WAIT_S (a slow step is no reason to hold a worker back).
_WAIT_SHARE = 0.8
_MAX_WAIT_S = 1.0
_INTERVALS = 5


class LocalReferences:
    """Which pushes may refer to this node's snapshots, and what happens when those are released."""

    def __init__(self, memory: NodeMemoryTier, replicas: ReplicaStore) -> None:
        self.memory = memory
        self.replicas = replicas
        self._changed = threading.Condition()
        self._released: tuple[int, int] = (-(2**62), -(2**62))  # (round, step): newest released
        self._released_at: float | None = None
        self._intervals: deque[float] = deque(maxlen=_INTERVALS)
        self._pushes: dict[int, tuple[int, int]] = {}  # pushes that will refer: token -> (round, step)
        self._tokens = itertools.count()
        memory.add_overwrite_guard(self.release)

    def begin(self, step: int, round: int) -> int | None:
        """A token for a push of ``step`` (generation ``round``) that means to refer to this node's
        copy; None when it may not (its slot was released: it can be rewritten without notice)."""
        with self._changed:
            if round < 0 or (round, step) <= self._released:
                return None
            token = next(self._tokens)
            self._pushes[token] = (round, step)
            return token

    def publish(self, token: int, publish: Callable[[], None]) -> bool:
        """Run ``publish`` (making the referring replica visible) unless the guard revoked the token
        meanwhile; False then, and the caller copies the bytes in instead."""
        with self._changed:
            if self._pushes.pop(token, None) is None:
                return False
            publish()
            self._changed.notify_all()
            return True

    def end(self, token: int) -> None:
        """The push is over, whatever became of it."""
        with self._changed:
            if self._pushes.pop(token, None) is not None:
                self._changed.notify_all()

    def fill(self, ref: LocalRef, step: int, into: memoryview) -> bool:
        """Copy a replica's referenced ranges in from this node's snapshot (False: it is gone)."""
        return self.memory.copy_shared(step, ref.layout, ref.round, ref.ranges, into, 0.0)

    def materialize(self, rank: int, step: int, checksum: bool = True) -> bool:
        """Make a replica whole in its slot (see ``ReplicaStore.materialize``); False when it is not
        held (any more)."""
        return self.replicas.materialize(rank, step, lambda ref, into: self.fill(ref, step, into), checksum)

    def release(self, step: int, round: int) -> None:
        """The guard: this node's snapshots of ``step`` (and older) may be rewritten once this returns."""
        now = time.monotonic()
        released = (round, step)
        with self._changed:
            if released > self._released:
                if self._released_at is not None:
                    self._intervals.append(now - self._released_at)
                self._released, self._released_at = released, now
            interval_s = statistics.median(self._intervals) if self._intervals else 0.0
            deadline = now + min(_WAIT_SHARE * interval_s, _MAX_WAIT_S)
            # Pushes about to refer to a released step: let them land (then they are handled below
            # like any other), or revoke them at the deadline (they copy instead).
            while covered := [t for t, key in self._pushes.items() if key <= released]:
                left = deadline - time.monotonic()
                if left <= 0:
                    for token in covered:
                        del self._pushes[token]
                    break
                self._changed.wait(left)
        for rank, held in self.replicas.referencing(step, round):
            if self.replicas.wait_newer_everywhere(held, max(0.0, deadline - time.monotonic())):
                self.replicas.discard(rank, held)
            elif not self.materialize(rank, held):
                logger.warning("replica of rank %d step %d lost its shared bytes: dropped", rank, held)
