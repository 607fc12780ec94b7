"""Tier 1: each rank's newest snapshots in node memory, held by the agent.

Every rank has two slots (double buffering): a worker writes a step into the slot that does not
hold its newest committed step, so a crash mid-copy never destroys the last complete snapshot, and
the previous step stays available for the one-step rollback a recovery may need. A step counts
only after the worker's commit message; the slot's bytes are self-describing (a safetensors
header written by the worker) and its JSON values travel with the commit.

Thread-safe: the agent channel serves several workers at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from resilrun.errors import CheckpointError
from resilrun.state.shm import SeqCounters, SharedBuffer

SLOTS = 2
_CTL_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Committed:
    """A complete snapshot of one rank at one step, in one slot."""

    step: int
    slot: int
    nbytes: int
    values: Any
    # The slot's sequence counter when the commit arrived: a reader's copy is of this step only if
    # the counter still has this value after the copy (the worker may have rewritten the slot since).
    seq: int = 0


class RankMemory:
    """The slots of one global rank."""

    def __init__(self, rank: int, run_id: str) -> None:
        self.rank = rank
        self.run_id = run_id
        self.ctl = SharedBuffer.create(_CTL_BYTES, f"resilrun-{run_id}-r{rank}-ctl")
        self.seq = SeqCounters(self.ctl)
        self.slots: list[SharedBuffer | None] = [None] * SLOTS
        self.committed: dict[int, Committed] = {}

    def newest(self) -> Committed | None:
        return max(self.committed.values(), key=lambda c: c.step, default=None)

    def close(self) -> None:
        for buffer in self.slots:
            if buffer is not None:
                buffer.close()
        self.ctl.close()


class NodeMemoryTier:
    """All ranks' slots on this node; the agent channel and the replicator read it."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._ranks: dict[int, RankMemory] = {}
        self._lock = threading.Lock()
        self._listeners: list[Callable[[int, Committed], None]] = []

    def add_listener(self, listener: Callable[[int, Committed], None]) -> None:
        """Called with (rank, committed) after every commit, on the committing thread: keep it O(1)."""
        self._listeners.append(listener)

    def rank(self, rank: int) -> RankMemory:
        with self._lock:
            if rank not in self._ranks:
                self._ranks[rank] = RankMemory(rank, self.run_id)
            return self._ranks[rank]

    def allocate(self, rank: int, slot: int, nbytes: int) -> SharedBuffer:
        """(Re)allocate one slot; the other slot, and its committed step, are untouched.

        Raises:
            CheckpointError: node memory cannot hold the buffer (said before training goes on).
        """
        if slot not in range(SLOTS):
            raise CheckpointError(f"slot {slot} does not exist")
        memory = self.rank(rank)
        available = psutil.virtual_memory().available
        if nbytes > available:
            raise CheckpointError(
                f"node memory cannot hold a {nbytes / 2**20:.0f} MiB snapshot of rank {rank} "
                f"({available / 2**20:.0f} MiB available)",
                hint="tier-1 snapshots need about 2x the tracked state per rank in host memory; "
                "track less state, or use fewer ranks per node",
            )
        with self._lock:
            old = memory.slots[slot]
            memory.committed.pop(slot, None)
            memory.slots[slot] = None
        if old is not None:
            old.close()  # before the new one: a full node may have room for one of the two only
        try:
            buffer = SharedBuffer.create(nbytes, f"resilrun-{self.run_id}-r{rank}-s{slot}")
        except OSError as exc:
            # ENOMEM/ENOSPC (memory or a memory cgroup full), EFBIG (a file-size limit): all mean this
            # node cannot hold the snapshot now; the caller's step is not committed, nothing else lost.
            raise CheckpointError(
                f"node memory is full: could not allocate a {nbytes / 2**20:.1f} MiB snapshot buffer for "
                f"rank {rank}: {exc.strerror or exc}",
                hint="free host memory on this node (or raise its memory/file-size limits); tier-1 snapshots "
                "need about 2x the tracked state per rank",
            ) from exc
        with self._lock:
            memory.slots[slot] = buffer
        return buffer

    def commit(self, rank: int, step: int, slot: int, nbytes: int, values: Any) -> None:
        memory = self.rank(rank)
        with self._lock:
            if memory.slots[slot] is None:
                raise CheckpointError(f"rank {rank} committed step {step} to unallocated slot {slot}")
            committed = Committed(step, slot, nbytes, values, memory.seq.read(slot))
            memory.committed[slot] = committed
        for listener in self._listeners:
            listener(rank, committed)

    def read(self, rank: int, step: int) -> tuple[bytes, Any] | None:
        """A consistent copy of ``rank``'s snapshot of ``step``, or None if it is gone or was torn.

        Never blocks the worker: the copy is checked against the slot's sequence counter, and a
        slot the worker started overwriting meanwhile reads as None (the caller moves on).
        """
        with self._lock:
            memory = self._ranks.get(rank)
            found = None if memory is None else next((c for c in memory.committed.values() if c.step == step), None)
            buffer = None if found is None or memory is None else memory.slots[found.slot]
        if memory is None or found is None or buffer is None:
            return None
        if memory.seq.read(found.slot) != found.seq:
            return None  # already being (or been) overwritten by a newer step
        data = bytes(buffer.view()[: found.nbytes])
        if not memory.seq.is_stable(found.slot, found.seq):
            return None
        return data, found.values

    def install(self, rank: int, step: int, data: bytes | memoryview, values: Any) -> None:
        """Place a snapshot fetched from another tier into a free slot, as if the worker committed it."""
        memory = self.rank(rank)
        with self._lock:
            newest = max(memory.committed.values(), key=lambda c: c.step, default=None)
        slot = 0 if newest is None else (newest.slot + 1) % SLOTS
        buffer = memory.slots[slot]
        if buffer is None or buffer.nbytes < len(data):
            buffer = self.allocate(rank, slot, len(data))
        with self._lock:
            memory.committed.pop(slot, None)
        memory.seq.begin(slot)
        buffer.view()[: len(data)] = data
        memory.seq.end(slot)
        self.commit(rank, step, slot, len(data), values)

    def describe(self, rank: int) -> dict[str, Any]:
        """What this node holds for ``rank``: the committed steps per slot."""
        with self._lock:
            memory = self._ranks.get(rank)
            if memory is None:
                return {"committed": {}}
            return {
                "committed": {
                    str(slot): {"step": c.step, "nbytes": c.nbytes, "values": c.values}
                    for slot, c in memory.committed.items()
                }
            }

    def held_ranks(self) -> list[int]:
        with self._lock:
            return sorted(self._ranks)

    def close(self) -> None:
        with self._lock:
            ranks, self._ranks = list(self._ranks.values()), {}
        for memory in ranks:
            memory.close()
