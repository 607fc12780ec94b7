"""An in-process rendezvous backend for tests and simulations (thread-safe)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from resilrun.rendezvous.api import RendezvousBackend


class MemoryBackend(RendezvousBackend):
    """See base class; one lock makes compare-and-set and add atomic."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            return [self._data.get(key) for key in keys]

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._data[key] = bytes(value)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        with self._lock:
            current = self._data.get(key)
            if current != expected:
                return current == desired
            self._data[key] = bytes(desired)
            return True

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            return value
