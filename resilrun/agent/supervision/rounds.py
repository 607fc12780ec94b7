"""What one node runs in a round and where it stands in the job, shared by the supervisor's parts.

The supervisor thread is the only writer of a :class:`Round` and of the :class:`Membership`; other
threads (status, replication targets) read them through snapshots and plain attribute reads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from enum import Enum
from typing import Any

from resilrun.agent.workers import procs
from resilrun.errors import ShutdownRequested
from resilrun.rendezvous.protocol import RdzvState


class SignalFlag:
    """Set by signal handlers (which must do nothing else); read by the loop."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def handler(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum

    def raise_if_set(self) -> None:
        if self.signum is not None:
            raise ShutdownRequested(self.signum)


class RoundEnd(Enum):
    """How a round ended for this node."""

    DONE = "done"
    REJOIN = "rejoin"


class NodePhase(Enum):
    """Where this node's agent is, set by the supervisor as it moves (the status document's
    ``nodes[].state`` while the agent runs; docs/status.md)."""

    JOINING = "joining"  # in the rendezvous, or between rounds
    ACTIVE = "active"  # runs ranks of the current round
    SPARE = "spare"  # a spare node: warm workers, no node rank


class Membership:
    """This node's place in the job: the newest generation it follows, the round it runs, its phase.

    One object given to every part that moves the node (the round loop, in-process recovery, the
    spare-node standby), so none of them reaches into another for it. Written by the supervisor
    thread; each field is one reference, so a reader (status, replication) sees a whole value.
    """

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.state: RdzvState | None = None
        self.current: Round | None = None
        self.phase = NodePhase.JOINING

    def enter(self, state: RdzvState) -> None:
        self.state = state

    def run(self, round_: Round, phase: NodePhase) -> None:
        self.current = round_
        self.phase = phase

    # -- what the replication threads read ------------------------------------------------------
    def replica_targets(self, replicas: int) -> list[str]:
        """Replica servers of the next ``replicas`` nodes in node-rank order (a ring)."""
        state = self.state
        if state is None or replicas < 1:
            return []
        rank = state.node_rank(self.node_id)
        nodes = state.participants
        if rank is None or len(nodes) < 2:
            return []
        count = min(replicas, len(nodes) - 1)
        return [a for a in (nodes[(rank + i) % len(nodes)].peer_addr for i in range(1, count + 1)) if a]

    def peer_addresses(self) -> list[str]:
        """Replica servers of every other node of the generation this node follows."""
        state = self.state
        if state is None:
            return []
        return [p.peer_addr for p in state.participants if p.node_id != self.node_id and p.peer_addr]

    def generation(self) -> int:
        """The newest generation (round) this node follows (-1 before the first)."""
        state = self.state
        return state.round if state is not None else -1

    def local_ranks(self) -> range:
        """The global ranks this node runs in the generation it follows (none while it has no node
        rank: joining, or a spare node); as ``workers/specs.py`` numbers them."""
        state = self.state
        rank = state.node_rank(self.node_id) if state is not None else None
        if state is None or rank is None:
            return range(0)
        first = sum(p.local_world_size for p in state.participants[:rank])
        return range(first, first + state.participants[rank].local_world_size)

    def world_size(self) -> int:
        """World size of the current round (0 before the first)."""
        state = self.state
        return sum(p.local_world_size for p in state.participants) if state is not None else 0


@dataclass(frozen=True, slots=True)
class RoundSnapshot:
    """A round as another thread may read it: membership and each worker copied together."""

    state: RdzvState
    node_rank: int
    workers: tuple[procs.WorkerSnapshot, ...]  # by local rank
    spares: tuple[procs.WorkerSnapshot, ...]


# How long a superseded generation's worker store stays open: longer than a worker's setup guard
# waits for an abandoned set-up (resilrun/worker/_abort.py, SUPERSEDED_SETUP_GRACE_S).
RETIRED_STORE_S = 10.0


