"""The rendezvous backend contract: a tiny key-value store with counters and compare-and-set.

Every backend (TCPStore, in-memory, etcd) implements these calls and passes the one contract suite
in tests/contract. Values are bytes; a missing key reads as ``None``. Every call is bounded by the
backend's operation timeout and raises :class:`StoreConnectionError` on failure.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol


class CounterWatch(Protocol):
    """A counter's value as the store pushes it (``RendezvousBackend.watch_counter``)."""

    def value(self) -> int | None:
        """The newest value pushed so far; None while the push is not known to be current (not
        started yet, or its stream broke and is being re-opened): the caller reads the counter."""

    def close(self) -> None:
        """Stop following the counter."""


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

    def watch_counter(self, key: str) -> CounterWatch | None:
        """A view of counter ``key`` that the store keeps current by pushing its changes, or None
        when this store cannot push (the caller polls with ``add(key, 0)``).

        Why: every agent checks the rendezvous version counter every monitor interval; N agents
        polling it ask the store for N/interval reads per second, all to learn that nothing moved.
        A store that can watch (etcd) answers that with one idle stream per agent. The backend owns
        the watch: ``close`` ends it.
        """
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default has none."""
