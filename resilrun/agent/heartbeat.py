"""Liveness: each agent bumps a counter in the store; every agent judges the others' counters.

Heartbeats are counters, never timestamps: a watcher records, on its own monotonic clock, when it
last saw a node's counter change, so clock skew between machines cannot make a live node look dead
(or a dead one alive). A node is stale when its counter has not moved for the heartbeat timeout.

Only time the watcher actually spent watching counts: when two of its observations of a node are
further apart than half the timeout, the watcher itself was blind (its store reads were stalled,
e.g. during an etcd leader election, or its process was descheduled), and the senders' writes were
most likely stalled by the same cause; the excess is not held against the node. Without this, a
store hiccup longer than the timeout made every node declare every other node lost at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from resilrun import keys
from resilrun.clock import Clock, SystemClock
from resilrun.errors import ResilrunError
from resilrun.rendezvous.api import RendezvousBackend

logger = logging.getLogger(__name__)


class StalenessJudge:
    """Tracks when each watched counter last changed; pure apart from the injected clock.

    Args:
        timeout_s: how long a counter may stand still (in watched time) before its node is stale.
        max_gap_s: the longest span between two observations that counts in full (default: half
            the timeout, so a watcher that observes every heartbeat interval never hits it).
    """

    def __init__(self, timeout_s: float, clock: Clock | None = None, *, max_gap_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.max_gap_s = timeout_s / 2 if max_gap_s is None else max_gap_s
        self.clock = clock or SystemClock()
        # node -> (counter, when it last changed, less blind time; when it was last observed)
        self._seen: dict[str, tuple[int, float, float]] = {}

    def observe(self, node: str, counter: int) -> None:
        now = self.clock.monotonic()
        previous = self._seen.get(node)
        if previous is None or previous[0] != counter:
            self._seen[node] = (counter, now, now)
            return
        _, changed, observed = previous
        blind = now - observed - self.max_gap_s
        self._seen[node] = (counter, changed + max(blind, 0.0), now)

    def revive(self, node: str) -> None:
        """The node was seen alive another way (rendezvous/peer proof): its silence starts over now."""
        now = self.clock.monotonic()
        counter = self._seen[node][0] if node in self._seen else -1
        self._seen[node] = (counter, now, now)

    def forget_all_but(self, nodes: Iterable[str]) -> None:
        keep = set(nodes)
        self._seen = {n: v for n, v in self._seen.items() if n in keep}

    def stale(self) -> list[str]:
        """Nodes whose counter has not moved for longer than the timeout."""
        now = self.clock.monotonic()
        return sorted(n for n, (_, changed, _) in self._seen.items() if now - changed > self.timeout_s)

    def lost(self) -> list[str]:
        """Stale nodes, once no other node is halfway there: nodes that died together are judged together.

        Nodes killed in the same instant last bumped their counters up to one heartbeat interval
        apart, so plain staleness would judge them one check apart and the job would recover twice
        (the second recovery tearing down the first's half-built process group). While another node
        has been silent for over half the timeout, the verdict waits for that node to either move
        again (then the verdict stands alone, one check later) or go stale too. A live node misses
        half the timeout only when it is itself in trouble, so a single loss is not delayed.
        """
        stale = self.stale()
        if not stale:
            return []
        now = self.clock.monotonic()
        halfway = self.timeout_s / 2
        pending = [n for n, (_, changed, _) in self._seen.items() if halfway < now - changed <= self.timeout_s]
        return [] if pending else stale

    def age(self, node: str) -> float | None:
        seen = self._seen.get(node)
        return None if seen is None else self.clock.monotonic() - seen[1]


class HeartbeatSender:
    """A daemon thread that bumps this node's counter every interval (failures are logged once)."""

    def __init__(
        self, backend: RendezvousBackend, run_id: str, node_id: str, interval_s: float, clock: Clock | None = None
    ) -> None:
        self._key = keys.node_heartbeat(run_id, node_id)
        self._backend = backend
        self._interval = interval_s
        self._clock = clock or SystemClock()
        self._stop = threading.Event()
        self._failing = False
        # When the newest bump that reached the store began (this node's monotonic clock): a
        # watcher saw the counter move no earlier, so it cannot judge this node lost before this
        # plus the heartbeat timeout (the write fence's lease). One float: readers see a whole value.
        self.confirmed_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="resilrun-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = self._clock.monotonic()
            try:
                self._backend.add(self._key, 1)
                self.confirmed_at = began
                self._failing = False
            except ResilrunError as exc:
                if not self._failing:
                    logger.warning("heartbeat to the store failed: %s", exc.message)
                self._failing = True
            self._stop.wait(self._interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._interval + 5)


def read_counters(backend: RendezvousBackend, run_id: str, nodes: Iterable[str]) -> Callable[[], dict[str, int]]:
    """A reader of the given nodes' heartbeat counters (one small read per node)."""
    node_list = list(nodes)

    def read() -> dict[str, int]:
        return {node: backend.add(keys.node_heartbeat(run_id, node), 0) for node in node_list}

    return read


def watched_nodes(participants: Sequence[str], me: str, fanout: int) -> list[str]:
    """The nodes this one watches: its ``fanout`` successors on the ring of participants.

    Every node watching every other costs N reads per node per interval, O(N^2) for the job; on a
    ring each node reads ``fanout`` counters, O(N) in all, and a lost node is still seen by its
    ``fanout`` predecessors (any one of them opens the next round, which every node follows). While
    any node lives, some loss is seen: the nearest live predecessor of a run of dead nodes watches
    the first of them. A fanout above 1 covers a watcher that is itself slow. ``fanout`` <= 0
    watches everyone (the O(N^2) behaviour).
    """
    others = [p for p in participants if p != me]
    if fanout <= 0 or fanout >= len(others) or me not in participants:
        return others
    index = list(participants).index(me)
    count = len(participants)
    return [participants[(index + step) % count] for step in range(1, fanout + 1)]
