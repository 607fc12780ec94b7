"""The Storage interface: a flat key -> bytes store under one root (a directory or an S3 prefix).

Every implementation passes ``tests/contract/test_storage_contract.py`` unchanged.

Invariants all implementations keep:
- Keys are ``/``-separated paths relative to the root: never absolute, never empty, no empty,
  ``.`` or ``..`` segments, no backslashes or NUL bytes. So a key read from an untrusted manifest
  can never name anything outside the root.
- ``put`` is atomic: a reader sees the old object, the new object, or no object; never a prefix.
- Every failure surfaces as a ``StorageError`` (``StorageNotFoundError`` for a missing key,
  ``StorageAuthError`` for refused credentials or a wrong bucket owner). No ``OSError`` or botocore
  exception leaks, and no message carries a credential.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from resilrun.errors import StorageError

__all__ = ["Storage", "check_key", "check_prefix", "clip_range"]

_FORBIDDEN_CHARS = ("\\", "\x00")


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise ``StorageError``.

    Raises:
        StorageError: the key is empty, absolute, or has an empty, ``.`` or ``..`` segment.
    """
    if not isinstance(key, str) or not key:
        raise StorageError(f"storage key {key!r} is empty or not a string")
    if key.startswith("/") or any(ch in key for ch in _FORBIDDEN_CHARS):
        raise StorageError(f"storage key {key!r} must be a relative '/'-separated path")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise StorageError(f"storage key {key!r} has an empty, '.' or '..' segment")
    return key


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is ``""`` or a safe key prefix (a trailing ``/`` is allowed)."""
    if prefix == "":
        return prefix
    check_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def clip_range(start: int, end: int, size: int) -> tuple[int, int]:
    """Clip the half-open range ``[start, end)`` to an object of ``size`` bytes.

    Raises:
        ValueError: ``start`` is negative or ``end < start`` (a programmer error).
    """
    if start < 0 or end < start:
        raise ValueError(f"invalid byte range [{start}, {end})")
    return min(start, size), min(end, size)


class Storage(ABC):
    """A flat key -> bytes store. Implementations are safe to share between threads."""

    #: Where this storage lives, for messages (``s3://bucket/prefix`` or a path); no credentials.
    uri: str

    @abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` under ``key`` atomically, replacing any previous object.

        Raises:
            StorageError: the write failed; a previous object under ``key`` is left intact.
        """

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole object.

        Raises:
            StorageNotFoundError: no object under ``key``.
            StorageError: the read failed.
        """

    @abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Return bytes ``[start, end)`` of the object, shorter if the object is shorter.

        Used to read a header without downloading the whole file; never allocates more than the
        object holds, whatever ``end`` says.

        Raises:
            StorageNotFoundError: no object under ``key``.
            StorageError: the read failed.
            ValueError: ``start < 0`` or ``end < start``.
        """

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(start, end)`` range of one object, in order, as ``get_range`` would
        return them. Why a method: a resharded restore reads many ranges of one file, which a
        directory serves best through one open file and an object store through concurrent requests.

        Raises:
            As ``get_range``.
        """
        return [self.get_range(key, start, end) for start, end in ranges]

    @abstractmethod
    def size(self, key: str) -> int:
        """Return the object's size in bytes.

        Raises:
            StorageNotFoundError: no object under ``key``.
            StorageError: the request failed.
        """

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Return every key that starts with ``prefix`` (a plain string prefix), sorted.

        Raises:
            StorageError: the listing failed.
        """

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Return whether an object is stored under ``key``.

        Raises:
            StorageError: the request failed (absence is ``False``, not an error).
        """

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object under ``key``; deleting a missing key is not an error (idempotent).

        Raises:
            StorageError: the request failed.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
