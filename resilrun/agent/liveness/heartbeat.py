"""Liveness: each agent bumps a counter in the store; every agent judges the others' counters.

Heartbeats are counters, never timestamps: a watcher records, on its own monotonic clock, when it
last saw a node's counter change, so clock skew between machines cannot make a live node look dead
(or a dead one alive). A node is stale when its counter has not moved for the heartbeat timeout.

Only time the watcher actually spent watching counts: when two of its observations of a node are
further apart than half the timeout, the watcher itself was blind (its store reads were stalled,
e.g. during an etcd leader election, or its process was descheduled), and the senders' writes were
most likely stalled by the same cause; the excess is not held against the node. Without this, a
store hiccup longer than the timeout made every node declare every other node lost at once.

On a store with leases (etcd: ``RendezvousBackend.lease_key``) a node beats by renewing a lease of
its own instead, which holds its *alive* key (no store write per beat), and watchers follow that
key by watch (no read per check). The key is gone once the lease expired: its watchers then count
the node silent for the lease's TTL (``StalenessJudge.observe_silence``). The TTL is the timeout
less one interval, so the node is *pending* (silent past half the timeout) from its expiry and
stale one interval later, as a stopped counter would be: nodes that died together are still
judged together.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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

    def observe_silence(self, node: str, silent_s: float) -> None:
        """The store says ``node`` has been silent for at least ``silent_s`` (its lease expired).

        Its silence counts from then; a later call never moves that earlier than it already is
        (the same expiry read again, or the node revived since by its own proof of life)."""
        now = self.clock.monotonic()
        since = now - silent_s
        previous = self._seen.get(node)
        if previous is not None and previous[0] == SILENT:
            since = max(since, previous[1])
        self._seen[node] = (SILENT, since, now)

    def observe_reading(self, node: str, reading: Reading) -> None:
        if reading.silent_s is None:
            self.observe(node, reading.counter)
        else:
            self.observe_silence(node, reading.silent_s)

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


def lease_ttl_s(interval_s: float, timeout_s: float) -> int:
    """The TTL of a node's liveness lease: the timeout less one interval (see the module
    docstring), in the whole seconds a lease has, at least one (the store may raise it)."""
    return max(1, int(timeout_s - interval_s))


class Heartbeat:
    """One node's heartbeat, one beat per ``beat()``: a counter bump, or a renewal of the node's
    liveness lease where the store has leases (created here: its key is then present)."""

    def __init__(
        self, backend: RendezvousBackend, run_id: str, node_id: str, *, interval_s: float, timeout_s: float
    ) -> None:
        self._backend = backend
        self._key = keys.node_heartbeat(run_id, node_id)
        ttl = lease_ttl_s(interval_s, timeout_s)
        self.lease = backend.lease_key(keys.node_alive(run_id, node_id), str(ttl).encode(), ttl)
        # A lease is renewed three times per TTL (two renewals may fail before it expires); a
        # counter is bumped every interval, as watchers check it.
        self.period_s = interval_s if self.lease is None else max(interval_s, self.lease.ttl_s / 3)

    def beat(self) -> None:
        """Raises: ResilrunError (StoreConnectionError): the store did not take it."""
        if self.lease is None:
            self._backend.add(self._key, 1)
        else:
            self.lease.refresh()

    def close(self) -> None:
        if self.lease is not None:
            self.lease.close()


class HeartbeatSender:
    """A daemon thread that beats every period (failures are logged once)."""

    def __init__(
        self,
        backend: RendezvousBackend,
        run_id: str,
        node_id: str,
        interval_s: float,
        clock: Clock | None = None,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """``timeout_s``: the heartbeat timeout (the lease's TTL follows from it; None: 5 intervals)."""
        self._clock = clock or SystemClock()
        # When the newest beat that reached the store began (this node's monotonic clock): a
        # watcher saw it no earlier, so it cannot judge this node lost before this plus the
        # heartbeat timeout (the write fence's lease). One float: readers see a whole value.
        self.confirmed_at: float | None = None
        began = self._clock.monotonic()
        timeout = 5 * interval_s if timeout_s is None else timeout_s
        self._heartbeat = Heartbeat(backend, run_id, node_id, interval_s=interval_s, timeout_s=timeout)
        if self._heartbeat.lease is not None:
            self.confirmed_at = began  # the lease was granted and its key written
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="resilrun-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = self._clock.monotonic()
            try:
                self._heartbeat.beat()
                self.confirmed_at = began
                self._failing = False
            except ResilrunError as exc:
                if not self._failing:
                    logger.warning("heartbeat to the store failed: %s", exc.message)
                self._failing = True
            self._stop.wait(self._heartbeat.period_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._heartbeat.period_s + 5)
        self._heartbeat.close()


@dataclass(frozen=True, slots=True)
class Reading:
    """What the store says of one node's heartbeat: a counter that moves while it beats, and,
    where its liveness lease expired, how long it has been silent at least."""

    counter: int
    silent_s: float | None = None


# The counter of a node whose liveness key is absent (expired, or never seen): one value, so that
# a key read as absent once its watch broke does not restart the silence counted since it went.
SILENT = -1


def read_heartbeats(
    backend: RendezvousBackend,
    run_id: str,
    nodes: Iterable[str],
    *,
    watch: bool = True,
    pushed_only: bool = False,
    clock: Clock | None = None,
) -> dict[str, Reading]:
    """The heartbeats of ``nodes``: their counters (one small read each), or on a store with
    leases their liveness keys, followed by watches (``watch``: no read per check; False: one
    batched read, for a one-off look at many nodes).

    ``pushed_only``: only what the store has pushed, asking it nothing (nodes whose watch is not
    current, and every node on a store without leases, are left out). Such a look is free, so a
    watcher can take it at every monitor tick, judging an expiry within a tick of hearing it
    rather than at its next heartbeat check; a store whose streams all broke (an etcd restart)
    is then not asked N reads per tick. ``clock``: this process's monotonic clock, which the
    watches' times are on (None: the system's; the unit tests pass a fake one)."""
    node_list = list(nodes)
    if not node_list:
        return {}
    if not backend.leases():
        if pushed_only:
            return {}
        return {node: Reading(backend.add(keys.node_heartbeat(run_id, node), 0)) for node in node_list}
    now = (clock or SystemClock()).monotonic()
    moving = int(now * 1000)  # a counter that moves at every check: the node's key is present
    readings: dict[str, Reading] = {}
    unknown = []
    for node in node_list:
        presence = backend.watch_presence(keys.node_alive(run_id, node)) if watch else None
        seen = presence.seen() if presence is not None else None
        if presence is None or seen is None:
            if not pushed_only:
                unknown.append(node)  # not watched, or its stream is not current: read the key
        elif seen[0] is not None:
            readings[node] = Reading(moving)
        elif presence.last_present is not None:
            readings[node] = Reading(SILENT, _ttl(presence.last_present) + now - seen[1])
        else:
            readings[node] = Reading(SILENT)  # never seen alive: silent since first looked at
    if unknown:
        values = backend.get_many([keys.node_alive(run_id, node) for node in unknown])
        for node, value in zip(unknown, values, strict=True):
            readings[node] = Reading(moving if value is not None else SILENT)
    return {node: readings[node] for node in node_list if node in readings}


def _ttl(value: bytes) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0


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
