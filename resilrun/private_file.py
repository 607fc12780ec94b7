"""Reading a file that holds a secret (the job secret, etcd's password): refused when others could
read it, since a secret that leaked through a lax file protects nothing.

A shared leaf: the agent and the rendezvous backends both read such files, and neither may import
the other.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from resilrun.errors import ConfigError


def read_private(path: Path, what: str, *, hint: str | None = None) -> str:
    """The text of ``path``, which only this user may read (``what``: the flag naming it, for errors).

    Raises:
        ConfigError: missing, not a regular file, any group or world permission bit set, owned by
            another user, or unreadable.
    """
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist", hint=hint) from None
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{what} {path} is not a regular file", hint=hint)
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
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path} cannot be read: {exc}") from None
