"""Wiring of tier 2 (peer replicas) into the agent: the job secret, server, replicator, lookups.

The mechanism lives in ``resilrun.tiers.peer``; this module decides who talks to whom: each node
replicates to the next ``--replicas`` nodes of the current round, and a restore asks every other
node of the round what it holds.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Collection
from datetime import timedelta

from resilrun import keys
from resilrun.agent.state.sources import Fetched, Into
from resilrun.agent.workers.fault_hooks import REPLICATION_DELAY_ENV, delay_s
from resilrun.errors import CheckpointCorruptError, CheckpointNotFoundError, ResilrunError
from resilrun.rendezvous.api import RendezvousBackend
from resilrun.snapshot.layout import parse_header
from resilrun.snapshot.restore import world_of
from resilrun.snapshot.selection import Selection
from resilrun.tiers.captured.catalog import Catalog
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer, ReplicaStore, Replicator, fetch, held, inventory
from resilrun.tiers.peer.wire import Credential

logger = logging.getLogger(__name__)

# Fetching a multi-GB snapshot over a slow link takes a while; 50 MB/s is a pessimistic floor.
_FETCH_FLOOR_BYTES_S = 50e6


def job_secret(backend: RendezvousBackend, run_id: str) -> bytes:
    """The job's secret: the first agent sets it, every agent reads the same one."""
    key = keys.job_secret(run_id)
    backend.compare_set(key, None, os.urandom(32).hex().encode())
    raw = backend.get(key)
    if raw is None:
        raise ResilrunError("the job secret vanished from the rendezvous store")
    return bytes.fromhex(raw.decode())


class PeerTier:
    """This node's replica server and replicator, and the peer tier of a restore (a
    ``RestoreSource``: what the other nodes hold, fetched from them)."""

    name = "peer"

    def __init__(
        self,
        memory: NodeMemoryTier,
        secret: Credential,
        run_id: str,
        node_id: str,
        host: str,
        targets: Callable[[], list[str]],
        peers: Callable[[], list[str]],
        world_size: Callable[[], int],
        generation: Callable[[], int],
        on_replicated: Callable[[int, int, int, float], None] | None = None,
        every: int = 1,
        captured: Catalog | None = None,
        on_health: Callable[[str, bool, str], None] | None = None,
        on_dropped: Callable[[str], None] | None = None,
        local_ranks: Callable[[], Collection[int]] | None = None,
    ) -> None:
        """``generation``: the newest generation this node follows: the fencing token its pushes carry,
        and the server's bar (it refuses pushes from senders that follow an older one).
        ``every``: ``--replicate-every`` (which snapshots are replicated).
        ``captured``: the node's captured files (``--capture-dir``), which the server also serves.
        ``local_ranks``: the ranks this node runs (the replicator keeps their replicas in step)."""
        self.secret = secret
        self.store = ReplicaStore(run_id)
        self.server = ReplicaServer(
            secret, self.store, memory, host=_resolve(host), generation=generation, node_id=node_id, captured=captured
        )
        self.replicator = Replicator(
            memory,
            secret,
            targets,
            world_size=world_size,
            generation=generation,
            on_replicated=on_replicated,
            push_delay_s=delay_s(REPLICATION_DELAY_ENV, "every replica push, before its bytes,"),
            every=every,
            on_health=on_health,
            on_dropped=on_dropped,
            local_ranks=local_ranks,
        )
        self._peers = peers

    @property
    def address(self) -> str:
        return self.server.address

    # -- a restore source (sources.RestoreSource): the other nodes' replicas and memory ----------
    def held(self, rank: int) -> list[int]:
        """Steps some other node of the round holds for ``rank`` (replica or its own memory)."""
        steps: set[int] = set()
        for address in self._peers():
            try:
                holding = held(address, self.secret)
            except ResilrunError as exc:
                logger.debug("peer %s unreachable for a restore: %s", address, exc.message)
                continue
            for kind in ("replicas", "local"):
                steps.update(holding.get(kind, {}).get(rank, []))
        return sorted(steps, reverse=True)

    def inventory(self) -> set[tuple[int, int, int]]:
        """Every (rank, step, world size) the other nodes of the round hold."""
        entries: set[tuple[int, int, int]] = set()
        for address in self._peers():
            try:
                entries.update(inventory(address, self.secret))
            except ResilrunError as exc:
                logger.debug("peer %s unreachable for a restore: %s", address, exc.message)
        return entries

    def fetch(
        self,
        rank: int,
        step: int,
        deadline: float,
        *,
        world_size: int | None = None,
        select: Selection | None = None,
        into: Into | None = None,
    ) -> Fetched | None:
        """``rank``'s snapshot of ``step`` (or the bytes ``select`` names, into ``into``'s buffer)
        from the first peer that has an intact copy, this node's own replicas first: a node of a
        job that shrank can hold the replica of the lost rank its new rank reads. Every peer tried
        shares the one deadline, so a dead peer costs its share, not a transfer's worth each."""
        for address in [self.server.address, *self._peers()]:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("no peer gave step %d of rank %d before the restore's deadline", step, rank)
                return None
            try:
                data, values = fetch(
                    address, self.secret, rank, step, timedelta(seconds=left), select=select, into=into
                )
            except (CheckpointNotFoundError, CheckpointCorruptError) as exc:
                logger.warning("peer %s cannot give step %d of rank %d: %s", address, step, rank, exc.message)
                continue
            except ResilrunError as exc:
                logger.warning("peer %s unreachable: %s", address, exc.message)
                continue
            if world_size is not None and world_of(values) != world_size:
                return None
            if select is None:
                return Fetched(data, values, len(data))
            view = memoryview(data)
            moved = sum(end - begin for begin, end in select.ranges(parse_header(view, len(view))))
            return Fetched(data, values, moved)
        return None

    def close(self) -> None:
        self.replicator.close()
        self.server.close()
        self.store.close()


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host
