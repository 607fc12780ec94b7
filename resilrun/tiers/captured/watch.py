"""Which files under a capture folder were written or removed: inotify over libc, recursively (Linux only).

The agent captures what an unmodified training script writes into ``--capture-dir``; this module only
says *which names changed*, never whether a file is complete (``complete.py`` and a settle delay do
that: the kernel reports IN_CLOSE_WRITE when it closes a killed writer's descriptor too).

Invariants:
- every directory under the root is watched, including ones created or moved in later; a new
  directory's regular files are reported as WRITTEN once its watch is in place, so a file written
  into it before the watch existed is not missed (it may be reported twice: callers collapse);
- REMOVED is reported only for a name this watch knows (seen at start, WRITTEN since, or found by a
  scan), so a symlink, a FIFO or a file deleted before it was ever closed is never reported;
- names with ``IGNORED_PREFIX`` in any component are the agent's own and never reported; folders
  with it are not watched at all;
- symlinks are neither followed nor reported; a folder renamed within the tree is reported as its
  files REMOVED under the old names and WRITTEN under the new;
- a file made with O_TMPFILE and linked into place has no close under its name: it is not reported
  (a new hard link to a written file, os.link, is);
- after a queue overflow the whole tree is scanned again (``rescan``): nothing is lost, at the
  price of duplicates.

Changes come back in the order the kernel reported them; ``read`` is meant for one thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import errno
import functools
import logging
import os
import select
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import NamedTuple

from resilrun.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

IGNORED_PREFIX = ".resilrun-"

# <sys/inotify.h>; these values are the kernel ABI and the same on every Linux architecture.
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

# IN_EXCL_UNLINK: a writer that keeps writing to a file after it was deleted must not report its
# close under a name that is gone (or taken by a new file). IN_DONT_FOLLOW: a symlinked folder is
# not part of the tree (the root itself may be a symlink: it is what the user named).
_DIR_MASK = (
    IN_CLOSE_WRITE | IN_MOVED_TO | IN_MOVED_FROM | IN_CREATE | IN_DELETE | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK
)
_ROOT_MASK = (_DIR_MASK & ~IN_DONT_FOLLOW) | IN_DELETE_SELF

_EVENT = struct.Struct("iIII")  # struct inotify_event: int wd; uint32 mask, cookie, len; char name[len]
# One read returns whole events only, and must fit the largest (header + NAME_MAX + 1); a bigger buffer
# drains a busy queue (its default limit is 16384 events) in a few system calls.
_READ_BYTES = 64 * 1024
# Reads per read() call: bounds the work when a writer makes events faster than we drain them; what is
# left is returned by the next call.
_MAX_READS = 64


class ChangeKind(enum.Enum):
    """What happened to a name (not whether its bytes are complete)."""

    WRITTEN = "written"  # closed after being opened for writing, moved in, or found by a scan
    REMOVED = "removed"  # deleted, or moved away from this name


@dataclass(frozen=True, slots=True)
class Change:
    """One reported change: ``path`` is relative to the root, POSIX, e.g. ``ckpt/step_4/__0_0.distcp``."""

    path: str
    kind: ChangeKind


class InotifyEvent(NamedTuple):
    """One ``struct inotify_event`` as read from the descriptor (``name`` decoded with os.fsdecode)."""

    wd: int
    mask: int
    cookie: int
    name: str


def parse_events(data: bytes) -> list[InotifyEvent]:
    """Split what one read of an inotify descriptor returned into events.

    Args:
        data: the bytes of one or more ``read(2)`` calls (the kernel never splits an event).

    Returns:
        The events in order; a name is cut at its first NUL (the kernel pads names with NULs) and
        decoded with os.fsdecode, so odd bytes survive as surrogates.
    """
    events = []
    offset = 0
    while offset + _EVENT.size <= len(data):
        wd, mask, cookie, length = _EVENT.unpack_from(data, offset)
        offset += _EVENT.size
        raw = data[offset : offset + length].split(b"\0", 1)[0]
        offset += length
        events.append(InotifyEvent(wd, mask, cookie, os.fsdecode(raw)))
    return events


def scan(root: Path) -> list[str]:
    """Every regular file under ``root``: relative POSIX paths, sorted; symlinks and ignored names skipped."""
    return sorted(_walk(root, "", lambda folder: True))


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _walk(root: Path, top: str, enter: Callable[[str], bool]) -> list[str]:
    """The regular files of ``top`` and every folder below it, calling ``enter(folder)`` before listing one.

    ``enter`` returning False skips the folder: the watcher adds a folder's watch there, so a file
    written while the folder is being listed is either listed or reported by the watch. Folders that
    vanish meanwhile are skipped. Iterative, so a deep tree cannot exhaust the recursion limit.
    """
    files: list[str] = []
    pending = [top]
    while pending:
        folder = pending.pop()
        if not enter(folder):
            continue
        subfolders: list[str] = []
        try:
            with os.scandir(root / folder if folder else root) as entries:
                for entry in entries:
                    if entry.name.startswith(IGNORED_PREFIX):
                        continue
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            subfolders.append(_join(folder, entry.name))
                        elif entry.is_file(follow_symlinks=False):
                            files.append(_join(folder, entry.name))
                    except OSError:  # gone between readdir and stat
                        continue
        except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
            logger.debug("capture folder %s/%s cannot be listed: %s", root, folder, exc)
        pending.extend(reversed(subfolders))
    return files


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc's inotify calls, loaded on first use (not at import: the module must import anywhere)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.inotify_init1.argtypes = [ctypes.c_int]
    libc.inotify_init1.restype = ctypes.c_int
    libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    libc.inotify_add_watch.restype = ctypes.c_int
    libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.inotify_rm_watch.restype = ctypes.c_int
    return libc


class FolderWatch:
    """Reports the files written into and removed from a folder tree, as a list of ``Change`` per read.

    Life cycle: watching from construction until ``close()`` (idempotent, or leaving a ``with``
    block); once the root itself is deleted it stops quietly (``stopped``) and reads return [].
    """

    def __init__(self, root: Path) -> None:
        """Watch ``root`` and every folder below it.

        Raises:
            ConfigError: ``root`` does not exist or is not a folder.
            CheckpointError: the kernel refused an inotify instance or a watch (its limits).
        """
        self.root = Path(root)
        if not self.root.is_dir():
            problem = "is not a folder" if self.root.exists() else "does not exist"
            raise ConfigError(
                f"the capture folder {str(self.root)!r} {problem}",
                hint="Point --capture-dir at an existing folder: the one the script writes its checkpoints to.",
            )
        fd = _libc().inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise CheckpointError(
                f"could not watch {str(self.root)!r}: inotify_init1 failed: {os.strerror(code)}",
                hint="Too many inotify instances? Raise fs.inotify.max_user_instances (sysctl).",
            )
        self._fd = fd
        self._closed = False
        self._stopped = False
        self._overflowed = False
        self._folders: dict[int, str] = {}  # watch descriptor -> folder, relative ("" is the root)
        self._root_wd = -1
        self._files: set[str] = set()  # the names REMOVED may be reported for
        try:
            self._files.update(self._add_tree(""))
        except BaseException:
            self.close()
            raise
        self._root_wd = next((wd for wd, folder in self._folders.items() if folder == ""), -1)
        if self._root_wd < 0:  # the root vanished between the checks and the watch
            self.close()
            raise ConfigError(f"the capture folder {str(self.root)!r} disappeared while it was being watched")

    # -- public -------------------------------------------------------------------------------------
    def fileno(self) -> int:
        """The inotify descriptor: readable when changes are waiting (for a caller's own selector)."""
        if self._closed:
            raise ValueError("the folder watch is closed")
        return self._fd

    @property
    def stopped(self) -> bool:
        """True once closed, or once the root folder itself was deleted: no change will come any more."""
        return self._closed or self._stopped

    def read(self, timeout_s: float) -> list[Change]:
        """Wait up to ``timeout_s`` seconds for changes; return every change available then (maybe []).

        A WRITTEN file may still be incomplete (a killed writer's file is closed by the kernel, and a
        scan of a new folder reports files still being written): judge the bytes before keeping them.

        Raises:
            CheckpointError: a new folder could not be watched (the kernel's watch limit).
        """
        if self.stopped:
            return []
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        if not poller.poll(max(0, int(timeout_s * 1000))):
            return []
        chunks = []
        for _ in range(_MAX_READS):
            try:
                chunk = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return self._apply(parse_events(b"".join(chunks)))

    def rescan(self) -> list[Change]:
        """Watch every folder again and report every regular file as WRITTEN (and vanished ones as REMOVED).

        What recovers a queue overflow, when the kernel dropped events; callable at any time.
        """
        if self.stopped:
            return []
        before = dict(self._folders)
        self._folders.clear()
        present = set(self._add_tree(""))
        self._root_wd = next((wd for wd, folder in self._folders.items() if folder == ""), -1)
        if self._root_wd < 0:
            self._stop()
            return []
        for wd, folder in before.items():
            if wd not in self._folders:
                logger.debug("capture folder %r is gone; dropping its watch", folder)
                _libc().inotify_rm_watch(self._fd, wd)  # EINVAL when the kernel dropped it already
        changes = [Change(path, ChangeKind.REMOVED) for path in sorted(self._files - present)]
        changes += [Change(path, ChangeKind.WRITTEN) for path in sorted(present)]
        self._files = present
        return changes

    def close(self) -> None:
        """Release the descriptor and every watch; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._folders.clear()
        os.close(self._fd)

    def __enter__(self) -> FolderWatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    # -- events -> changes ----------------------------------------------------------------------------
    def _apply(self, events: list[InotifyEvent]) -> list[Change]:
        """Turn kernel events into changes, keeping the watches in step with the tree."""
        changes: list[Change] = []
        for event in events:
            if self._stopped:
                break
            if event.mask & IN_Q_OVERFLOW:
                self._warn_overflow()
                changes += self.rescan()
                continue
            if event.mask & IN_IGNORED:  # a watch is gone (its folder deleted, or we removed it)
                self._folders.pop(event.wd, None)
                if event.wd == self._root_wd:
                    self._stop()
                continue
            if event.wd == self._root_wd and event.mask & (IN_DELETE_SELF | IN_UNMOUNT):
                self._stop()
                break
            folder = self._folders.get(event.wd)
            if folder is None or not event.name or event.name.startswith(IGNORED_PREFIX):
                continue  # a watch already dropped (a folder moved or deleted), or the agent's own name
            found = self._apply_named(event.mask, _join(folder, event.name))
            for change in found:  # at once: a later event of this batch may remove the name again
                if change.kind is ChangeKind.WRITTEN:
                    self._files.add(change.path)
                else:
                    self._files.discard(change.path)
            changes += found
        return changes

    def _apply_named(self, mask: int, path: str) -> list[Change]:
        if mask & IN_ISDIR:
            if mask & (IN_CREATE | IN_MOVED_TO):
                return [Change(found, ChangeKind.WRITTEN) for found in self._add_tree(path)]
            if mask & (IN_MOVED_FROM | IN_DELETE):
                return self._drop_tree(path)
            return []
        if mask & IN_CLOSE_WRITE:
            return [Change(path, ChangeKind.WRITTEN)]
        if mask & (IN_MOVED_TO | IN_CREATE):
            # Created: only a new hard link (os.link) to a written file has no close of its own; a file
            # that open() created has one link, and is reported when it is closed.
            try:
                st = os.lstat(self.root / path)
            except OSError:
                return []
            if stat.S_ISREG(st.st_mode) and (mask & IN_MOVED_TO or st.st_nlink > 1):
                return [Change(path, ChangeKind.WRITTEN)]
            return []
        if mask & (IN_DELETE | IN_MOVED_FROM) and path in self._files:
            return [Change(path, ChangeKind.REMOVED)]
        return []

    # -- watches ------------------------------------------------------------------------------------
    def _add_tree(self, top: str) -> list[str]:
        """Watch ``top`` and every folder below it, then list their regular files (watch first: a file
        written meanwhile is either listed or reported by the new watch)."""
        return _walk(self.root, top, self._add_watch)

    def _add_watch(self, folder: str) -> bool:
        path = os.fsencode(self.root / folder if folder else self.root)
        wd = _libc().inotify_add_watch(self._fd, path, _ROOT_MASK if folder == "" else _DIR_MASK)
        if wd >= 0:
            self._folders[wd] = folder
            return True
        code = ctypes.get_errno()
        if code in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EACCES):
            logger.debug("capture folder %r not watched: %s", folder, os.strerror(code))
            return False
        raise CheckpointError(
            f"could not watch {str(self.root / folder)!r}: inotify_add_watch failed: {os.strerror(code)}",
            hint="Each watched folder takes an inotify watch: raise fs.inotify.max_user_watches (sysctl)."
            if code == errno.ENOSPC
            else None,
        )

    def _drop_tree(self, top: str) -> list[Change]:
        """A folder moved away or deleted: forget its watches, and report the files known under it as REMOVED.

        Its watches are removed rather than renamed: if it moved within the tree, its new name arrives as
        IN_MOVED_TO and is watched and listed afresh.
        """
        prefix = top + "/"
        for wd, folder in list(self._folders.items()):
            if folder == top or folder.startswith(prefix):
                del self._folders[wd]
                _libc().inotify_rm_watch(self._fd, wd)  # EINVAL when the kernel dropped it already
        return [Change(path, ChangeKind.REMOVED) for path in sorted(self._files) if path.startswith(prefix)]

    def _stop(self) -> None:
        if not self._stopped:
            logger.info("capture folder %s was removed; no longer watching it", self.root)
        self._stopped = True
        self._folders.clear()

    def _warn_overflow(self) -> None:
        # Once per watch at warning level: it repeats under a steady flood, and every rescan recovers it.
        if not self._overflowed:
            logger.warning(
                "the kernel's inotify queue for %s overflowed; scanning the whole folder again (once per "
                "overflow; later ones are logged at debug level)",
                self.root,
            )
            self._overflowed = True
        else:
            logger.debug("inotify queue for %s overflowed again; scanning again", self.root)
