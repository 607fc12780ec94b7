"""The agent's view of every tier holding a rank's snapshots, for the workers' restore.

Workers plan (``state.restore.plan_restore``) from what this reports, then ask for the chosen step;
whatever tier it comes from, it is installed into the rank's node-memory slot, so a worker always
loads from memory. Peers are reached through a callable the supervisor provides per round.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from resilrun.errors import CheckpointError, CheckpointNotFoundError
from resilrun.snapshot.dedup import Borrowed
from resilrun.snapshot.restore import PEER_STEPS, world_of
from resilrun.snapshot.shm import SharedBuffer
from resilrun.storage.api import Storage
from resilrun.tiers import durable
from resilrun.tiers.memory import NodeMemoryTier

logger = logging.getLogger(__name__)

# (rank, step) -> (bytes, values) fetched from whichever peer holds it, or None.
PeerFetch = Callable[[int, int], tuple[bytes, Any] | None]
# rank -> steps some reachable peer holds for it.
PeerHeld = Callable[[int], list[int]]
# Every (rank, step, world size) the reachable peers hold.
PeerInventory = Callable[[], list[tuple[int, int, int]]]


class NodeTiers:
    def __init__(
        self,
        memory: NodeMemoryTier,
        storage: Storage | None,
        peer_held: PeerHeld | None = None,
        peer_fetch: PeerFetch | None = None,
        peer_inventory: PeerInventory | None = None,
        *,
        mac_key: bytes | None = None,
        require_mac: bool = False,
    ) -> None:
        """``mac_key``: the durable key (tiers/_authentic.py): persisted steps are checked against
        their MACs; ``require_mac``: a step without them is refused (--require-auth)."""
        self.memory = memory
        self.mac_key = mac_key
        self.require_mac = require_mac
        self.storage = storage
        self.peer_held = peer_held
        self.peer_fetch = peer_fetch
        self.peer_inventory = peer_inventory
        self._gathering = threading.Lock()  # one snapshot brought in at a time: never the same one twice

    def restore_info(self, rank: int, world_size: int) -> dict[str, Any]:
        """Steps each tier can give ``rank`` in a job of ``world_size`` ranks, and whether the
        newest snapshots were written at another world size (``resized``: the restore then plans
        from ``inventory`` and reshards)."""
        committed = [v for v in self.memory.describe(rank)["committed"].values() if v["complete"]]
        newest = max(committed, key=lambda v: int(v["step"]), default=None)
        memory = sorted((int(v["step"]) for v in committed), reverse=True)
        peer = sorted(self.peer_held(rank), reverse=True)[:PEER_STEPS] if self.peer_held else []
        persisted = self._persisted()
        # Without a snapshot here, the persisted one tells (a new job on an old --checkpoint-uri).
        written = persisted[1] if persisted is not None else -1
        if newest is not None:
            written = world_of(newest["values"])
        resized = written > 0 and written != world_size
        same = persisted[0] if persisted is not None and persisted[1] == world_size else None
        return {"memory": memory, "peer": peer, "persisted": same, "resized": resized}

    def inventory(self) -> dict[str, Any]:
        """Every snapshot this node can bring in without storage, as [rank, step, world size]
        (its own memory and what the peers hold), and the newest persisted [step, world size]."""
        entries: set[tuple[int, int, int]] = set()
        for rank in self.memory.held_ranks():
            for found in self.memory.describe(rank)["committed"].values():
                if found["complete"]:
                    entries.add((rank, int(found["step"]), world_of(found["values"])))
        if self.peer_inventory is not None:
            entries.update(self.peer_inventory())
        persisted = self._persisted()
        return {"entries": [list(e) for e in sorted(entries)], "persisted": list(persisted) if persisted else None}

    def gather(self, rank: int, step: int, world_size: int) -> dict[str, Any]:
        """Make ``rank``'s snapshot of ``step``, written at ``world_size``, complete in node memory,
        from wherever it is: here, a peer, or storage. Brought in quietly: a snapshot of another
        world is not this world's ``rank``, so it is neither replicated nor persisted.

        Raises:
            CheckpointNotFoundError: no tier has it (the caller plans again).
        """
        started = time.monotonic()
        with self._gathering:
            if self._held(rank, step, world_size):
                return {"bytes": 0, "seconds": 0.0, "tier": "memory"}
            found = self.peer_fetch(rank, step) if self.peer_fetch else None
            tier = "peer"
            if found is not None and world_of(found[1]) != world_size:
                found = None  # the same step number trained at another world size
            if found is None and self.storage is not None and self._persisted_at(step) == world_size:
                _, data, manifest = self._read_persisted(step, rank)
                found, tier = (data, manifest.get("values")), "persistent"
            if found is None:
                raise CheckpointNotFoundError(f"no tier holds step {step} of rank {rank} (world size {world_size})")
            self.memory.install(rank, step, found[0], found[1], announce=False)
        seconds = time.monotonic() - started
        logger.info("rank %d step %d (world size %d) brought in from the %s tier", rank, step, world_size, tier)
        return {"bytes": len(found[0]), "seconds": seconds, "tier": tier}

    def _held(self, rank: int, step: int, world_size: int) -> bool:
        return any(
            found["complete"] and int(found["step"]) == step and world_of(found["values"]) == world_size
            for found in self.memory.describe(rank)["committed"].values()
        )

    def _persisted(self) -> tuple[int, int] | None:
        """The newest complete persisted step and its world size."""
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
        return step, int(complete.get("world_size", -1))

    def _persisted_at(self, step: int) -> int:
        """The world size of persisted ``step`` (-1: not complete there)."""
        try:
            return int(durable.read_complete(self.storage, step).get("world_size", -1))  # type: ignore[arg-type]
        except CheckpointError:
            return -1

    def _read_persisted(self, step: int, rank: int) -> tuple[Any, bytes, dict[str, Any]]:
        assert self.storage is not None
        found = durable.read_rank(
            self.storage, step, rank, verify=True, mac_key=self.mac_key, require_mac=self.require_mac
        )
        if self.mac_key is not None and not found[2].get("authentic"):
            logger.warning("persisted step %d carries no MAC: restored without an authenticity check", step)
        return found

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
            _, data, manifest = self._read_persisted(step, rank)
            values = manifest.get("values")
        else:
            raise CheckpointError(f"unknown tier {tier!r}")
        self.memory.install(rank, step, data, values, origin=tier)
        seconds = time.monotonic() - started
        logger.info(
            "rank %d step %d restored from the %s tier (%d bytes, %.2f s)", rank, step, tier, len(data), seconds
        )
        return {"bytes": len(data), "seconds": seconds}
