"""The agent's view of every tier holding a rank's snapshots, for the workers' restore.

Workers plan (``state.restore.plan_restore``) from what this reports, then ask for the chosen step;
whatever tier it comes from, it is installed into the rank's node-memory slot, so a worker always
loads from memory. A rank resuming at another world size instead reads other (old) ranks'
snapshots: in place where node memory holds them, else just the bytes it needs, which ``peek`` and
``gather_ranges`` bring from a peer or storage into a memfd of its own, not into node memory.
Each tier is a ``RestoreSource`` (sources.py), asked in order: node memory, peers, storage.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable

from resilrun.agent.state.sources import DurableSource, Fetched, Into, MemorySource, RestoreSource
from resilrun.channel_protocol import TRANSFER_S, Holdings, Moved, Peeked, TierSteps
from resilrun.errors import CheckpointError, CheckpointNotFoundError
from resilrun.snapshot.dedup import Borrowed
from resilrun.snapshot.restore import PEER_STEPS, world_of
from resilrun.snapshot.selection import Selection
from resilrun.snapshot.shm import SharedBuffer
from resilrun.storage.api import Storage
from resilrun.tiers.memory import NodeMemoryTier

logger = logging.getLogger(__name__)


class NodeTiers:
    def __init__(
        self,
        memory: NodeMemoryTier,
        storage: Storage | None,
        peers: RestoreSource | None = None,
        *,
        mac_key: bytes | None = None,
        require_mac: bool = False,
        persisted_before: Callable[[], int | None] | None = None,
        on_rollback: Callable[[int | None, int], None] | None = None,
    ) -> None:
        """``peers``: the replicas on other nodes (``replication.PeerTier``), none in a job
        without them; the rest configures the persistent tier (``sources.DurableSource``)."""
        self.memory = memory
        self._memory = MemorySource(memory)
        self.peers = peers
        self.durable = (
            DurableSource(
                storage,
                mac_key=mac_key,
                require_mac=require_mac,
                persisted_before=persisted_before,
                on_rollback=on_rollback,
            )
            if storage is not None
            else None
        )
        # Asked in this order: the nearest tier that has a step gives it.
        self.sources: list[RestoreSource] = [s for s in (self._memory, peers, self.durable) if s is not None]
        self._by_name = {source.name: source for source in self.sources}

    def restore_info(self, rank: int, world_size: int) -> TierSteps:
        """Steps each tier can give ``rank`` in a job of ``world_size`` ranks, and whether the
        newest snapshots were written at another world size (``resized``: the restore then plans
        from ``inventory`` and reshards)."""
        committed = self._memory.complete(rank)
        newest = max(committed, key=lambda v: int(v["step"]), default=None)
        memory = self._memory.held(rank)
        peer = self.peers.held(rank)[:PEER_STEPS] if self.peers is not None else []
        persisted = self.durable.newest() if self.durable is not None else None
        # Without a snapshot here, the persisted one tells (a new job on an old --checkpoint-uri).
        written = persisted[1] if persisted is not None else -1
        if newest is not None:
            written = world_of(newest["values"])
        resized = written > 0 and written != world_size
        same = persisted[0] if persisted is not None and persisted[1] == world_size else None
        return TierSteps(memory=memory, peer=peer, persisted=same, resized=resized)

    def inventory(self) -> Holdings:
        """Every snapshot this node can bring in without storage, as [rank, step, world size]
        (its own memory and what the peers hold), and the newest persisted [step, world size]."""
        entries: set[tuple[int, int, int]] = set()
        for source in self.sources:
            entries |= source.inventory()
        persisted = self.durable.newest() if self.durable is not None else None
        return Holdings(entries=[list(e) for e in sorted(entries)], persisted=list(persisted) if persisted else None)

    def peek(self, rank: int, step: int, world_size: int) -> Peeked:
        """The values of ``rank``'s snapshot of ``step`` (written at ``world_size``), which a rank
        resuming at another world size plans its reads from, and whether node memory holds it
        (then it is read in place, not gathered).

        Raises:
            CheckpointNotFoundError: no tier has it (the caller plans again).
        """
        # An anonymous mapping: only the header is written, the pages past it are never touched.
        found, _ = self._ranged(
            rank, step, world_size, Selection(), lambda size: memoryview(mmap.mmap(-1, max(size, 1)))
        )
        return Peeked(values=found.values, memory=found.in_place)

    def gather_ranges(self, rank: int, step: int, world_size: int, select: Selection) -> tuple[Moved, int | None]:
        """Only the bytes of ``rank``'s snapshot of ``step`` that ``select`` names, from a peer or
        storage, in a new memfd of the snapshot's size (sparse: what was not read takes no memory)
        whose descriptor the caller hands to the worker and closes. Not installed in node memory:
        it is a part of another world's rank, of use to the one worker that asked.

        Returns:
            What was moved, and the descriptor; None when node memory holds the whole snapshot
            (the worker views it in place).

        Raises:
            CheckpointNotFoundError: no tier has it (the caller plans again).
        """
        started = time.monotonic()
        made: list[SharedBuffer] = []

        def into(size: int) -> memoryview:
            for old in made:
                old.close()
            made[:] = [SharedBuffer.create(size, f"resilrun-part-{rank}-{step}", populate=False)]
            return made[0].view()

        try:
            found, tier = self._ranged(rank, step, world_size, select, into)
            if found.in_place:
                return Moved(nbytes=0, seconds=0.0, tier=tier), None
            fd = os.dup(made[0].fd)
        finally:
            for buffer in made:
                buffer.close()
        seconds = time.monotonic() - started
        logger.info(
            "rank %d step %d (world size %d): %d selected bytes from the %s tier",
            rank,
            step,
            world_size,
            found.moved,
            tier,
        )
        return Moved(nbytes=found.moved, seconds=seconds, tier=tier), fd

    def _ranged(self, rank: int, step: int, world_size: int, select: Selection, into: Into) -> tuple[Fetched, str]:
        """A ranged read from the first tier that has the step, and that tier's name."""
        deadline = time.monotonic() + TRANSFER_S
        for source in self.sources:
            found = source.fetch(rank, step, deadline, world_size=world_size, select=select, into=into)
            if found is not None:
                return found, source.name
        raise CheckpointNotFoundError(f"no tier holds step {step} of rank {rank} (world size {world_size})")

    def lend(self, rank: int, step: int) -> tuple[Borrowed, dict[int, SharedBuffer]]:
        """The other local ranks' slots ``rank``'s node-memory snapshot of ``step`` borrows from.

        Raises:
            CheckpointNotFoundError: a part of the step is gone (the caller plans again).
        """
        lent = self.memory.lend(rank, step)
        if lent is None:
            raise CheckpointNotFoundError(f"step {step} of rank {rank} is no longer complete in node memory")
        return lent

    def fetch(self, rank: int, step: int, tier: str) -> Moved:
        """Bring ``rank``'s snapshot of ``step`` from ``tier`` (as the worker's plan names it) into
        node memory, within the transfer deadline the worker waits for.

        Raises:
            CheckpointNotFoundError: the tier no longer holds it (the caller plans again).
            CheckpointError: no such tier here, or it refused the step.
        """
        started = time.monotonic()
        source = self._by_name.get(tier)
        if tier not in ("peer", "persistent"):  # node memory is read in place, never fetched
            raise CheckpointError(f"unknown tier {tier!r}")
        found = source.fetch(rank, step, started + TRANSFER_S) if source is not None else None
        if found is None:
            raise CheckpointNotFoundError(f"no {tier} copy of step {step} of rank {rank} is reachable any more")
        self.memory.install(rank, step, found.data, found.values, origin=tier)
        seconds = time.monotonic() - started
        logger.info(
            "rank %d step %d restored from the %s tier (%d bytes, %.2f s)", rank, step, tier, found.moved, seconds
        )
        return Moved(nbytes=found.moved, seconds=seconds, tier=tier)
