"""Authenticated values in the rendezvous store: every document resilrun writes carries a MAC.

Why: the store (a TCPStore, an etcd) lets anyone who reaches its port read and write every key.
Without this layer such a party could write the rendezvous state (join the job, reassign ranks,
open a round), mark a node lost, or fake a node's status. With the job secret from outside the
store, each value goes in as ``MAGIC | HMAC-SHA256(store key, key name | value)[:16] | value``:
bound to its key (it cannot be moved to another one), deterministic (so compare-and-set still
compares equal values as equal). A reader takes a value that does not verify for an absent one,
overwrites it at its next compare-and-set of that key, and reports it (``on_forged``, once per
key and per forged value), so the job goes on as if the forgery had never been written.

What it does not do, on purpose:
- Counters (``add``) carry no MAC: they only say "something moved" (heartbeats, change hints)
  or hand out indices. A party at the store can bump a dead node's heartbeat and so delay its
  detection (denial of service, like deleting keys), or hold a live node's counter still; the
  latter does not make the node lost, because a heartbeat verdict counts only once the node's
  agent fails to prove the job secret on its replica server (``agent/supervision/node_loss.py``).
- Replay: a MAC cannot tell an old valid value from a new one. The documents whose replay could
  roll the job back carry their own version, checked by their readers (the rendezvous state's
  ``seq``: rendezvous/executor.py); the others are keyed by round, index or node.
  A rerun under the same ``--rdzv-id`` and secret (a fixed Kubernetes Secret and job name) seals
  alike, so the rendezvous state also names its job (a nonce its first writer drew): a document of
  an earlier job is refused by every node that read this job's, whatever its ``seq``.
- With the secret kept in the store itself (no ``--job-secret-file``), the MACs prove nothing to
  whoever reads it there; the agent says so at start-up.

``key=None`` gives a reader without the secret (``resilrun status`` without one): values are
unwrapped unverified, and ``verified`` says so.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Callable, Sequence

from resilrun.rendezvous.api import KeyView, LeasedKey, Presence, RendezvousBackend

MAGIC = b"RSM1"
TAG_BYTES = 16
_LABEL = b"resilrun rendezvous store v1"


def store_key(secret: bytes) -> bytes:
    """The store's MAC key, derived from the job secret (never the secret itself: the peer tier's
    handshakes use that, and a key per purpose keeps one use from helping an attack on the other)."""
    return hmac.new(secret, _LABEL, hashlib.sha256).digest()


class SealedBackend(RendezvousBackend):
    """Wraps a backend: values written are sealed, values read are verified (see the module doc)."""

    def __init__(
        self,
        inner: RendezvousBackend,
        key: bytes | None,
        on_forged: Callable[[str], None] | None = None,
    ) -> None:
        self.inner = inner
        self._key = key
        self._on_forged = on_forged
        self._lock = threading.Lock()
        self._forged: dict[str, bytes] = {}  # key -> the forged raw value last read there
        self.refused = 0  # forged values read (each distinct one counted once)

    @property
    def verified(self) -> bool:
        """Whether reads are verified (a key was given)."""
        return self._key is not None

    # -- sealing ---------------------------------------------------------------------------------
    def seal(self, key: str, value: bytes) -> bytes:
        return MAGIC + self._tag(key, value) + value

    def _tag(self, key: str, value: bytes) -> bytes:
        if self._key is None:
            raise PermissionError("a reader without the job secret cannot write to the store")
        name = key.encode()
        message = len(name).to_bytes(4, "little") + name + value
        return hmac.new(self._key, message, hashlib.sha256).digest()[:TAG_BYTES]

    def _open(self, key: str, raw: bytes | None) -> bytes | None:
        if raw is None:
            return None
        header = len(MAGIC) + TAG_BYTES
        if raw[: len(MAGIC)] == MAGIC and len(raw) >= header:
            value = raw[header:]
            if self._key is None or hmac.compare_digest(raw[len(MAGIC) : header], self._tag(key, value)):
                with self._lock:
                    self._forged.pop(key, None)
                return value
        with self._lock:
            new = self._forged.get(key) != raw
            self._forged[key] = raw
            if new:
                self.refused += 1
        if new and self._on_forged is not None:
            self._on_forged(key)
        return None

    def check_key(self, key: str, value: bytes) -> bool:
        """Write ``value`` at ``key`` unless something is there already; whether what is there is
        ``value`` sealed under this key (False: sealed under another key). Never overwrites a
        sealed value, unlike ``compare_set``: two nodes given different secrets must not fight
        over it. A value not even shaped as ``value`` sealed (junk anyone at the store can write
        before the first agent) is overwritten, so one such write cannot stop every node; one
        shaped as a seal cannot be told from another secret's (a denial of service, not prevented)."""
        sealed = self.seal(key, value)
        for _ in range(4):  # bounded: a party rewriting junk as fast as we replace it only delays us
            raw = self.inner.get(key)
            if raw is not None and len(raw) == len(sealed) and raw.startswith(MAGIC) and raw.endswith(value):
                break
            self.inner.compare_set(key, raw, sealed)
        return self.inner.get(key) == sealed

    # -- the backend contract --------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        return self._open(key, self.inner.get(key))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self._open(key, raw) for key, raw in zip(keys, self.inner.get_many(keys), strict=True)]

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, self.seal(key, value))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        if expected is not None:
            want: bytes | None = self.seal(key, expected)
        else:
            with self._lock:
                want = self._forged.get(key)  # a forgery read as absent is overwritten as absent
        written = self.inner.compare_set(key, want, self.seal(key, desired))
        if written and want is not None and expected is None:
            with self._lock:
                self._forged.pop(key, None)
        return written

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def watch_key(self, key: str) -> KeyView | None:
        inner = self.inner.watch_key(key)
        return None if inner is None else _OpenedView(self, key, inner)

    def watch_counter(self, key: str) -> KeyView | None:
        return self.inner.watch_counter(key)  # counters carry no MAC

    def leases(self) -> bool:
        return self.inner.leases()

    def lease_key(self, key: str, value: bytes, ttl_s: int) -> LeasedKey | None:
        return self.inner.lease_key(key, value, ttl_s)  # liveness, like counters: no MAC

    def watch_presence(self, key: str) -> Presence | None:
        return self.inner.watch_presence(key)

    def close(self) -> None:
        self.inner.close()


class _OpenedView:
    """A pushed key's values verified as ``get`` verifies them (a forgery reads as absent and is
    reported); each pushed value is checked once, not at every look."""

    def __init__(self, sealed: SealedBackend, key: str, inner: KeyView) -> None:
        self._sealed, self._key, self._inner = sealed, key, inner
        self._last: tuple[bytes | None, bytes | None] | None = None  # (raw, opened)

    def seen(self) -> tuple[bytes | None, float] | None:
        seen = self._inner.seen()
        if seen is None:
            return None
        raw, since = seen
        last = self._last
        if last is None or last[0] is not raw:
            last = self._last = (raw, self._sealed._open(self._key, raw))
        return last[1], since

    def close(self) -> None:
        self._inner.close()
