"""Files only the job's user may touch: reading a secret (the job secret, etcd's password), refused
when others could read it, since a secret that leaked through a lax file protects nothing; and
writing the run's logs, never through a link someone planted.

Every check is made on the descriptor that is then read or written (``fstat``), never on a path
looked at earlier: between a look and a use, a path can be swapped for another file or a link.

A shared leaf: the agent and the rendezvous backends both use it, and neither may import the other.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from resilrun.errors import ConfigError


def read_private(path: Path, what: str, *, hint: str | None = None) -> str:
    """The text of ``path``, which only this user may read (``what``: the flag naming it, for errors).

    Opened once and judged by ``fstat`` on that descriptor: a check of the path followed by a read
    of the path let a file swapped in between (a world-readable one) be read as the secret. A
    symbolic link is followed (Kubernetes mounts every Secret's file as one), and what is checked is
    its target, the file actually read. ``O_NONBLOCK`` keeps a FIFO at the path from blocking the open.

    Raises:
        ConfigError: missing, not a regular file, any group or world permission bit set, owned by
            another user, or unreadable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist", hint=hint) from None
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc.strerror}") from None
    try:
        info = _fstat_of_kind(fd, stat.S_IFREG, f"{what} {path}", hint)
        if info.st_mode & 0o077:
            mode = stat.S_IMODE(info.st_mode)
            raise ConfigError(
                f"{what} {path} can be read by others (mode {mode:04o}): refusing a secret that has leaked",
                hint=f"chmod 600 {path}, then make a new secret if others may have read it",
            )
        if info.st_uid != os.geteuid():
            raise ConfigError(
                f"{what} {path} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})",
                hint="the job's user must own its secret files",
            )
        try:
            return _read_all(fd).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{what} {path} cannot be read: {exc}") from None
    finally:
        os.close(fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def private_dir(path: Path, what: str, *, hint: str) -> None:
    """Check that the directory ``path`` is this user's and nobody else can write to it; then make it
    0700 (``what``: what it is, for errors).

    Why: the run's log directory has a predictable name (``<log-dir>/<rdzv-id>``, a SLURM job id);
    made first by another user, or writable by others, it can hold links planted to turn our log
    writes into truncations of someone else's files.

    Raises:
        ConfigError: a symbolic link, not a directory, owned by another user, writable by its group
            or others, or not openable.
    """
    fd = _open_no_link(path, os.O_RDONLY, f"{what} {path}", "refusing to write there", hint)
    try:
        info = _fstat_of_kind(fd, stat.S_IFDIR, f"{what} {path}", hint)
        if info.st_uid != os.geteuid():
            raise ConfigError(
                f"{what} {path} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()}): "
                "refusing to write there",
                hint=hint,
            )
        if info.st_mode & 0o022:
            mode = stat.S_IMODE(info.st_mode)
            raise ConfigError(
                f"{what} {path} can be written by others (mode {mode:04o}): refusing to write there",
                hint=hint,
            )
        _tighten(fd, info.st_mode, 0o700, f"{what} {path}", hint)
    finally:
        os.close(fd)


def open_private_output(path: Path, *, append: bool = False) -> int:
    """A descriptor that writes ``path`` (0600), never through a link; an existing file is truncated
    unless ``append``.

    A new file is created with ``O_EXCL`` (so nothing at the path is followed); one already there
    (an earlier run with the same id, another agent's events) is opened with ``O_NOFOLLOW`` and
    must be a regular file of this user with no other hard link, since a hard link planted there
    would make the write land in its target.

    Raises:
        ConfigError: a symbolic link, not a regular file, another user's file, a file with more than
            one link, or not openable.
    """
    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    hint = "remove it: nothing but resilrun should write in the run's log directory"
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"log file {path} cannot be created: {exc.strerror}") from None
    fd = _open_no_link(path, flags, f"log file {path}", "refusing to write through it", hint)
    try:
        info = _fstat_of_kind(fd, stat.S_IFREG, f"log file {path}", hint)
        if info.st_uid != os.geteuid():
            raise ConfigError(f"log file {path} belongs to uid {info.st_uid}, not to this user", hint=hint)
        if info.st_nlink != 1:
            raise ConfigError(
                f"log file {path} has {info.st_nlink} hard links: refusing to write through it", hint=hint
            )
        _tighten(fd, info.st_mode, 0o600, f"log file {path}", hint)  # an older version's may be 0644
        if not append:
            os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_no_link(path: Path, flags: int, name: str, refusal: str, hint: str) -> int:
    """``path`` opened with ``flags``, refused where it is a symbolic link (``name``: the path as
    errors say it; ``refusal``: what a link there makes us refuse).

    Not following the link is the point: one planted at a path we write would turn the write into
    one on its target. ``O_NONBLOCK``: a FIFO planted there must not block the open.

    Raises:
        ConfigError: a symbolic link, or not openable.
    """
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{name} is a symbolic link: {refusal}", hint=hint) from None
        raise ConfigError(f"{name} cannot be opened: {exc.strerror}", hint=hint) from None


# The file types these checks insist on, as their errors name them.
_KINDS = {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory"}


def _fstat_of_kind(fd: int, kind: int, name: str, hint: str | None) -> os.stat_result:
    """The ``fstat`` of the open ``fd``, which must be of file type ``kind`` (``stat.S_IFREG`` or
    ``stat.S_IFDIR``; ``name``: the path as errors say it). The caller closes ``fd``.

    Judged on the descriptor, not the path, so that what is checked is what is then used.

    Raises:
        ConfigError: the file is of another type.
    """
    info = os.fstat(fd)
    if stat.S_IFMT(info.st_mode) != kind:
        raise ConfigError(f"{name} is not {_KINDS[kind]}", hint=hint)
    return info


def _tighten(fd: int, mode: int, wanted: int, what: str, hint: str) -> None:
    """Set ``wanted`` on the open file; a file system that refuses ``fchmod`` (CIFS, some FUSE
    mounts) is fine when others already have no access, and one line otherwise."""
    try:
        os.fchmod(fd, wanted)
    except OSError as exc:
        if mode & 0o077:
            raise ConfigError(f"{what} cannot be made private: {exc.strerror}", hint=hint) from None
