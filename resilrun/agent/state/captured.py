"""The captured folder of one node (``--capture-dir``): an unmodified script's own checkpoints,
kept in node memory, replicated to peers, persisted, and put back before its workers start.

Why a watched folder and not a file system of our own: the script writes where it always did, at
the speed of the page cache (``torch.save`` does not fsync), with nothing to mount and no
privileges; what it needs from resilrun is that the files it wrote outlive the node that wrote
them, and are where it looks when it starts again. So the agent watches the folder (inotify),
captures each file once it is complete, and at the start of every round writes into the folder
the newest complete version of every captured path that any tier holds: this node's memory, a
peer's (a replica, or the peer's own capture), or the persistent tier (signed ones only). At those
points the folder then behaves like a shared file system, which is what a torchrun script's
``if os.path.exists(path): load`` assumes; a host that replaces a lost one finds the files.

When is a file complete? When its writer closed it (IN_CLOSE_WRITE) or renamed it into place
(IN_MOVED_TO). The kernel also closes a killed writer's files, so a close is not proof: a file whose
format says how long it must be (torch.save's zip, safetensors, numpy) is checked (``complete``) and
captured at once (a script that rewrites one name in place must have each version read before its
next save); a file of another format is captured once it stayed unchanged for ``settle_s``, and not
if a worker of this node failed meanwhile (``worker_failed``). Pushes wait out ``settle_s`` too, so
a temporary file renamed into place (the atomic-save pattern) is never sent. A torn
file in the folder is replaced at the next round by the newest complete version (a script's
``torch.load`` of a half-written file would fail every restart after).
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import select
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from resilrun.agent.state.captured_restore import FolderRestore, Restored
from resilrun.errors import ResilrunError, StorageError
from resilrun.storage.api import Storage
from resilrun.tiers.captured import durable
from resilrun.tiers.captured.catalog import AGENT_PREFIX, Catalog, FileVersion, check_path, digest
from resilrun.tiers.captured.complete import describe_format, incomplete_reason, is_verifiable
from resilrun.tiers.captured.watch import ChangeKind, FolderWatch, scan
from resilrun.tiers.peer.files import drop_file, push_file
from resilrun.tiers.peer.wire import Credential

logger = logging.getLogger(__name__)

# A close or rename counts once the file stayed as it was this long (a temporary file renamed, a
# second write): short against any save interval, long against the agent noticing a worker's death.
SETTLE_S = 0.5
# Folders a script's run writes into that are never checkpoints (watched, never captured).
_SKIPPED_DIRS = frozenset({"__pycache__", ".git"})
# A push to a peer: a few seconds plus the bytes at a pessimistic 50 MB/s. Bounded, because a peer
# whose host was lost does not refuse the connection, it just never answers; the one ship thread
# (and, at the end, the agent's exit) would wait on it.
_PEER_BASE_S = 5.0
_PEER_FLOOR_BYTES_S = 50e6


def _peer_timeout(nbytes: int) -> timedelta:
    return timedelta(seconds=_PEER_BASE_S + nbytes / _PEER_FLOOR_BYTES_S)


# A restore's deadline: every file it fetches shares it (a multi-GB checkpoint over a slow link).
CAPTURED_RESTORE_S = 300.0
# Files ``describe`` lists: the status document is rewritten into the rendezvous store every
# heartbeat interval, so a folder of thousands of files (DCP shards, a long rotation) must not grow
# it without bound; about 150 bytes each, the newest ones are what a person looks for.
STATUS_FILES = 50


class CapturedFolder:
    """One node's captured folder (see the module). ``start`` once, ``restore`` before each round's
    workers, ``worker_failed`` when a worker of this node failed, ``close`` at the end."""

    def __init__(
        self,
        root: Path,
        catalog: Catalog,
        node_id: str,
        *,
        pattern: str = "*",
        secret: Credential | None = None,
        targets: Callable[[], list[str]] = list,
        peers: Callable[[], list[str]] = list,
        storage: Storage | None = None,
        mac_key: bytes | None = None,
        may_write: Callable[[], bool] = lambda: True,
        record: Callable[..., Any] | None = None,
        settle_s: float = SETTLE_S,
    ) -> None:
        """``targets``: replica servers this node pushes its captures to (``--replicas`` next nodes);
        ``peers``: every other node's, asked at a restore; ``storage``/``mac_key``: the persistent
        tier and its key (None: captures are not signed, and none is restored from storage);
        ``may_write``: the write fence, asked before each upload; ``record(event, **fields)``: events."""
        self.root = root
        self.catalog = catalog
        self.node_id = node_id
        self.pattern = pattern
        self._secret = secret
        self._targets = targets
        self._storage = storage
        self._mac_key = mac_key
        self._may_write = may_write
        self._record = record
        self._settle_s = settle_s
        self._watch: FolderWatch | None = None
        self._lock = threading.RLock()  # one reader of the watch and of the pending captures at a time
        self._pending: dict[str, float] = {}  # path -> monotonic time of its last change
        self._ship: deque[tuple[float, str, FileVersion]] = deque()  # (due, "push" | "drop", version)
        self._ship_cond = threading.Condition()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._restore = FolderRestore(
            root, catalog, self._wanted, secret=secret, peers=peers, storage=storage, mac_key=mac_key
        )
        # path -> (order, targets that hold it, persisted) of this node's captures as shipped so far:
        # written by the ship thread, read by the watch thread, a restore and the status thread.
        self._shipped: dict[str, tuple[tuple[int, str], frozenset[str], bool]] = {}
        self._shipped_lock = threading.Lock()

    # -- life ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Watch the folder (made if missing) and capture the complete files already in it.

        Raises:
            ResilrunError: the folder cannot be made or watched.
        """
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ResilrunError(f"--capture-dir {self.root}: cannot be made: {exc.strerror}") from exc
        self._watch = FolderWatch(self.root)
        with self._lock:
            for path in scan(self.root):
                if self._wanted(path):
                    self._capture(path, settled=True, initial=True)
        for target, name in ((self._watch_loop, "resilrun-capture"), (self._ship_loop, "resilrun-capture-ship")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        logger.info(
            "capturing %s%s: %d complete file(s) there now",
            self.root,
            f" (files matching {self.pattern})" if self.pattern != "*" else "",
            len(self.catalog.versions()),
        )

    def close(self, timeout_s: float = 30.0, *, workers_failed: bool = False) -> None:
        """Capture what was closed and not yet settled (as after a worker's failure if
        ``workers_failed``: the job ended on one), ship what is queued (bounded), then stop."""
        if self._watch is not None and not self._closed.is_set():
            with self._lock:
                self._pump(force=True, suspect=workers_failed)
        self._closed.set()
        with self._ship_cond:
            self._ship_cond.notify_all()
        end = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        if self._watch is not None:
            self._watch.close()

    # -- capture -------------------------------------------------------------------------------
    def _wanted(self, path: str) -> bool:
        parts = path.split("/")
        if any(p in _SKIPPED_DIRS or p.startswith(AGENT_PREFIX) for p in parts):
            return False
        return fnmatch.fnmatchcase(path, self.pattern)

    def _watch_loop(self) -> None:
        assert self._watch is not None
        fd = self._watch.fileno()
        while not self._closed.is_set():
            wait = self._settle_s if self._pending else 1.0
            with contextlib.suppress(OSError, ValueError):
                select.select([fd], [], [], wait)
            if self._closed.is_set():
                return
            with self._lock:
                try:
                    self._pump(force=False, suspect=False)
                except Exception:  # a bug here must not stop the captures silently
                    logger.exception("capturing %s failed unexpectedly", self.root)

    def _pump(self, *, force: bool, suspect: bool) -> None:
        """Read every change queued now and capture what is complete; files of a format that cannot
        show it wait to settle (all are taken, if ``force``). Under the lock."""
        assert self._watch is not None
        now = time.monotonic()
        for change in self._watch.read(0.0):
            if not self._wanted(change.path):
                continue
            if change.kind is ChangeKind.WRITTEN:
                # At once: a script that rewrites one name in place (the tutorial's torch.save)
                # must have each version read before the next save opens it again.
                if not self._capture(change.path, settled=False):
                    self._pending.setdefault(change.path, now)  # from the first close on
            else:
                self._pending.pop(change.path, None)
                self._removed(change.path)
        for path, changed in list(self._pending.items()):
            if force or now - changed >= self._settle_s:
                del self._pending[path]
                self._capture(path, settled=True, suspect=suspect)

    def worker_failed(self) -> None:
        """A worker of this node failed: what it closed as it died may be torn. Files whose format
        proves them complete were captured as they closed; the others not yet settled are dropped."""
        if self._watch is None:
            return
        with self._lock:
            self._pump(force=True, suspect=True)

    def _capture(self, path: str, *, settled: bool, suspect: bool = False, initial: bool = False) -> bool:
        """Capture ``path`` if it is complete; False: look again once it settles (still being
        written, or of a format that cannot show its end). ``initial``: a file found at start,
        ordered by its mtime (when it was written) rather than by now, so that a peer's newer
        capture of the same path still wins."""
        full = self.root / path
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return True  # gone again (a temporary file renamed away), or a link
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                return True
            with os.fdopen(os.dup(fd), "rb") as reader:
                data = reader.read()
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns) or len(data) != after.st_size:
            return False  # written to while read
        held = self.catalog.newest(path)
        if held is not None and (held.size, held.mtime_ns) == (after.st_size, after.st_mtime_ns):
            return True  # what a restore wrote, or unchanged
        reason = incomplete_reason(path, data)
        if reason is not None:
            logger.warning("%s not captured: %s", full, reason)
            return True
        kind = describe_format(data)
        checked = is_verifiable(path, data)  # its format showed it complete (not merely "not torn")
        if not checked and not (settled or initial):
            return False
        if not checked and suspect:
            logger.warning(
                "%s not captured: closed as a worker of this node failed, and its format cannot show whether "
                "it is complete; the newest complete version is put back before the workers restart",
                full,
            )
            return True
        version = FileVersion(
            check_path(path),
            len(data),
            digest(data),
            after.st_mtime_ns,
            after.st_mtime_ns if initial else time.time_ns(),
            self.node_id,
        )
        if not self.catalog.put(version, data, own=True):
            return True
        if self.catalog.read(path, version.sha256) is None:
            logger.error(
                "captured %s (%d bytes) is not kept in node memory: too little memory left; it stays in the "
                "folder and is still persisted",
                full,
                len(data),
            )
        logger.debug("captured %s (%s, %d bytes)", full, kind, len(data))
        if self._record is not None:
            self._record("file_captured", path=path, bytes=len(data), format=kind)
        self._queue("push", version, delay_s=self._settle_s)
        return True

    def _removed(self, path: str) -> None:
        if (self.root / path).exists():
            return  # replaced by a rename: its WRITTEN follows
        removed = self.catalog.remove(path)
        if removed is not None and removed.node == self.node_id and self._shipped_record(removed.path) is not None:
            self._queue("drop", removed)

    # -- shipping to peers and storage ----------------------------------------------------------
    def _queue(self, what: str, version: FileVersion, delay_s: float = 0.0) -> None:
        """Ship ``version`` (``push``, or ``drop``: the script deleted it) once ``delay_s`` passed:
        a push waits out the settle time, so a temporary file renamed away meanwhile (the atomic
        save pattern) is never sent, and a file rewritten meanwhile is sent once."""
        with self._ship_cond:
            self._ship.append((time.monotonic() + delay_s, what, version))
            self._ship_cond.notify()

    def _ship_loop(self) -> None:
        while True:
            with self._ship_cond:
                while not self._closed.is_set():
                    wait = self._ship[0][0] - time.monotonic() if self._ship else None
                    if wait is not None and wait <= 0:
                        break
                    self._ship_cond.wait(wait)
                if not self._ship:
                    return
                _, what, version = self._ship.popleft()  # once closing: the rest at once
            try:
                if what == "push":
                    self._push(version)
                else:
                    self._drop(version)
            except Exception:
                logger.exception("shipping captured %s failed unexpectedly", version.path)

    def _bytes_of(self, version: FileVersion) -> bytes | None:
        held = self.catalog.read(version.path, version.sha256)
        if held is not None:
            return held[1]
        try:  # not kept in memory: the folder's copy, if it is still that version
            data = (self.root / version.path).read_bytes()
        except OSError:
            return None
        return data if digest(data) == version.sha256 else None

    def _push(self, version: FileVersion) -> None:
        """Replicate to the targets that lack it and persist it, unless superseded or removed meanwhile."""
        newest = self.catalog.newest(version.path)
        if newest is None or newest.order != version.order:
            return
        data = self._bytes_of(version)
        if data is None:
            return
        order, holding, persisted = self._shipped_record(version.path) or (version.order, frozenset(), False)
        if order != version.order:
            holding, persisted = frozenset(), False
        if self._secret is not None and not self._closed.is_set():  # (at the job's end: storage only)
            for address in self._targets():
                if address in holding:
                    continue
                try:
                    push_file(address, self._secret, version, data, _peer_timeout(len(data)))
                    holding |= {address}
                except ResilrunError as exc:
                    logger.warning("captured %s not replicated to %s: %s", version.path, address, exc.message)
        if self._storage is not None and not persisted and self._may_write():
            try:
                durable.write(self._storage, version, data, self._mac_key)
                persisted = True
            except StorageError as exc:
                logger.error("captured %s not persisted: %s", version.path, exc.message)
        with self._shipped_lock:
            self._shipped[version.path] = (version.order, holding, persisted)

    def _shipped_record(self, path: str) -> tuple[tuple[int, str], frozenset[str], bool] | None:
        with self._shipped_lock:
            return self._shipped.get(path)

    def _reship(self) -> None:
        """Queue this node's captures that the current targets or storage lack: those captured
        before the first round (no targets, the write fence closed) or before the targets changed."""
        targets = frozenset(self._targets()) if self._secret is not None else frozenset()
        for version in self.catalog.versions():
            if version.node != self.node_id:
                continue
            order, holding, persisted = self._shipped_record(version.path) or ((-1, ""), frozenset(), False)
            if order != version.order or not targets <= holding or (self._storage is not None and not persisted):
                self._queue("push", version)

    def _drop(self, version: FileVersion) -> None:
        if self._secret is not None:
            for address in self._targets():
                try:
                    drop_file(address, self._secret, version, _peer_timeout(0))
                except ResilrunError as exc:
                    logger.debug("peer %s not told of %s's removal: %s", address, version.path, exc.message)
        if self._storage is not None and self._may_write():
            try:
                durable.delete(self._storage, version)
            except StorageError as exc:
                logger.warning("captured %s not removed from the persistent tier: %s", version.path, exc.message)

    # -- status --------------------------------------------------------------------------------
    def describe(self, limit: int = STATUS_FILES) -> dict[str, Any]:
        """This folder as ``resilrun status`` shows it (``nodes[].captured``, docs/status.md): the
        newest ``limit`` files by capture time, listed by path, and the tiers holding each.

        Why here and not in the status publisher: which peers hold a file is known only to the ship
        thread's records, and only those of the version the catalog holds now count (a record of an
        older version of the path says nothing of the newer one). Callable from any thread; it never
        waits for a restore or a capture (their lock is not taken).
        """
        held = self.catalog.held()
        targets = frozenset(self._targets()) if self._secret is not None else frozenset()
        with self._shipped_lock:
            shipped = {version.path: self._shipped.get(version.path) for version, own, _ in held if own}
        newest = sorted(held, key=lambda item: item[0].order, reverse=True)[: max(0, limit)]
        files: list[dict[str, Any]] = []
        for version, own, kept in sorted(newest, key=lambda item: item[0].path):
            record = shipped.get(version.path)
            if record is not None and record[0] != version.order:
                record = None  # what was shipped is an older version of the path
            entry: dict[str, Any] = {
                "path": version.path,
                "bytes": version.size,
                "captured_at": round(version.captured_ns / 1e9, 3),
                "own": own,
                "memory": kept,
                "replicas": None,  # a peer's file held here: its own node knows its tiers
                "persisted": None,
            }
            if own:
                # Replicas on the peers that are targets now: a node that left no longer counts.
                entry["replicas"] = len(record[1] & targets) if record is not None else 0
                if self._storage is not None:  # (without --checkpoint-uri there is no such tier)
                    entry["persisted"] = record is not None and record[2]
            files.append(entry)
        return {
            "dir": str(self.root),
            "pattern": self.pattern,
            "files": files,
            "more_files": len(held) - len(files),
            "bytes_in_memory": sum(version.size for version, _, kept in held if kept),
        }

    # -- restore -------------------------------------------------------------------------------
    def restore(self, timeout_s: float) -> Restored:
        """Put the newest complete version of every captured path into the folder, from the fastest
        tier holding it (this node's memory, a peer, storage), before the workers start."""
        started = time.monotonic()
        with self._lock:
            if self._watch is not None:
                self._pump(force=True, suspect=False)
            report = self._restore.run(started + timeout_s)
            self._reship()
        report.seconds = time.monotonic() - started
        if report.files or report.missing:
            logger.info(
                "captured folder %s: put back %d file(s), %d bytes in %.2f s (%s)%s",
                self.root,
                len(report.files),
                report.nbytes,
                report.seconds,
                ", ".join(f"{n} from {tier}" for tier, n in sorted(report.sources.items())) or "none",
                f"; no tier could give {report.missing}" if report.missing else "",
            )
        if (report.incomplete or report.files or report.missing) and self._record is not None:
            self._record(
                "captured_restored",
                files=report.files,
                bytes=report.nbytes,
                sources=report.sources,
                missing=report.missing,
                incomplete=report.incomplete,
                seconds=round(report.seconds, 6),
            )
        return report
