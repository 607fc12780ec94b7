"""The agent's view of every tier holding a rank's snapshots, for the workers' restore.

Workers plan (``state.restore.plan_restore``) from what this reports, then ask for the chosen step;
whatever tier it comes from, it is installed into the rank's node-memory slot, so a worker always
loads from memory. Peers are reached through a callable the supervisor provides per round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from resilrun.errors import CheckpointError, CheckpointNotFoundError
from resilrun.snapshot.dedup import Borrowed
from resilrun.snapshot.restore import PEER_STEPS
from resilrun.snapshot.shm import SharedBuffer
from resilrun.storage.api import Storage
from resilrun.tiers import durable
from resilrun.tiers.memory import NodeMemoryTier

logger = logging.getLogger(__name__)

# (rank, step) -> (bytes, values) fetched from whichever peer holds it, or None.
PeerFetch = Callable[[int, int], tuple[bytes, Any] | None]
# rank -> steps some reachable peer holds for it.
PeerHeld = Callable[[int], list[int]]


class NodeTiers:
    def __init__(
        self,
        memory: NodeMemoryTier,
        storage: Storage | None,
        peer_held: PeerHeld | None = None,
        peer_fetch: PeerFetch | None = None,
    ) -> None:
        self.memory = memory
        self.storage = storage
        self.peer_held = peer_held
        self.peer_fetch = peer_fetch

    def restore_info(self, rank: int, world_size: int) -> dict[str, Any]:
        """Steps each tier can give ``rank`` in a job of ``world_size`` ranks."""
        committed = self.memory.describe(rank)["committed"].values()
        memory = sorted((int(v["step"]) for v in committed if v["complete"]), reverse=True)
        peer = sorted(self.peer_held(rank), reverse=True)[:PEER_STEPS] if self.peer_held else []
        return {"memory": memory, "peer": peer, "persisted": self._persisted(world_size)}

    def _persisted(self, world_size: int) -> int | None:
        if self.storage is None:
            return None
        try:
            step = durable.latest_complete_step(self.storage)
            if step is None:
                return None
            complete = durable.read_complete(self.storage, step)
        except CheckpointError as exc:
            logger.warning("persistent tier unreadable: %s", exc.message)
            return None
        if int(complete.get("world_size", -1)) != world_size:
            logger.warning(
                "persisted step %d has world size %s, the job has %d: not restorable",
                step,
                complete.get("world_size"),
                world_size,
            )
            return None
        return step

    def lend(self, rank: int, step: int) -> tuple[Borrowed, dict[int, SharedBuffer]]:
        """The other local ranks' slots ``rank``'s node-memory snapshot of ``step`` borrows from.

        Raises:
            CheckpointNotFoundError: a part of the step is gone (the caller plans again).
        """
        lent = self.memory.lend(rank, step)
        if lent is None:
            raise CheckpointNotFoundError(f"step {step} of rank {rank} is no longer complete in node memory")
        return lent

    def fetch(self, rank: int, step: int, tier: str) -> dict[str, Any]:
        """Bring ``rank``'s snapshot of ``step`` from ``tier`` into node memory."""
        started = time.monotonic()
        if tier == "peer":
            found = self.peer_fetch(rank, step) if self.peer_fetch else None
            if found is None:
                raise CheckpointNotFoundError(f"no peer holds step {step} of rank {rank} any more")
            data, values = found
        elif tier == "persistent":
            if self.storage is None:
                raise CheckpointNotFoundError("no --checkpoint-uri: nothing persistent to restore from")
            _, data, manifest = durable.read_rank(self.storage, step, rank, verify=True)
            values = manifest.get("values")
        else:
            raise CheckpointError(f"unknown tier {tier!r}")
        self.memory.install(rank, step, data, values)
        seconds = time.monotonic() - started
        logger.info(
            "rank %d step %d restored from the %s tier (%d bytes, %.2f s)", rank, step, tier, len(data), seconds
        )
        return {"bytes": len(data), "seconds": seconds}
