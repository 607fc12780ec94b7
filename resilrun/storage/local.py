"""Directory Storage: one file per key under a root directory, written atomically.

Invariants:
- ``put`` writes a temporary file in the key's own directory, fsyncs it, ``os.replace``s it over the
  key and fsyncs the directory: after a crash a key holds its old bytes or its new bytes, never a
  torn file, and a completed ``put`` survives power loss. Temporary files (``.resilrun-tmp-*``) are
  never listed.
- Only regular files are read, and never more bytes than ``fstat`` reports, so a planted symlink to
  ``/dev/zero`` or a FIFO cannot make a read allocate without bound or hang.
- ``delete`` removes directories it leaves empty (never the root), so retention leaves no litter.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from resilrun.errors import StorageAuthError, StorageError, StorageNotFoundError
from resilrun.storage.api import Storage, check_key, check_prefix, clip_range

_TMP_PREFIX = ".resilrun-tmp-"


class LocalStorage(Storage):
    """See ``Storage``; ``root`` need not exist until the first ``put``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.uri = str(self.root)

    # -- helpers -----------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def _fail(self, action: str, key: str, exc: OSError) -> StorageError:
        """Translate ``exc`` at the one edge: the message names the key and the OS reason only."""
        reason = exc.strerror or type(exc).__name__
        message = f"could not {action} '{key}' in {self.uri}: {reason}"
        if isinstance(exc, FileNotFoundError):
            return StorageNotFoundError(message)
        if isinstance(exc, PermissionError):
            return StorageAuthError(message, hint=f"check the permissions of {self.uri}")
        if exc.errno == errno.ENOSPC:
            return StorageError(message, hint=f"free space on the file system holding {self.uri}")
        return StorageError(message)

    @contextlib.contextmanager
    def _open_regular(self, key: str) -> Iterator[tuple[int, int]]:
        """Yield ``(fd, size)`` of the regular file under ``key``; refuse devices, FIFOs, dirs."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise self._fail("read", key, exc) from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise StorageError(f"'{key}' in {self.uri} is not a regular file")
            yield fd, info.st_size
        finally:
            os.close(fd)

    def _read(self, key: str, fd: int, start: int, count: int) -> bytes:
        chunks = []
        try:
            while count > 0:
                chunk = os.pread(fd, min(count, 64 << 20), start)
                if not chunk:  # the file shrank under us; return what exists, as for a short object
                    break
                chunks.append(chunk)
                start += len(chunk)
                count -= len(chunk)
        except OSError as exc:
            raise self._fail("read", key, exc) from exc
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    # -- Storage -----------------------------------------------------------------------------------
    def put(self, key: str, data: bytes | memoryview) -> None:
        """See base class."""
        path = self._path(key)
        try:
            fd, tmp = self._temp_file(path.parent)
        except OSError as exc:
            raise self._fail("write", key, exc) from exc
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise self._fail("write", key, exc) from exc

    def _temp_file(self, parent: Path) -> tuple[int, str]:
        # A concurrent delete may remove the (empty) parent between makedirs and mkstemp; one
        # retry covers that race, a second failure is a real error.
        for attempt in range(2):
            parent.mkdir(parents=True, exist_ok=True)
            try:
                return tempfile.mkstemp(prefix=_TMP_PREFIX, dir=parent)
            except FileNotFoundError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get(self, key: str) -> bytes:
        """See base class."""
        with self._open_regular(key) as (fd, size):
            return self._read(key, fd, 0, size)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """See base class."""
        with self._open_regular(key) as (fd, size):
            start, end = clip_range(start, end, size)
            return self._read(key, fd, start, end - start)

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """See base class: one open file for all of them."""
        with self._open_regular(key) as (fd, size):
            found = []
            for start, end in ranges:
                start, end = clip_range(start, end, size)
                found.append(self._read(key, fd, start, end - start))
            return found

    def size(self, key: str) -> int:
        """See base class."""
        with self._open_regular(key) as (_, size):
            return size

    def list(self, prefix: str = "") -> list[str]:
        """See base class."""
        check_prefix(prefix)
        # Walk only below the deepest directory the prefix names, not the whole tree.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self.root.joinpath(*base.split("/")) if base else self.root
        keys = []

        def on_error(exc: OSError) -> None:
            # os.walk swallows errors by default, but a listing must not silently miss files. A
            # directory that vanished mid-walk (a concurrent delete) holds nothing to list, though.
            if isinstance(exc, FileNotFoundError | NotADirectoryError) and exc.filename != str(top):
                return
            raise exc

        try:
            for dirpath, dirnames, filenames in os.walk(top, onerror=on_error):
                dirnames.sort()
                rel = Path(dirpath).relative_to(self.root).as_posix()
                for name in filenames:
                    if name.startswith(_TMP_PREFIX):
                        continue
                    key = name if rel == "." else f"{rel}/{name}"
                    if key.startswith(prefix):
                        keys.append(key)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise self._fail("list", prefix or ".", exc) from exc
        return sorted(keys)

    def exists(self, key: str) -> bool:
        """See base class."""
        try:
            return self._path(key).is_file()
        except OSError as exc:
            raise self._fail("stat", key, exc) from exc

    def delete(self, key: str) -> None:
        """See base class."""
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise self._fail("delete", key, exc) from exc
        parent = path.parent
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError:  # not empty (or already gone): stop climbing
                break
            parent = parent.parent


def _fsync_dir(path: Path) -> None:
    """Make a rename durable; some file systems refuse fsync on a directory, which is harmless."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
