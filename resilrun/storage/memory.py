"""In-memory Storage: a dict behind a lock, shipped in the package for tests and single-process use.

Invariants: stored values are immutable ``bytes`` copies, so a caller that reuses its buffer after
``put`` cannot change what was stored; every method takes the one lock, so threads see whole objects.
"""

from __future__ import annotations

import threading

from resilrun.errors import StorageNotFoundError
from resilrun.storage.api import Storage, check_key, check_prefix, clip_range


class MemoryStorage(Storage):
    """See ``Storage``; ``uri`` is ``memory://<name>``."""

    def __init__(self, name: str = "default") -> None:
        self.uri = f"memory://{name}"
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes | memoryview) -> None:
        """See base class."""
        check_key(key)
        value = bytes(data)
        with self._lock:
            self._objects[key] = value

    def _value(self, key: str) -> bytes:
        with self._lock:
            value = self._objects.get(check_key(key))
        if value is None:
            raise StorageNotFoundError(f"no object '{key}' in {self.uri}")
        return value

    def get(self, key: str) -> bytes:
        """See base class."""
        return self._value(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """See base class."""
        value = self._value(key)
        start, end = clip_range(start, end, len(value))
        return value[start:end]

    def size(self, key: str) -> int:
        """See base class."""
        return len(self._value(key))

    def list(self, prefix: str = "") -> list[str]:
        """See base class."""
        check_prefix(prefix)
        with self._lock:
            return sorted(key for key in self._objects if key.startswith(prefix))

    def exists(self, key: str) -> bool:
        """See base class."""
        with self._lock:
            return check_key(key) in self._objects

    def delete(self, key: str) -> None:
        """See base class."""
        with self._lock:
            self._objects.pop(check_key(key), None)
