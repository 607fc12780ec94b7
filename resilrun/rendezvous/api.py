"""The rendezvous backend contract: a tiny key-value store with counters and compare-and-set.

Every backend (TCPStore, in-memory, etcd) implements these calls and passes the one contract suite
in tests/contract. Values are bytes; a missing key reads as ``None``. Every call is bounded by the
backend's operation timeout and raises :class:`StoreConnectionError` on failure.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol

logger = logging.getLogger(__name__)


class KeyView(Protocol):
    """A key as the store pushes it (``RendezvousBackend.watch_key``)."""

    def seen(self) -> tuple[bytes | None, float] | None:
        """(its value, None when absent; when it last changed, on this process's monotonic
        clock), or None while the push is not known to be current (not started yet, or its
        stream broke and is being re-opened): the caller reads the key instead."""

    def close(self) -> None:
        """Stop watching."""


class LeasedKey(Protocol):
    """A key its writer holds alive on a lease of its own (``RendezvousBackend.lease_key``)."""

    ttl_s: int  # as granted: the store may raise a TTL below its minimum

    def refresh(self) -> None:
        """Renew the lease (re-creating key and lease if it expired meanwhile).

        Raises:
            StoreConnectionError: the store did not answer.
        """

    def close(self) -> None:
        """Stop renewing it: the key expires after its TTL."""


class Presence(KeyView, Protocol):
    """A leased key as a watch pushes it (``RendezvousBackend.watch_presence``)."""

    @property
    def last_present(self) -> bytes | None:
        """The value it last held while present (what an expired key said)."""


class RendezvousBackend(ABC):
    """Coordination data only: membership, counters and small status records, never tensors."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or ``None`` when it does not exist. Never blocks on absence."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys`` in order (``None`` for each absent one).

        What a barrier reads (one key per node: a counter could not make it idempotent). Backends
        answer it in as few requests as their store allows; this default, one ``get`` per key, keeps
        a wrapper that implements only the five calls correct.
        """
        return [self.get(key) for key in keys]

    @abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Write ``key`` unconditionally."""

    @abstractmethod
    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        """Write ``desired`` if the value is ``expected`` (``None``: key absent).

        Returns True when the key holds ``desired`` afterwards (written now, or already equal).
        """

    @abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add to an integer counter (created at 0) and return the new value.

        At least once on some stores (etcd: a retried request may apply twice), so a counter may
        only say "something changed" or hand out unique indices; what must count each node once
        (a barrier) is one key per node read with :meth:`get_many`.
        """

    def watch_key(self, key: str) -> KeyView | None:
        """A view of ``key`` that the store keeps current by pushing its changes, or None when
        this store cannot push (the caller reads, or polls a version counter).

        Why: every agent checks the rendezvous state every monitor interval; N agents polling
        even a tiny version counter ask the store for N/interval reads per second, all to learn
        that nothing moved, and re-read the O(N) document now and then in case a writer died
        between its write and its version bump. A store that can watch (etcd) answers both with
        one idle stream per agent that delivers each new document. The backend owns the watch:
        ``close`` ends it.
        """
        return None

    def watch_counter(self, key: str) -> KeyView | None:
        """A view of the counter at ``key`` (``add``; its value as decimal digits) that the store
        keeps current by pushing its changes, or None when this store cannot push. A counter
        carries no MAC (sealed.py), so it is watched apart from the sealed values ``watch_key`` opens.

        Why: a node waiting for a counter to move (the rendezvous' phase, the arrivals lane's
        hint) polls it otherwise: N nodes waiting ask the store for N reads per poll period."""
        return None

    def leases(self) -> bool:
        """Whether ``lease_key`` holds keys on leases here (then nodes' liveness is leased, not counted)."""
        return False

    def lease_key(self, key: str, value: bytes, ttl_s: int) -> LeasedKey | None:
        """Write ``key`` under a lease of its own that the caller renews, so that the key goes
        away ``ttl_s`` after its writer stops (a node's liveness); None when this store has no
        leases (the caller bumps a counter instead).

        Why: a counter bumped every heartbeat interval is a store write per node per interval,
        and on etcd every write is a raft proposal (1 ms of etcd's CPU through its gateway); a
        lease keep-alive is not, and the key's expiry tells its watchers without any reads.
        """
        return None

    def watch_presence(self, key: str) -> Presence | None:
        """A pushed view of a leased key (see ``lease_key``), or None when this store cannot push."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default has none."""


# Records a numbering counter hands out, read in batches of this many keys.
_NUMBERED_BATCH = 256
# Reading stops after this many batches: a counter anyone at the store can bump must not make a
# reader walk 10**12 absent keys.
_NUMBERED_MAX_BATCHES = 64


def read_numbered(backend: RendezvousBackend, key_of: Callable[[int], str], count: int) -> list[bytes]:
    """The values at ``key_of(1..count)`` that exist, in index order, where ``count`` is read from a
    counter that carries no MAC (rendezvous/sealed.py): its writers take an index, then write there.

    Bounded against a bumped counter: from index 1 up to the first batch in which nothing exists
    (records are written right after their index is taken, so real ones are dense), and the last
    batch below ``count`` (records written after a bump sit there), at most
    ``_NUMBERED_MAX_BATCHES`` batches in all."""
    found: list[bytes] = []
    start, batches = 1, 0
    while start <= count and batches < _NUMBERED_MAX_BATCHES - 1:
        end = min(count, start + _NUMBERED_BATCH - 1)
        values = [v for v in backend.get_many([key_of(i) for i in range(start, end + 1)]) if v is not None]
        batches += 1
        found.extend(values)
        start = end + 1
        if not values:
            break
    if batches >= _NUMBERED_MAX_BATCHES - 1 and start <= count - _NUMBERED_BATCH:
        logger.warning(
            "read the first %d and the last %d of %d numbered records at %s: the rest are left out (a counter "
            "bumped at the store, or more records than a reader walks)",
            start - 1,
            _NUMBERED_BATCH,
            count,
            key_of(count),
        )
    tail = max(start, count - _NUMBERED_BATCH + 1)
    if tail <= count:
        found.extend(v for v in backend.get_many([key_of(i) for i in range(tail, count + 1)]) if v is not None)
    return found
