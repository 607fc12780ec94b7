"""The rendezvous backend contract: a tiny key-value store with counters and compare-and-set.

Every backend (TCPStore, in-memory, later etcd) implements these five calls and passes the one
contract suite in tests/contract. Values are bytes; a missing key reads as ``None``. Every call
is bounded by the backend's operation timeout and raises :class:`StoreConnectionError` on failure.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class RendezvousBackend(ABC):
    """Coordination data only: membership, counters and small status records, never tensors."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or ``None`` when it does not exist. Never blocks on absence."""

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
        """Atomically add to an integer counter (created at 0) and return the new value."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default has none."""
