"""Where the job secret comes from: a private file or the environment, not the rendezvous store.

The secret is what peers prove to each other before a replica server sends or accepts a byte of a
rank's state. Kept in the rendezvous store (the fallback, for jobs started without one), it is
readable by anyone who can reach the store's port, which on c10d is unauthenticated: so the
launcher says what that leaves open, and ``--require-auth`` refuses to start that way. Given from
outside (``--job-secret-file``, ``RESILRUN_JOB_SECRET_FILE``, ``RESILRUN_JOB_SECRET``), it never
enters the store. A single-node job needs no agreement and gets a random one of its own.

The file is refused when others can read it (any group or world permission bit) or when it belongs
to another user: a secret that leaks through a lax file is no better than one in the store. Its
text is stretched into the 32-byte key, so any length of at least ``MIN_CHARS`` characters works
(``openssl rand -hex 32`` writes one).

Why a memory-hard KDF (issue 43, F12): whoever can read the rendezvous store (sealed documents)
or a persisted step (its MACs) holds an oracle against which to test guesses of the text offline.
One SHA-256 lets them test billions a second; scrypt with N = 2**15, r = 8, p = 1 makes each guess
cost 32 MiB of memory (128 * r * N) and about a tenth of a second of one core, which hardware that
guesses in bulk cannot shortcut. An agent pays that once, at start (``external_secret`` caches its
result per text for the process; no per-step path derives a key).

The salt is fixed (``KDF_SALT``), not the job's ``--rdzv-id``: the persistent tier's key must be
derivable again from the secret file alone, by ``resilrun inspect-checkpoint``, ``export`` and
``resilrun.checkpoint.load``, which do not know the run id (that key is bound to the checkpoint URI
afterwards, ``tiers.authentic.durable_key``). A fixed salt still forces a guesser to compute
tables for resilrun alone, but one table serves every job: a secret a person chose should be long,
and one ``openssl rand -hex 32`` writes is beyond any guessing.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from resilrun.errors import ConfigError
from resilrun.private_file import read_private

SECRET_ENV = "RESILRUN_JOB_SECRET"
MIN_CHARS = 16
# scrypt's cost (see the module docstring): 32 MiB and ~0.1 s per derivation, within maxmem.
KDF_SALT = b"resilrun job secret v2\0"
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 15, 8, 1
SCRYPT_MAXMEM = 64 * 1024 * 1024
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
    return _derive(text)


@functools.lru_cache(maxsize=4)
def _derive(text: str) -> bytes:
    """The key for ``text`` (scrypt, the module docstring says why), once per process: the agent
    and the commands read the secret more than once at start."""
    return hashlib.scrypt(
        text.encode(), salt=KDF_SALT, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, maxmem=SCRYPT_MAXMEM, dklen=32
    )


def _read_private(path: Path) -> str:
    return read_private(path, "--job-secret-file", hint=_HINT_MAKE)


def random_secret() -> bytes:
    """A secret for a job no other node joins (``--standalone``, one node): nothing to agree on."""
    return os.urandom(32)


def choose_secret(outside: bytes | None, *, max_nodes: int, require_auth: bool, persistent: bool) -> bytes | None:
    """The job secret from outside the store (``outside``), a random one for a job of one node,
    or None: the first agent then keeps one in the store (what that leaves open is said where it
    is made).

    ``--require-auth`` with a persistent tier needs a secret from outside even on one node: a
    random one cannot sign what later jobs must check, and an unsigned bucket is what a party
    with write access to it plants a step in.

    Raises:
        ConfigError: ``--require-auth`` and no secret from outside where one is needed.
    """
    if outside is None and require_auth and persistent:
        raise ConfigError(
            "--require-auth with --checkpoint-uri: no job secret given, so persisted steps could be "
            "neither signed nor checked",
            hint=f"give the job a --job-secret-file (mode 0600) or {SECRET_ENV}, the same for every job that "
            "reads these steps",
        )
    if outside is None and max_nodes == 1:
        return random_secret()
    if outside is None and require_auth:
        raise ConfigError(
            "--require-auth: no job secret given, and a multi-node job would keep it in the rendezvous store",
            hint=f"give every node the same --job-secret-file (mode 0600) or {SECRET_ENV}",
        )
    return outside
