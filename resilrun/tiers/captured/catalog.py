"""What a node holds of a captured folder: the newest complete version of each file, in memory.

A *version* names a file's bytes by SHA-256 and says when and where it was captured. The newest
version of a path wins: ordered by capture time (the capturing agent's wall clock, in ns), then by
node id. One script writing one path from one node is ordered exactly; two nodes writing the same
path (a script that saves on every node's local rank 0) write the same bytes at about the same time,
so either is right. Wall clocks, not steps: the script's files carry no step resilrun can read.

A node keeps its own captures and the replicas its peers pushed in one ``Catalog``: a restore, a
peer's fetch and ``resilrun status`` read them alike. Bytes are kept only while the node has memory
to spare (``MemoryBudget``): a version too large to keep is still listed, its bytes then read back
from the folder (own captures) or missing (a replica: the sender is told, and storage still has it).
"""

from __future__ import annotations

import hashlib
import posixpath
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from resilrun.errors import CheckpointError

# A path component the agent uses for its own temporary files in the folder (never captured).
AGENT_PREFIX = ".resilrun-"
MAX_PATH_CHARS = 4096


def check_path(path: Any) -> str:
    """``path`` if it is a safe relative POSIX path inside a captured folder, else CheckpointError.

    Why: paths come from peers and from storage; one with ``..``, an absolute one or one naming the
    agent's own temporary files would make a restore write outside the folder or over its own work.
    """
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS or "\x00" in path:
        raise CheckpointError(f"captured file path {str(path)[:80]!r} is empty, too long or not text")
    if path.startswith("/") or "\\" in path or posixpath.normpath(path) != path:
        raise CheckpointError(f"captured file path {path[:80]!r} is not a plain relative path")
    if any(part in ("", ".", "..") or part.startswith(AGENT_PREFIX) for part in path.split("/")):
        raise CheckpointError(f"captured file path {path[:80]!r} has a '..', '.' or agent-owned component")
    return path


@dataclass(frozen=True, slots=True)
class FileVersion:
    """One complete version of one captured file."""

    path: str  # relative POSIX path inside the folder
    size: int
    sha256: str  # hex
    mtime_ns: int  # as written in the capturing node's folder (a restore writes it back)
    captured_ns: int  # the capturing agent's wall clock: the order of versions
    node: str  # the capturing agent's node id

    @property
    def order(self) -> tuple[int, str]:
        return (self.captured_ns, self.node)

    def to_message(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "sha256": self.sha256,
            "mtime_ns": self.mtime_ns,
            "captured_ns": self.captured_ns,
            "node": self.node,
        }

    @classmethod
    def from_message(cls, message: Any) -> FileVersion:
        """Raises CheckpointError: a field is missing or malformed (from a peer or storage)."""
        if not isinstance(message, dict):
            raise CheckpointError("a captured file's description is not an object")
        ints = [message.get(name) for name in ("size", "mtime_ns", "captured_ns")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            raise CheckpointError("a captured file's size or times are not non-negative integers")
        digest, node = message.get("sha256"), message.get("node")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise CheckpointError("a captured file's sha256 is not 64 hex digits")
        if not isinstance(node, str) or len(node) > 512:
            raise CheckpointError("a captured file's node is not a short text")
        return cls(check_path(message.get("path")), ints[0], digest, ints[1], ints[2], node)  # type: ignore[arg-type]


def digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class _Entry:
    version: FileVersion
    data: bytes | None  # None: listed, bytes not kept (memory ran short)
    own: bool  # captured on this node (else a peer's replica)


class MemoryBudget:
    """How many bytes the catalog may keep: what the node has available less a headroom, asked at
    each put (the script's tensors and the snapshot tiers share the same memory)."""

    def __init__(self, available: Callable[[], int], headroom: int) -> None:
        self._available = available
        self._headroom = headroom

    def allows(self, nbytes: int) -> bool:
        return nbytes + self._headroom <= self._available()


class Catalog:
    """The newest version of each captured path this node holds, own or a peer's, with its bytes.

    Thread-safe: the capture thread, the replica server's threads and a restore share it.
    """

    def __init__(self, budget: MemoryBudget | None = None) -> None:
        self._budget = budget
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def newest(self, path: str) -> FileVersion | None:
        with self._lock:
            entry = self._entries.get(path)
            return entry.version if entry is not None else None

    def versions(self) -> list[FileVersion]:
        with self._lock:
            return sorted((e.version for e in self._entries.values()), key=lambda v: v.path)

    def held(self) -> list[tuple[FileVersion, bool, bool]]:
        """(version, own, bytes kept) of every path: what ``resilrun status`` shows."""
        with self._lock:
            return [(e.version, e.own, e.data is not None) for e in sorted(self._entries.values(), key=_path)]

    def put(self, version: FileVersion, data: bytes | None, *, own: bool) -> bool:
        """Hold ``version`` if it is newer than what is held for its path (True), with its bytes if
        the budget allows. ``data`` must hash to the version's sha256 (the caller checked it)."""
        with self._lock:
            held = self._entries.get(version.path)
            if held is not None and held.version.order >= version.order:
                return False
            kept = data if data is not None and (self._budget is None or self._budget.allows(len(data))) else None
            self._entries[version.path] = _Entry(version, kept, own)
            return True

    def read(self, path: str, sha256: str | None = None) -> tuple[FileVersion, bytes] | None:
        """The bytes of ``path``'s newest version (of that sha256, if given), when kept here."""
        with self._lock:
            entry = self._entries.get(path)
        if entry is None or entry.data is None or (sha256 is not None and entry.version.sha256 != sha256):
            return None
        return entry.version, entry.data

    def remove(self, path: str, *, upto: tuple[int, str] | None = None) -> FileVersion | None:
        """Forget ``path`` (the script deleted it): only a version no newer than ``upto`` if given,
        so that a late deletion notice does not remove a newer write."""
        with self._lock:
            entry = self._entries.get(path)
            if entry is None or (upto is not None and entry.version.order > upto):
                return None
            del self._entries[path]
            return entry.version

    def nbytes(self) -> int:
        with self._lock:
            return sum(len(e.data) for e in self._entries.values() if e.data is not None)


def _path(entry: _Entry) -> str:
    return entry.version.path
