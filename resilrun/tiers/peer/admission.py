"""Admission to the replica server before a connection has proved the job secret (issue 43, F2).

Why a stage of its own: the ALIVE probe that confirms a heartbeat verdict (``agent.node_loss``)
must get through whatever anyone without the secret does to the port. When unauthenticated
connections shared the server's slots with authenticated ones, 64 idle connections (each held
until the handshake deadline) refused every probe, and a failed probe counts as lost.

So a connection first waits here, bounded in number (``capacity``) and in time (the server's
handshake deadline), and takes one of the server's service slots only once it proved the secret.
When the stage is full, a new connection is *admitted* and a waiting one is dropped instead:

- Refusing the newcomer would let a flood that keeps the stage full refuse every honest peer
  forever. Dropping a waiting one means the flood must keep dropping honest handshakes while they
  are in flight: an honest handshake takes one round trip and two HMACs (about a millisecond on a
  LAN), so starving it takes a flood of ``capacity`` new connections per millisecond, a SYN-flood
  rate that no application-level defence would withstand anyway.
- The one dropped is the oldest connection of the source address holding the most waiting
  connections. A flood from one host (the usual case) thus only ever drops its own connections,
  never a handshake from another host, however slow. A per-source cap alone would not do: several
  nodes of one job often share a host (and loopback, in tests and single-host runs), and a cap
  that counted them together would starve honest peers behind a flood from the same address.
  When every source holds the same count (a flood spread over many addresses), this is plain
  oldest-first, which still spares young, fast, honest handshakes.

The decision (``choose_evictee``) is pure; ``PreAuthStage`` only keeps the book.
"""

from __future__ import annotations

import socket
import threading
from collections import Counter
from collections.abc import Sequence


def choose_evictee(sources: Sequence[str]) -> int:
    """Which waiting connection to drop to make room, given each one's source address, oldest
    first: the index of the oldest one from the address holding the most (see the module docstring).

    Raises:
        ValueError: ``sources`` is empty (nothing to drop).
    """
    if not sources:
        raise ValueError("no waiting connection to drop")
    counts = Counter(sources)
    heaviest = max(counts.values())
    return next(index for index, source in enumerate(sources) if counts[source] == heaviest)


class PreAuthStage:
    """The connections still to prove the job secret, oldest first, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the pre-auth stage needs room for one connection at least, not {capacity}")
        self._capacity = capacity
        self._lock = threading.Lock()
        self._waiting: dict[socket.socket, str] = {}  # insertion order: oldest first

    def admit(self, conn: socket.socket, source: str) -> tuple[socket.socket, str] | None:
        """Let ``conn`` (from ``source``) wait here; the connection dropped to make room, if one was
        (the caller shuts it down: its thread then fails at its next read and ends)."""
        with self._lock:
            dropped = None
            if len(self._waiting) >= self._capacity:
                order = list(self._waiting.items())
                dropped = order[choose_evictee([s for _, s in order])]
                del self._waiting[dropped[0]]
            self._waiting[conn] = source
            return dropped

    def leave(self, conn: socket.socket) -> bool:
        """``conn`` is done with its handshake (or failed it); whether it was still waiting, that is,
        not dropped meanwhile."""
        with self._lock:
            return self._waiting.pop(conn, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)