class Round:
    """What this node runs in the current round; in-process recoveries update it in place.

    The supervisor thread owns it and its workers. The status thread reads ``snapshot()`` only, which
    never blocks on an update in progress: a change made in several steps (a spare leaving ``spares``
    before it joins ``workers``) is wrapped in ``updating()``, and readers see the round as it was
    before until the block ends.
    """

    def __init__(
        self,
        state: RdzvState,
        node_rank: int,
        workers: list[procs.WorkerProcess],  # by local rank
        spares: list[procs.WorkerProcess],
        store: Any,
    ) -> None:
        self._lock = threading.Lock()
        self._frozen: RoundSnapshot | None = None  # what readers get while an update is in progress
        self._state = state
        self._workers = workers
        self._spares = spares
        self.node_rank = node_rank
        self.store = store
        # Worker stores of superseded generations and when they were replaced, kept open for
        # RETIRED_STORE_S: a survivor still connecting to one when its generation was superseded (a
        # spare failing its check at once, a loaded node) must reach it and fail in the set-up it
        # abandons, not retry a closed port until its setup guard ends the process (exit 75) and a
        # spare takes its rank.
        self._retired: list[tuple[Any, float]] = []
        self.spare_index = 0
        self.respawn_at: float | None = None
        self.killed: set[int] = set()  # pids SIGKILLed as hung, not yet reaped
        # Newest step committed on this node when the last in-process recovery started, and the
        # global ranks that had failed then.
        self.recovered_at_step: int | None = None
        self.recovered_ranks: frozenset[int] = frozenset()

    # Lists are mutated in place by the owner (append, remove): each such step is atomic for a
    # reader's copy; assignments go through the lock so a copy sees all of the fields of one moment.
    @property
    def state(self) -> RdzvState:
        return self._state

    @state.setter
    def state(self, state: RdzvState) -> None:
        with self._lock:
            self._state = state

    def replace_store(self, store: Any, now: float) -> None:
        """Owner only: ``store`` serves the generation entered at ``now`` (monotonic); the one it
        replaces stays open until ``close_retired`` finds it older than ``RETIRED_STORE_S``."""
        old, self.store = self.store, store
        if old is not None and old is not store:
            self._retired.append((old, now))

    def close_retired(self, now: float | None = None) -> None:
        """Owner only: close the superseded stores retired ``RETIRED_STORE_S`` before ``now``, or all
        of them (``now`` None: the round is over). Off a recovery's critical path: a close waits for
        its server thread."""
        kept = []
        for store, since in self._retired:
            if now is not None and now - since < RETIRED_STORE_S:
                kept.append((store, since))
                continue
            with suppress(Exception):  # a store that fails to close is no reason to stop the agent
                store.close()
        self._retired = kept

    @property
    def workers(self) -> list[procs.WorkerProcess]:
        return self._workers

    @workers.setter
    def workers(self, workers: list[procs.WorkerProcess]) -> None:
        with self._lock:
            self._workers = workers

    @property
    def spares(self) -> list[procs.WorkerProcess]:
        return self._spares

    @spares.setter
    def spares(self, spares: list[procs.WorkerProcess]) -> None:
        with self._lock:
            self._spares = spares

    def snapshot(self) -> RoundSnapshot:
        """Any thread: the round now, or as it was before the update in progress (no side effects)."""
        with self._lock:
            if self._frozen is not None:
                return self._frozen
            return self._snapshot_locked()

    @contextmanager
    def updating(self) -> Iterator[None]:
        """Owner only: readers see none of the changes made inside the block until it ends."""
        with self._lock:
            if self._frozen is not None:
                raise RuntimeError("Round.updating() does not nest")
            self._frozen = self._snapshot_locked()
        try:
            yield
        finally:
            with self._lock:
                self._frozen = None

    def _snapshot_locked(self) -> RoundSnapshot:
        return RoundSnapshot(
            self._state,
            self.node_rank,
            tuple(w.snapshot() for w in list(self._workers)),
            tuple(s.snapshot() for s in list(self._spares)),
        )
