"""Tier 1: each rank's newest snapshots in node memory, held by the agent.

Every rank has a ring of slots (two, three with peer replicas: tiers/slots.py): a worker writes a
step into the slot after its newest committed step's, so a crash mid-copy never destroys the last
complete snapshot, and the previous step stays available for the one-step rollback a recovery may
need. A step counts only after the worker's commit message; the slot's bytes are self-describing
(a safetensors header written by the worker) and its JSON values travel with the commit.

A deduplicated snapshot (snapshot/dedup.py) borrows byte ranges from other local ranks' snapshots of
the same step. It is *complete* once every owner has committed that step with the same layout;
only complete snapshots are announced to listeners (replication, persistence), offered for
restore, and read out, assembled from the owners' slots.

Why a read is never torn, on any CPU: see ``_segments``.

Readers copy outside the lock; they hold a lease on each buffer they copy from (``SharedBuffer.
acquire``), so a slot reallocated meanwhile is unmapped only when the last of them lets go.

Thread-safe: the agent channel serves several workers at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import psutil

from resilrun.errors import CheckpointError
from resilrun.snapshot.crc import crc32
from resilrun.snapshot.dedup import Borrowed, layout_hash
from resilrun.snapshot.shm import SharedBuffer
from resilrun.tiers import _borrowing, _segments
from resilrun.tiers.slots import SLOTS, Committed, RankMemory, at_step

logger = logging.getLogger(__name__)


class NodeMemoryTier:
    """All ranks' slots on this node; the agent channel and the replicator read it."""

    def __init__(
        self, run_id: str, *, checksum_commits: bool = True, slots: int = SLOTS, replicate_every: int = 1
    ) -> None:
        """``checksum_commits``: hash every commit for the readers that copy slots out (replicator,
        persister, a peer's fetch). A job with neither replicas nor a persistent tier has no such
        reader (a restore maps the slots while no rank commits), so it need not pay that pass.
        ``slots``: per rank (``slots.REPLICATED_SLOTS`` with peer replicas); ``replicate_every``:
        which snapshots the peers get (``--replicate-every``; commits that say so themselves are
        obeyed), so that the ring keeps the ones a node loss may resume from (``RankMemory.next_slot``)."""
        self.run_id = run_id
        self.slots = slots
        self._every = max(1, replicate_every)
        self._checksum_commits = checksum_commits
        self._ranks: dict[int, RankMemory] = {}
        self._lock = threading.Lock()
        self._commits = threading.Condition(self._lock)  # notified on every commit
        self._listeners: list[Callable[[int, Committed], None]] = []
        self._guards: list[Callable[[int, int], None]] = []
        self._gates: list[Callable[[int, int], float]] = []
        self._whole = False  # set once local ranks' layouts were seen to differ: no more borrowing

    def add_listener(self, listener: Callable[[int, Committed], None]) -> None:
        """Called with (rank, committed) when a snapshot becomes complete, on a committing thread: keep it O(1).

        A snapshot without borrowed bytes is complete at its own commit; one with borrowed bytes at
        the commit of its last owner.
        """
        self._listeners.append(listener)

    def add_overwrite_guard(self, guard: Callable[[int, int], None]) -> None:
        """Called with (step, round) before a slot holding that step may be rewritten.

        That is at the commit that makes it the oldest of its rank's slots (the worker writes its next
        step there once it has read the commit's answer, which waits for the guards), and when
        a slot is reallocated or installed into. Whatever refers to those bytes in place (peers'
        replicas whose DDP segments are this node's own) must copy them out or let go meanwhile.
        Runs on the committing thread and may hold it for a fraction of a step.
        """
        self._guards.append(guard)

    def add_commit_gate(self, gate: Callable[[int, int], float]) -> None:
        """Called with (rank, step) by ``pass_gates``, after a commit and before its answer; returns
        the seconds it held the worker. The replicator's: a worker reads the answer before it writes
        its next step, so holding the answer bounds how far training runs ahead of its replicas."""
        self._gates.append(gate)

    def pass_gates(self, rank: int, step: int) -> float:
        """Wait for every commit gate of ``rank``'s commit of ``step``; the seconds waited."""
        return sum(gate(rank, step) for gate in self._gates)

    def _release(self, released: Committed | None) -> None:
        if released is not None:
            for guard in self._guards:
                guard(released.step, released.round)

    def _release_before_rewrite(self, memory: RankMemory, slots: Iterable[int]) -> None:
        """Run the guards for what ``slots`` hold while it is still held: a peer's replica referring
        to those bytes copies them out now, which it cannot once the commit is forgotten. Only the
        rank's own worker commits to its slots, and it is the one giving them up, so nothing lands
        there between the guards and the caller's rewrite."""
        with self._lock:
            doomed = [memory.committed[slot] for slot in slots if slot in memory.committed]
        for committed in doomed:
            self._release(committed)

    def rank(self, rank: int) -> RankMemory:
        with self._lock:
            if rank not in self._ranks:
                self._ranks[rank] = RankMemory(rank, self.run_id, self.slots)
            return self._ranks[rank]

    def finished(self, ranks: Iterable[int]) -> int | None:
        """The newest step any of ``ranks``' workers on this node finished (the control page), or None."""
        with self._lock:
            steps = [self._ranks[r].seq.finished() for r in ranks if r in self._ranks]
        return max((s for s in steps if s >= 0), default=None)

    def allocate(self, rank: int, slot: int, nbytes: int) -> SharedBuffer | None:
        """(Re)allocate one slot; the other slots, and their committed steps, are untouched.

        Returns None when ``slot`` is a ring's extra slot (beyond double buffering) that node memory
        cannot hold: the rank's ring shrinks to two slots (logged), and the caller writes into the
        smaller ring instead. Training goes on; only a lagging replica's cover is gone.

        Raises:
            CheckpointError: node memory cannot hold the buffer (said before training goes on).
        """
        memory = self.rank(rank)
        if slot not in range(len(memory.slots)):
            raise CheckpointError(f"slot {slot} does not exist")
        try:
            return self._allocate(memory, slot, nbytes)
        except CheckpointError as exc:
            if slot < SLOTS:
                raise
            self._shrink(memory, exc)
            return None

    def _shrink(self, memory: RankMemory, why: CheckpointError) -> None:
        """Give up ``memory``'s extra slots: the ring is double buffering again."""
        extra = range(SLOTS, len(memory.slots))
        self._release_before_rewrite(memory, extra)
        with self._lock:
            dropped = memory.slots[SLOTS:]
            for slot in extra:
                memory.committed.pop(slot, None)
            memory.slots = memory.slots[:SLOTS]
        for buffer in dropped:
            if buffer is not None:
                buffer.close()
        logger.warning(
            "rank %d keeps two snapshots in node memory, not three (%s): a node loss while its replicas lag "
            "a step may now resume from an older step",
            memory.rank,
            why.message,
        )

    def _allocate(self, memory: RankMemory, slot: int, nbytes: int) -> SharedBuffer:
        rank = memory.rank
        available = psutil.virtual_memory().available
        if nbytes > available:
            raise CheckpointError(
                f"node memory cannot hold a {nbytes / 2**20:.0f} MiB snapshot of rank {rank} "
                f"({available / 2**20:.0f} MiB available)",
                hint="tier-1 snapshots need about 2x the tracked state per rank in host memory (3x with "
                "--replicas); track less state, or use fewer ranks per node",
            )
        self._release_before_rewrite(memory, (slot,))
        with self._lock:
            old = memory.slots[slot]
            memory.committed.pop(slot, None)
            memory.slots[slot] = None
        if old is not None:
            # Before the new one (a full node may have room for one of the two only), unless a reader
            # still copies from it: then when that reader lets go.
            old.close()
        try:
            buffer = SharedBuffer.create(nbytes, f"resilrun-{self.run_id}-r{rank}-s{slot}")
        except OSError as exc:
            # ENOMEM/ENOSPC (memory or a memory cgroup full), EFBIG (a file-size limit): all mean this
            # node cannot hold the snapshot now; the caller's step is not committed, nothing else lost.
            raise CheckpointError(
                f"node memory is full: could not allocate a {nbytes / 2**20:.1f} MiB snapshot buffer for "
                f"rank {rank}: {exc.strerror or exc}",
                hint="free host memory on this node (or raise its memory/file-size limits); tier-1 snapshots "
                "need about 2x the tracked state per rank (3x with --replicas)",
            ) from exc
        with self._lock:
            memory.slots[slot] = buffer
        return buffer

    def commit(
        self,
        rank: int,
        step: int,
        slot: int,
        nbytes: int,
        values: Any,
        borrowed: Borrowed = (),
        layout: int = 0,
        shared: tuple[tuple[int, int], ...] = (),
        round: int = -1,
        *,
        announce: bool = True,
        origin: str = "worker",
        previous: int | None = None,
        replicate: bool | None = None,
    ) -> bool:
        """Record a worker's commit; returns whether its next snapshot should be written whole.

        Whole means no borrowing: an owner is out of step with this rank (a job whose ranks do not
        commit in lockstep would otherwise borrow steps the owner no longer holds), or the local
        ranks' layouts differ (then nothing can be borrowed, for the rest of the job).
        """
        memory = self.rank(rank)
        with self._lock:
            buffer = memory.slots[slot]
            if buffer is None or not buffer.acquire():
                raise CheckpointError(f"rank {rank} committed step {step} to unallocated slot {slot}")
        try:
            if nbytes > buffer.nbytes:
                raise CheckpointError(f"rank {rank} committed {nbytes} bytes to a {buffer.nbytes}-byte slot")
            seq = memory.seq.read(slot)
            # Outside the lock: other ranks commit meanwhile. () means unchecked: nothing copies slots out.
            crcs = _segments.checksums(buffer.view(), nbytes, borrowed) if self._checksum_commits else ()
        finally:
            buffer.release()
        with self._lock:
            if memory.slots[slot] is not buffer:
                raise CheckpointError(f"rank {rank}'s slot {slot} was reallocated while step {step} was committed")
            committed = Committed(
                step, slot, nbytes, values, seq, borrowed, layout, shared, round, crcs, origin, previous, replicate
            )
            first = not memory.committed
            memory.record(committed)
            released = memory.committed.get(memory.next_slot(self._every))
            affected = _borrowing.affected(self._ranks, rank, committed)
            self._note_mismatch(rank, committed, affected)
            ready = [(r, c) for r, c in affected if not _borrowing.missing(self._ranks, c)]
            whole = self._whole or _borrowing.out_of_step(self._ranks, committed, first)
            self._commits.notify_all()
        for listener in self._listeners if announce else ():
            for ready_rank, ready_commit in ready:
                listener(ready_rank, ready_commit)
        self._release(released)
        return whole

    def _note_mismatch(self, rank: int, committed: Committed, affected: list[tuple[int, Committed]]) -> None:
        """Turn borrowing off for good when two local ranks lay out the same step differently (lock held)."""
        other = _borrowing.differently_laid_out(self._ranks, rank, committed, affected)
        if other is not None and not self._whole:
            self._whole = True
            logger.warning(
                "ranks %d and %d snapshot different tensors at step %d: deduplication is off for the rest of "
                "this job (each rank copies all of its state)",
                rank,
                other,
                committed.step,
            )

    def is_complete(self, rank: int, step: int) -> bool:
        """Whether node memory holds all of ``rank``'s snapshot of ``step`` (own and borrowed bytes)."""
        with self._lock:
            memory = self._ranks.get(rank)
            found = None if memory is None else at_step(memory, step)
            return found is not None and not _borrowing.missing(self._ranks, found)

    @contextlib.contextmanager
    def _leased_sources(self, rank: int, step: int) -> Iterator[list[_borrowing.Source] | None]:
        """``_borrowing.sources``, each buffer kept mapped until the block ends (a lease, see ``SharedBuffer``)."""
        with self._lock:
            sources = _borrowing.sources(self._ranks, rank, step)
            leased = [buffer for _, _, buffer in sources or () if buffer.acquire()]
        try:
            # A buffer still in a slot is never closed under the lock, so every lease was granted.
            yield sources if sources is not None and len(leased) == len(sources) else None
        finally:
            for buffer in leased:
                buffer.release()

    @contextlib.contextmanager
    def leased(self, rank: int, committed: Committed) -> Iterator[SharedBuffer | None]:
        """The buffer of the slot holding ``committed``, mapped until the block ends; None when that
        commit is no longer held (for a reader that streams a slot itself: the replicator)."""
        with self._lock:
            memory = self._ranks.get(rank)
            buffer = None
            if memory is not None and memory.committed.get(committed.slot) is committed:
                buffer = memory.slots[committed.slot]
            if buffer is not None and not buffer.acquire():
                buffer = None
        try:
            yield buffer
        finally:
            if buffer is not None:
                buffer.release()

    def read(self, rank: int, step: int) -> tuple[bytearray, Any] | None:
        """A consistent, complete copy of ``rank``'s snapshot of ``step``, or None if gone or torn.

        Never blocks a worker: a slot its worker started overwriting meanwhile (the sequence counter
        moved, or the copy fails its commit's crc32s) makes it None, and the caller moves on.
        Borrowed ranges are filled in from their owners' slots.
        """
        with self._leased_sources(rank, step) as sources:
            if sources is None:
                return None
            if any(memory.seq.read(c.slot) != c.seq for memory, c, _ in sources):
                return None  # already being (or been) overwritten by a newer step
            found, buffer = sources[0][1], sources[0][2]
            data = bytearray(buffer.view()[: found.nbytes])
            by_owner = {memory.rank: (c, owner_buffer) for memory, c, owner_buffer in sources[1:]}
            for owner, begin, end in found.borrowed:
                data[begin:end] = by_owner[owner][1].view()[begin:end]
            if not all(memory.seq.is_stable(c.slot, c.seq) for memory, c, _ in sources):
                return None
            copied = memoryview(data)
            intact = all(crc32(copied[begin:end]) == crc for begin, end, crc in found.crcs) and all(
                _segments.is_intact(*by_owner[owner], copied, begin, end) for owner, begin, end in found.borrowed
            )
            if not intact:
                _segments.log_torn(rank, step)
                return None
            return data, found.values

    def lend(self, rank: int, step: int) -> tuple[Borrowed, dict[int, SharedBuffer]] | None:
        """What a restoring worker maps to load ``rank``'s ``step``: its borrowed ranges and the
        owners' slot buffers holding them (None: the step is not complete here).

        The worker then reads the borrowed tensors straight from the owners' slots (one copy, into
        its tensors). No counter check is needed while it does: no rank commits before every rank
        has restored (the first step's collectives wait for all of them).
        """
        with self._lock:
            sources = _borrowing.sources(self._ranks, rank, step)
        if sources is None:
            return None
        found = sources[0][1]
        return found.borrowed, {memory.rank: buffer for memory, _, buffer in sources[1:]}

    def holds(self, step: int, layout: int, round: int, wait_s: float) -> bool:
        """Whether a local rank holds a complete snapshot of ``step`` trained in generation ``round``,
        laid out as ``layout``, waiting up to ``wait_s`` for a local commit of it (for a peer's
        replica whose shared, DDP-equal, segments this node holds itself)."""
        deadline = time.monotonic() + wait_s
        with self._commits:
            while _borrowing.holder(self._ranks, step, layout, round) is None:
                newest = [m.newest() for m in self._ranks.values()]
                coming = any(n is None or n.step < step for n in newest)
                left = deadline - time.monotonic()
                if not coming or left <= 0:
                    return False
                self._commits.wait(left)
        return True

    def copy_shared(
        self, step: int, layout: int, round: int, ranges: Sequence[tuple[int, int]], into: memoryview, wait_s: float
    ) -> bool:
        """Copy ``ranges`` of a local rank's complete snapshot of ``step`` (see ``holds``) into
        ``into``; False when none came within ``wait_s``, or the copy was torn."""
        if not self.holds(step, layout, round, wait_s):
            return False
        with self._lock:
            holder = _borrowing.holder(self._ranks, step, layout, round)
        if holder is None:
            return False
        with self._leased_sources(holder, step) as sources:
            if sources is None:
                return False
            if any(memory.seq.read(c.slot) != c.seq for memory, c, _ in sources):
                return False
            found, own = sources[0][1], sources[0][2]
            owners = {memory.rank: (c, buffer) for memory, c, buffer in sources[1:]}
            pieces = [piece for begin, end in ranges for piece in _segments.pieces(found.borrowed, begin, end)]
            for piece_begin, piece_end, owner in pieces:
                buffer = own if owner is None else owners[owner][1]
                _copy(into, buffer.view(), piece_begin, piece_end)
            if not all(memory.seq.is_stable(c.slot, c.seq) for memory, c, _ in sources):
                return False
            for piece_begin, piece_end, owner in pieces:
                commit, buffer = (found, own) if owner is None else owners[owner]
                if not _segments.is_intact(commit, buffer, into, piece_begin, piece_end):
                    _segments.log_torn(holder, step)
                    return False
            return True

    def install(
        self,
        rank: int,
        step: int,
        data: bytes | memoryview,
        values: Any,
        *,
        announce: bool = True,
        origin: str = "peer",
    ) -> None:
        """Place a snapshot fetched from another tier (``origin``) into a free slot, as if the worker
        committed it.

        ``announce=False``: the listeners (replication, persistence) are not told, for a snapshot
        that is only read by a restore (one written at another world size)."""
        memory = self.rank(rank)
        while True:
            slot = self.next_slot(rank)
            buffer = memory.slots[slot]
            if buffer is None or buffer.nbytes < len(data):
                buffer = self.allocate(rank, slot, len(data))
            if buffer is not None:
                break  # else the ring shrank (no room for its extra slot): choose again
        self._release_before_rewrite(memory, (slot,))
        with self._lock:
            memory.committed.pop(slot, None)
        memory.seq.begin(slot)
        buffer.view()[: len(data)] = data
        memory.seq.end(slot)
        self.commit(rank, step, slot, len(data), values, layout=layout_hash(data), announce=announce, origin=origin)

    def next_slot(self, rank: int) -> int:
        """The slot ``rank``'s next snapshot goes to (``RankMemory.next_slot``): the worker writes there."""
        memory = self.rank(rank)
        with self._lock:
            return memory.next_slot(self._every)

    def describe(self, rank: int) -> dict[str, Any]:
        """What this node holds for ``rank``: the committed steps per slot, whether each is complete,
        and the slot the next snapshot goes to."""
        with self._lock:
            memory = self._ranks.get(rank)
            if memory is None:
                return {"committed": {}, "next": 0}
            return {
                "next": memory.next_slot(self._every),
                "committed": {
                    str(slot): {
                        "step": c.step,
                        "nbytes": c.nbytes,
                        "values": c.values,
                        "complete": not _borrowing.missing(self._ranks, c),
                    }
                    for slot, c in memory.committed.items()
                },
            }

    def held_ranks(self) -> list[int]:
        with self._lock:
            return sorted(self._ranks)

    def close(self) -> None:
        with self._lock:
            ranks, self._ranks = list(self._ranks.values()), {}
        for memory in ranks:
            memory.close()


_COPY_CHUNK = 64 << 20


def _copy(into: memoryview, source: memoryview, begin: int, end: int) -> None:
    """``into[begin:end] = source[begin:end]`` in chunks: a memoryview copy holds the GIL, and the
    agent's store server is a Python thread of the same process, which must not wait seconds."""
    target = into.cast("B") if into.format != "B" else into
    try:
        for start in range(begin, end, _COPY_CHUNK):
            stop = min(start + _COPY_CHUNK, end)
            target[start:stop] = source[start:stop]
    finally:
        source.release()
        if target is not into:
            target.release()
