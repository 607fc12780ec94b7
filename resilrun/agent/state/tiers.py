"""The agent's view of every tier holding a rank's snapshots, for the workers' restore.

Workers plan (``state.restore.plan_restore``) from what this reports, then ask for the chosen step;
whatever tier it comes from, it is installed into the rank's node-memory slot, so a worker always
loads from memory. A rank resuming at another world size instead reads other (old) ranks'
snapshots: in place where node memory holds them, else just the bytes it needs, which ``peek`` and
``gather_ranges`` bring from a peer or storage into a memfd of its own, not into node memory.
Peers are reached through a callable the supervisor provides per round.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from resilrun.errors import CheckpointError, CheckpointNotFoundError
from resilrun.snapshot.dedup import Borrowed
from resilrun.snapshot.layout import parse_header
from resilrun.snapshot.restore import PEER_STEPS, world_of
from resilrun.snapshot.selection import Selection
from resilrun.snapshot.shm import SharedBuffer
from resilrun.storage.api import Storage
from resilrun.tiers import durable
from resilrun.tiers.memory import NodeMemoryTier

logger = logging.getLogger(__name__)

# (rank, step, selection or None for all, buffer maker or None) -> (bytes, values) from whichever
# peer holds it, or None.
PeerFetch = Callable[[int, int, Selection | None, Callable[[int], memoryview] | None], tuple[Any, Any] | None]
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
        persisted_before: Callable[[], int | None] | None = None,
        on_rollback: Callable[[int | None, int], None] | None = None,
    ) -> None:
        """``mac_key``: the durable key (tiers/authentic.py): persisted steps are checked against
        their MACs; ``require_mac``: no persisted step is restored unless they verify (none at all
        without a key: --require-auth).

        A rollback of the persistent tier (COMPLETE.json of the newest steps deleted, or the bucket
        put back from an older copy: MACs cannot tell, each older step is authentic) is reported,
        not refused: when the newest complete step in storage is older than the newest this agent
        saw complete there earlier or ``persisted_before()`` says was persisted (the persister's
        newest commit), a warning is logged and ``on_rollback(newest now, newest before)`` called,
        once per such pair. Only what this agent saw is known: storage rolled back before its
        first look, or to a step no agent of this node saw, is not detected."""
        self.memory = memory
        self.mac_key = mac_key
        self.require_mac = require_mac
        self.persisted_before = persisted_before
        self.on_rollback = on_rollback
        self._rollback_lock = threading.Lock()
        self._newest_seen: int | None = None
        self._rollback_said: tuple[int | None, int] | None = None
        self.storage = storage
        self.peer_held = peer_held
        self.peer_fetch = peer_fetch
        self.peer_inventory = peer_inventory

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

    def peek(self, rank: int, step: int, world_size: int) -> dict[str, Any]:
        """The values of ``rank``'s snapshot of ``step`` (written at ``world_size``), which a rank
        resuming at another world size plans its reads from, and whether node memory holds it
        (then it is read in place, not gathered).

        Raises:
            CheckpointNotFoundError: no tier has it (the caller plans again).
        """
        for found in self.memory.describe(rank)["committed"].values():
            if found["complete"] and int(found["step"]) == step and world_of(found["values"]) == world_size:
                return {"values": found["values"], "memory": True}
        # An anonymous mapping: only the header is written, the pages past it are never touched.
        fetched = self._ranged(
            rank, step, world_size, Selection(), lambda size: memoryview(mmap.mmap(-1, max(size, 1)))
        )
        return {"values": fetched[1], "memory": False}

    def gather_ranges(
        self, rank: int, step: int, world_size: int, select: Selection
    ) -> tuple[dict[str, Any], int | None]:
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
        if self._held(rank, step, world_size):
            return {"bytes": 0, "seconds": 0.0, "tier": "memory"}, None
        started = time.monotonic()
        made: list[SharedBuffer] = []

        def into(size: int) -> memoryview:
            for old in made:
                old.close()
            made[:] = [SharedBuffer.create(size, f"resilrun-part-{rank}-{step}", populate=False)]
            return made[0].view()

        try:
            nbytes, _, tier = self._ranged(rank, step, world_size, select, into)
            fd = os.dup(made[0].fd)
        finally:
            for buffer in made:
                buffer.close()
        seconds = time.monotonic() - started
        logger.info(
            "rank %d step %d (world size %d): %d selected bytes from the %s tier", rank, step, world_size, nbytes, tier
        )
        return {"bytes": nbytes, "seconds": seconds, "tier": tier}, fd

    def _ranged(
        self, rank: int, step: int, world_size: int, select: Selection, into: Callable[[int], memoryview]
    ) -> tuple[int, Any, str]:
        """(bytes moved, values, tier) of a ranged read from the first tier that has the step."""
        if self.peer_fetch is not None:
            found = self.peer_fetch(rank, step, select, into)
            if found is not None and world_of(found[1]) == world_size:
                data = memoryview(found[0])
                layout = parse_header(data, len(data))
                return sum(e - b for b, e in select.ranges(layout)), found[1], "peer"
        complete = self._complete(step)
        if complete is not None and complete["world_size"] == world_size:
            _, manifest, nbytes = durable.read_rank_ranges(
                self.storage,  # type: ignore[arg-type]
                step,
                rank,
                select,
                into,
                complete=complete,
                mac_key=self.mac_key,
                require_mac=self.require_mac,
            )
            if self.mac_key is not None and not manifest.get("authentic"):
                logger.warning("persisted step %d carries no MAC: restored without an authenticity check", step)
            return nbytes, manifest.get("values"), "persistent"
        raise CheckpointNotFoundError(f"no tier holds step {step} of rank {rank} (world size {world_size})")

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
            self._check_rollback(step)
            if step is None:
                return None
            complete = durable.read_complete(self.storage, step)
        except CheckpointError as exc:
            logger.warning("persistent tier unreadable: %s", exc.message)
            return None
        return step, int(complete.get("world_size", -1))

    def _check_rollback(self, newest: int | None) -> None:
        """Report storage's newest complete step being older than one known complete before."""
        recorded = self.persisted_before() if self.persisted_before is not None else None
        with self._rollback_lock:
            known = max((s for s in (self._newest_seen, recorded) if s is not None), default=None)
            self._newest_seen = max((s for s in (known, newest) if s is not None), default=None)
            if known is None or (newest is not None and newest >= known) or self._rollback_said == (newest, known):
                return
            self._rollback_said = (newest, known)
        logger.warning(
            "the persistent tier was rolled back: its newest complete step is %s, but step %d was complete "
            "there before (its COMPLETE.json deleted, or the bucket put back from an older copy); a restore "
            "from storage resumes from the older step",
            "none" if newest is None else newest,
            known,
        )
        if self.on_rollback is not None:
            self.on_rollback(newest, known)

    def _complete(self, step: int) -> dict[str, Any] | None:
        """Persisted ``step``'s COMPLETE.json (None: no storage, or not complete there)."""
        if self.storage is None:
            return None
        try:
            return durable.read_complete(self.storage, step)
        except CheckpointError:
            return None

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
            found = self.peer_fetch(rank, step, None, None) if self.peer_fetch else None
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
