"""Tier 2 storage: the replicas this node holds for other nodes' ranks, in node memory.

Each rank has two memfd-backed slots (double buffering, as in tier 1): a replica being received
is written into the slot that does not hold the most recently completed replica, so a transfer
that fails, is aborted or is corrupt never destroys the previous complete one. Slot lifecycle:

    | state    | how it gets there                           | visible to steps/read/fetch |
    |----------|---------------------------------------------|-----------------------------|
    | empty    | start, release() of a failed transfer       | no                          |
    | writing  | reserve(): generation bumped, bytes arrive  | no                          |
    | complete | publish(), after COMMIT and every crc32     | yes                         |

A replica may hold its shared (DDP-equal) segments by reference: this node's own ranks hold the
same step of the same generation, so those bytes are not copied into the slot but left where they
are (``Replica.local``). They are copied in (``materialize``) before a reader streams the replica,
or before this node's worker may rewrite the slot they are in; a reference whose bytes are gone
makes the replica count for nothing.

Invariants: at most one transfer per rank at a time; a slot's generation changes whenever it
starts being rewritten, so a reader streaming from it (a FETCH) can tell that its bytes changed
under it; buffers are allocated (and pre-faulted) only after the node's free memory was checked,
and then reused. Thread-safe: a lock guards the slot table, never the bytes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from resilrun.snapshot.crc import crc32
from resilrun.snapshot.shm import SharedBuffer
from resilrun.tiers.headroom import HEADROOM_BYTES, available_bytes
from resilrun.tiers.peer.wire import ReplicationError

SLOTS = 2


@dataclass(frozen=True, slots=True)
class LocalRef:
    """Byte ranges of a replica that are this node's own snapshot of the same step (generation
    ``round``, layout ``layout``), not yet copied into the replica's slot."""

    layout: int
    round: int
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Replica:
    """A complete, verified replica: the metadata the sender announced and the crc32s it committed
    (None for segments held by reference, or copied in from this node's memory)."""

    rank: int
    step: int
    world_size: int | None
    nbytes: int
    values: Any
    bounds: tuple[int, ...]
    crcs: tuple[int | None, ...]
    local: LocalRef | None = None


@dataclass(frozen=True, slots=True)
class Reservation:
    """A slot handed to one incoming transfer; ``view`` is exactly the announced bytes."""

    rank: int
    slot: int
    generation: int
    view: memoryview


class _Slot:
    __slots__ = ("buffer", "generation", "order", "replica", "writing")

    def __init__(self) -> None:
        self.buffer: SharedBuffer | None = None
        self.generation = 0
        self.order = 0  # when its replica was published; the newest is never overwritten
        self.replica: Replica | None = None
        self.writing = False


