"""Where the job secret comes from: a private file or the environment, not the rendezvous store.

The secret is what peers prove to each other before a replica server sends or accepts a byte of a
rank's state. Kept in the rendezvous store (the fallback, for jobs started without one), it is
readable by anyone who can reach the store's port, which on c10d is unauthenticated: so the
launcher says what that leaves open, and ``--require-auth`` refuses to start that way. Given from
outside (``--job-secret-file``, ``RESILRUN_JOB_SECRET_FILE``, ``RESILRUN_JOB_SECRET``), it never
enters the store. A single-node job needs no agreement and gets a random one of its own.

The file is refused when others can read it (any group or world permission bit) or when it belongs
to another user: a secret that leaks through a lax file is no better than one in the store. Its
text is hashed into the 32-byte key, so any length of at least ``MIN_CHARS`` characters works
(``openssl rand -hex 32`` writes one).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from resilrun.errors import ConfigError
from resilrun.private_file import read_private

SECRET_ENV = "RESILRUN_JOB_SECRET"
MIN_CHARS = 16
_CONTEXT = b"resilrun job secret v1\0"
_HINT_MAKE = "create one with: (umask 077; openssl rand -hex 32 > PATH), on storage every node reads"


def external_secret(path: str | None, environ: Mapping[str, str]) -> bytes | None:
    """The job secret from ``--job-secret-file`` (``path``) or ``RESILRUN_JOB_SECRET``; None when
    neither is given. The file wins when both are.

    Raises:
        ConfigError: the file is missing, not a regular file, readable by others, owned by another
            user, or the secret is shorter than ``MIN_CHARS``.
    """
    if path:
        text, origin = _read_private(Path(path)), f"--job-secret-file {path}"
    elif environ.get(SECRET_ENV):
        text, origin = environ[SECRET_ENV], SECRET_ENV
    else:
        return None
    text = text.strip()
    if len(text) < MIN_CHARS:
        raise ConfigError(
            f"the job secret in {origin} has {len(text)} characters; at least {MIN_CHARS} are needed",
            hint=_HINT_MAKE,
        )
    return hashlib.sha256(_CONTEXT + text.encode()).digest()


def _read_private(path: Path) -> str:
    return read_private(path, "--job-secret-file", hint=_HINT_MAKE)


def random_secret() -> bytes:
    """A secret for a job no other node joins (``--standalone``, one node): nothing to agree on."""
    return os.urandom(32)