class ReplicaStore:
    """Replicas held for other nodes' ranks, at most two complete steps per rank."""

    def __init__(self, run_id: str = "job") -> None:
        self._name = f"resilrun-{run_id}-replica"
        self._slots: dict[int, list[_Slot]] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified when a replica is published or released
        self._materializing = threading.Lock()
        self._published = 0
        self._closed = False

    # -- the receiving side (ReplicaServer) ------------------------------------------------------
    def reserve(self, rank: int, nbytes: int) -> Reservation:
        """Hand out the slot a new replica of ``rank`` may be written into.

        Raises:
            ReplicationError: the store is closed, a transfer for ``rank`` is in progress, or node
                memory cannot hold ``nbytes`` more.
        """
        with self._lock:
            if self._closed:
                raise ReplicationError("the replica store is closed")
            slots = self._slots.setdefault(rank, [_Slot() for _ in range(SLOTS)])
            if any(s.writing for s in slots):
                raise ReplicationError(f"a replica of rank {rank} is already being received")
            index = min(range(SLOTS), key=lambda i: (slots[i].replica is not None, slots[i].order))
            slot = slots[index]
            slot.writing, slot.replica = True, None
            slot.generation += 1
            generation, buffer = slot.generation, slot.buffer
            if buffer is not None and buffer.nbytes < nbytes:
                slot.buffer = None  # too small: replaced below, and never used again whatever happens
        if buffer is None or buffer.nbytes < nbytes:
            try:
                buffer = self._allocate(rank, index, nbytes, old=buffer)
            except BaseException:
                with self._lock:
                    slot.writing = False
                raise
            with self._lock:
                current = slot.generation == generation
                if current:
                    slot.buffer = buffer
            if not current:  # the store closed while the buffer was being made
                buffer.close()
                raise ReplicationError("the replica store is closed")
        return Reservation(rank, index, generation, buffer.view()[:nbytes])

    def _allocate(self, rank: int, index: int, nbytes: int, old: SharedBuffer | None) -> SharedBuffer:
        reclaimable = old.nbytes if old is not None else 0
        available = available_bytes() + reclaimable
        if nbytes + HEADROOM_BYTES > available:
            raise ReplicationError(
                f"node memory cannot hold a {nbytes / 2**20:.0f} MiB replica of rank {rank} "
                f"({available / 2**20:.0f} MiB available)"
            )
        if old is not None:
            old.close()  # a FETCH still streaming from it keeps its mapping alive; its generation check fails
        try:
            return SharedBuffer.create(nbytes, f"{self._name}-r{rank}-s{index}")
        except OSError as exc:
            raise ReplicationError(f"could not allocate a {nbytes} byte replica buffer: {exc}") from exc

    def publish(self, reservation: Reservation, replica: Replica) -> None:
        """Make a fully received, verified replica visible (and drop an older copy of the same step)."""
        with self._lock:
            slots = self._slots.get(reservation.rank)
            if slots is None or slots[reservation.slot].generation != reservation.generation:
                return  # closed meanwhile
            for index, other in enumerate(slots):
                if index != reservation.slot and other.replica is not None and other.replica.step == replica.step:
                    other.replica = None
            self._published += 1
            slot = slots[reservation.slot]
            slot.replica, slot.writing, slot.order = replica, False, self._published
            self._changed.notify_all()

    def release(self, reservation: Reservation) -> None:
        """Give up a transfer: its slot is empty again; the other slot's replica was never touched."""
        with self._lock:
            slots = self._slots.get(reservation.rank)
            if slots is not None and slots[reservation.slot].generation == reservation.generation:
                slots[reservation.slot].writing = False
                self._changed.notify_all()

    def wait_idle(self, rank: int, timeout_s: float) -> bool:
        """Whether no transfer of ``rank`` is in progress, waiting up to ``timeout_s`` for one to end."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while any(s.writing for s in self._slots.get(rank, [])):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._changed.wait(left)
            return True

    # -- references into this node's memory -------------------------------------------------------
    def referencing(self, step: int, round: int) -> list[tuple[int, int]]:
        """(rank, step) of the replicas whose references are to this node's snapshots of ``step`` or
        older (in generation ``round``, or any older generation)."""
        with self._lock:
            return [
                (rank, slot.replica.step)
                for rank, slots in self._slots.items()
                for slot in slots
                if slot.replica is not None
                and slot.replica.local is not None
                and (slot.replica.local.round, slot.replica.step) <= (round, step)
            ]

    def wait_newer_everywhere(self, step: int, timeout_s: float) -> bool:
        """Whether every rank whose newest replica here is ``step`` or newer has one newer than
        ``step``, waiting up to ``timeout_s``: then no rank needs ``step`` as the step it shares
        with the others (a restore resumes every rank of a lost node at one step)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while any(newest == step for newest in self._newest()):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._changed.wait(left)
            return True

    def _newest(self) -> list[int]:
        """Each rank's newest complete step (lock held)."""
        steps = ([s.replica.step for s in slots if s.replica is not None] for slots in self._slots.values())
        return [max(held) for held in steps if held]

    def materialize(
        self, rank: int, step: int, fill: Callable[[LocalRef, memoryview], bool], checksum: bool = True
    ) -> bool:
        """Copy a replica's referenced bytes into its slot (``fill`` copies them from node memory).

        Returns whether the replica is now whole in its slot; when ``fill`` fails (the referenced
        snapshot is gone) the replica is dropped, never offered half-filled. ``checksum``: record
        the crc32s of the copied segments, so that bytes corrupted at rest from now on are caught
        (a reader about to stream the replica, which hashes as it sends, can skip that).
        """
        with self._materializing:
            with self._lock:
                found = self._find(rank, step)
                if found is None:
                    return False
                slot, replica = found
                if replica.local is None:
                    return True
                generation, buffer = slot.generation, slot.buffer
            view = None if buffer is None else buffer.view()[: replica.nbytes]
            filled = view is not None and fill(replica.local, view)
            crcs = replica.crcs
            if filled and checksum and view is not None:
                crcs = _checksum_missing(view, replica.bounds, crcs)
            with self._lock:
                if slot.generation != generation or slot.replica is not replica:
                    return False
                slot.replica = replace(replica, local=None, crcs=crcs) if filled else None
                return filled

    # -- the serving side --------------------------------------------------------------------------
    def open(self, rank: int, step: int) -> tuple[memoryview, Replica, Callable[[], bool]] | None:
        """The bytes of a complete replica without copying them, and a check that they are still it.

        The check turns False as soon as the slot starts being rewritten, so a reader that streams
        the view and asks afterwards never passes on a torn replica as complete.
        """
        with self._lock:
            found = self._find(rank, step)
            if found is None:
                return None
            slot, replica = found
            generation, buffer = slot.generation, slot.buffer
        if buffer is None:
            return None

        def is_current() -> bool:
            with self._lock:
                return slot.generation == generation and slot.replica is replica

        return buffer.view()[: replica.nbytes], replica, is_current

    def discard(self, rank: int, step: int) -> None:
        """Forget a replica found corrupt in memory, so that nobody is offered it again."""
        with self._lock:
            found = self._find(rank, step)
            if found is not None:
                found[0].replica = None

    def _find(self, rank: int, step: int) -> tuple[_Slot, Replica] | None:
        for slot in self._slots.get(rank, []):
            if slot.replica is not None and slot.replica.step == step:
                return slot, slot.replica
        return None

    # -- queries -----------------------------------------------------------------------------------
    def steps(self, rank: int) -> list[int]:
        """Steps of ``rank`` held complete, newest first."""
        with self._lock:
            return sorted((s.replica.step for s in self._slots.get(rank, []) if s.replica is not None), reverse=True)

    def replica(self, rank: int, step: int) -> Replica | None:
        """The metadata of a complete replica (world size, values, checksums), or None."""
        with self._lock:
            found = self._find(rank, step)
            return None if found is None else found[1]

    def read(self, rank: int, step: int) -> tuple[bytes, Any] | None:
        """A copy of a complete replica and its values, or None if absent or rewritten meanwhile."""
        opened = self.open(rank, step)
        if opened is None:
            return None
        view, replica, is_current = opened
        data = bytes(view)
        return (data, replica.values) if is_current() else None

    def entries(self) -> list[tuple[int, int, Any]]:
        """Every complete replica as (rank, step, values)."""
        with self._lock:
            return [
                (rank, s.replica.step, s.replica.values)
                for rank, rank_slots in self._slots.items()
                for s in rank_slots
                if s.replica is not None
            ]

    def held(self) -> dict[int, list[int]]:
        """Every rank with a complete replica -> its steps, newest first."""
        with self._lock:
            ranks = [rank for rank, slots in self._slots.items() if any(s.replica is not None for s in slots)]
        return {rank: self.steps(rank) for rank in sorted(ranks)}

    def close(self) -> None:
        """Free every buffer; transfers still running fail their generation check and count for nothing."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()
            slots, self._slots = self._slots, {}
            buffers = []
            for rank_slots in slots.values():
                for slot in rank_slots:
                    slot.generation += 1
                    slot.replica = None
                    buffers.append(slot.buffer)
                    slot.buffer = None
        for buffer in buffers:
            if buffer is not None:
                buffer.close()


def _checksum_missing(
    view: memoryview, bounds: tuple[int, ...], crcs: tuple[int | None, ...]
) -> tuple[int | None, ...]:
    """``crcs`` with each missing one computed from ``view`` (segments are ``bounds[i]..bounds[i + 1]``)."""
    return tuple(
        crc32(view[bounds[index] : bounds[index + 1]]) if crc is None else crc for index, crc in enumerate(crcs)
    )
