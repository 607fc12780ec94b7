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

Why a read is never torn, on any CPU: the agent hashes each commit's own bytes (crc32 per segment:
the header, each tensor) while handling the commit, before the commit is visible and before it is
answered. Those bytes cannot change then: the worker rewrites a slot only after it has read the
answer to a *later* commit (it writes the slot not holding its newest step, after collecting the
previous commit's answer), and the answer travels through a socket, whose kernel locks order the
worker's stores before the agent's receive and the agent's loads before the worker's next stores,
whatever the CPU's memory model. A reader then checks its private copy, after copying, against those
crc32s: a copy with bytes of two steps fails, however the slot's stores and the sequence counter
became visible to it (on aarch64 the counter alone can read stable over a torn copy). The counter
stays as the cheap early exit. The cost is one crc32 pass per commit on the agent's channel thread
(ISA-L's crc32 outruns the memcpy the worker paid for the same bytes; the worker reads the answer
only at its next step), nothing on the worker; a reader that copies pays one pass over its copy.

Readers copy outside the lock; they hold a lease on each buffer they copy from (``SharedBuffer.
acquire``), so a slot reallocated meanwhile is unmapped only when the last of them lets go.

Thread-safe: the agent channel serves several workers at once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import psutil
import torch

from resilrun.errors import CheckpointCorruptError, CheckpointError
from resilrun.snapshot._crc import crc32
from resilrun.snapshot.dedup import Borrowed, layout_hash, owners_of
from resilrun.snapshot.layout import parse_header
from resilrun.snapshot.shm import SharedBuffer
from resilrun.tiers.slots import SLOTS, Committed, RankMemory, at_step, lender

logger = logging.getLogger(__name__)

_Source = tuple[RankMemory, Committed, SharedBuffer]


class NodeMemoryTier:
    """All ranks' slots on this node; the agent channel and the replicator read it."""

    def __init__(self, run_id: str, *, checksum_commits: bool = True, slots: int = SLOTS) -> None:
        """``checksum_commits``: hash every commit for the readers that copy slots out (replicator,
        persister, a peer's fetch). A job with neither replicas nor a persistent tier has no such
        reader (a restore maps the slots while no rank commits), so it need not pay that pass.
        ``slots``: per rank (``slots.REPLICATED_SLOTS`` with peer replicas)."""
        self.run_id = run_id
        self.slots = slots
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
            crcs = _checksums(buffer.view(), nbytes, borrowed) if self._checksum_commits else ()
        finally:
            buffer.release()
        with self._lock:
            if memory.slots[slot] is not buffer:
                raise CheckpointError(f"rank {rank}'s slot {slot} was reallocated while step {step} was committed")
            committed = Committed(
                step, slot, nbytes, values, seq, borrowed, layout, shared, round, crcs, origin, previous
            )
            first = not memory.committed
            memory.committed[slot] = committed
            released = memory.committed.get(memory.after(slot)) if memory.after(slot) != slot else None
            affected = self._affected(rank, committed)
            self._note_mismatch(rank, committed, affected)
            ready = [(r, c) for r, c in affected if not self._missing(r, c)]
            whole = self._whole or self._out_of_step(committed, first)
            self._commits.notify_all()
        for listener in self._listeners if announce else ():
            for ready_rank, ready_commit in ready:
                listener(ready_rank, ready_commit)
        self._release(released)
        return whole

    def _affected(self, rank: int, committed: Committed) -> list[tuple[int, Committed]]:
        """This commit, and the same step of every rank that borrows from ``rank`` (lock held)."""
        found = [(rank, committed)]
        for other, memory in self._ranks.items():
            if other == rank:
                continue
            for candidate in memory.committed.values():
                if candidate.step == committed.step and rank in owners_of(candidate.borrowed):
                    found.append((other, candidate))
        return found

    def _missing(self, rank: int, committed: Committed) -> set[int]:
        """Owners that do not hold ``committed``'s step with its layout (lock held)."""
        missing = set()
        for owner in owners_of(committed.borrowed):
            memory = self._ranks.get(owner)
            if memory is None or lender(memory, committed) is None:
                missing.add(owner)
        return missing

    def _note_mismatch(self, rank: int, committed: Committed, affected: list[tuple[int, Committed]]) -> None:
        """Turn borrowing off for good when two local ranks lay out the same step differently (lock held)."""
        pairs = [(q, c) for q, c in affected if q != rank]
        for owner in owners_of(committed.borrowed):
            memory = self._ranks.get(owner)
            match = None if memory is None else at_step(memory, committed.step)
            if match is not None:
                pairs.append((owner, match))
        # Another generation's copy of the step is an abandoned timeline, not a different layout.
        other = next((q for q, c in pairs if c.round == committed.round and c.layout != committed.layout), None)
        if other is not None and not self._whole:
            self._whole = True
            logger.warning(
                "ranks %d and %d snapshot different tensors at step %d: deduplication is off for the rest of "
                "this job (each rank copies all of its state)",
                rank,
                other,
                committed.step,
            )

    def _out_of_step(self, committed: Committed, first: bool) -> bool:
        """Whether an owner's newest commit is more than a step away from this one (lock held).

        In lockstep (DDP) an owner is at most one step behind, or one ahead when its commit was
        handled before this one's; further apart, it may no longer hold the step when it is read.
        """
        for owner in owners_of(committed.borrowed):
            memory = self._ranks.get(owner)
            newest = None if memory is None else memory.newest()
            if newest is None:
                if not first:
                    return True
            elif not committed.step - 1 <= newest.step <= committed.step + 1:
                return True
        return False

    def is_complete(self, rank: int, step: int) -> bool:
        """Whether node memory holds all of ``rank``'s snapshot of ``step`` (own and borrowed bytes)."""
        with self._lock:
            memory = self._ranks.get(rank)
            found = None if memory is None else at_step(memory, step)
            return found is not None and not self._missing(rank, found)

    def _sources(self, rank: int, step: int) -> list[_Source] | None:
        """Each slot that holds part of ``rank``'s ``step``, its own first; None if one is gone (lock held)."""
        memory = self._ranks.get(rank)
        found = None if memory is None else at_step(memory, step)
        if memory is None or found is None or memory.slots[found.slot] is None:
            return None
        sources = [(memory, found, memory.slots[found.slot])]
        for owner in sorted(owners_of(found.borrowed)):
            owner_memory = self._ranks.get(owner)
            held = None if owner_memory is None else lender(owner_memory, found)
            if owner_memory is None or held is None:
                return None
            sources.append((owner_memory, held, owner_memory.slots[held.slot]))
        if any(buffer is None for _, _, buffer in sources):
            return None
        return sources  # type: ignore[return-value]  # None excluded just above

    @contextlib.contextmanager
    def _leased_sources(self, rank: int, step: int) -> Iterator[list[_Source] | None]:
        """``_sources``, each buffer kept mapped until the block ends (a lease, see ``SharedBuffer``)."""
        with self._lock:
            sources = self._sources(rank, step)
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
                _is_intact(*by_owner[owner], copied, begin, end) for owner, begin, end in found.borrowed
            )
            if not intact:
                _log_torn(rank, step)
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
            sources = self._sources(rank, step)
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
            while self._holder(step, layout, round) is None:
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
            holder = self._holder(step, layout, round)
        if holder is None:
            return False
        with self._leased_sources(holder, step) as sources:
            if sources is None:
                return False
            if any(memory.seq.read(c.slot) != c.seq for memory, c, _ in sources):
                return False
            found, own = sources[0][1], sources[0][2]
            owners = {memory.rank: (c, buffer) for memory, c, buffer in sources[1:]}
            target = torch.frombuffer(into, dtype=torch.uint8) if len(into) else torch.empty(0, dtype=torch.uint8)
            pieces = [piece for begin, end in ranges for piece in _pieces(found.borrowed, begin, end)]
            for piece_begin, piece_end, owner in pieces:
                buffer = own if owner is None else owners[owner][1]
                target[piece_begin:piece_end].copy_(buffer.tensor[piece_begin:piece_end])
            if not all(memory.seq.is_stable(c.slot, c.seq) for memory, c, _ in sources):
                return False
            for piece_begin, piece_end, owner in pieces:
                commit, buffer = (found, own) if owner is None else owners[owner]
                if not _is_intact(commit, buffer, into, piece_begin, piece_end):
                    _log_torn(holder, step)
                    return False
            return True

    def _holder(self, step: int, layout: int, round: int) -> int | None:
        """A local rank holding a complete snapshot of ``step`` of that layout and generation (lock held)."""
        for rank, memory in sorted(self._ranks.items()):
            found = at_step(memory, step)
            if found is None or round < 0 or found.round != round or found.layout != layout:
                continue
            if not self._missing(rank, found):
                return rank
        return None

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
            with self._lock:
                newest = max(memory.committed.values(), key=lambda c: c.step, default=None)
            slot = 0 if newest is None else memory.after(newest.slot)
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

    def describe(self, rank: int) -> dict[str, Any]:
        """What this node holds for ``rank``: the committed steps per slot, and whether each is complete."""
        with self._lock:
            memory = self._ranks.get(rank)
            if memory is None:
                return {"committed": {}}
            return {
                "committed": {
                    str(slot): {
                        "step": c.step,
                        "nbytes": c.nbytes,
                        "values": c.values,
                        "complete": not self._missing(rank, c),
                    }
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


def _pieces(borrowed: Borrowed, begin: int, end: int) -> Iterator[tuple[int, int, int | None]]:
    """[begin, end) split by which slot holds each part: the owner rank's where borrowed, else None (own)."""
    position = begin
    for owner, lent_begin, lent_end in sorted(borrowed, key=lambda r: r[1]):
        lo, hi = max(lent_begin, begin), min(lent_end, end)
        if lo >= hi:
            continue
        if position < lo:
            yield position, lo, None
        yield lo, hi, owner
        position = hi
    if position < end:
        yield position, end, None


def _checksums(view: memoryview, nbytes: int, borrowed: Borrowed) -> tuple[tuple[int, int, int], ...]:
    """(begin, end, crc32) of each segment of ``view[:nbytes]`` outside ``borrowed``.

    Segments are cut at the tensors' bounds (when the bytes are a snapshot) and at the borrowed
    ranges, so that a range another rank borrows is whole segments here, and a crc32 here is the one
    the durable manifest and a peer's trailer carry for that tensor.
    """
    cuts = {0, nbytes, *_tensor_cuts(view, nbytes)}
    for _, begin, end in borrowed:
        cuts.update((begin, end))
    bounds = sorted(cut for cut in cuts if 0 <= cut <= nbytes)
    return tuple(
        (begin, end, crc32(view[begin:end]))
        for begin, end in zip(bounds, bounds[1:], strict=False)
        if not any(lent_begin <= begin and end <= lent_end for _, lent_begin, lent_end in borrowed)
    )


def _tensor_cuts(view: memoryview, nbytes: int) -> tuple[int, ...]:
    """The header's and each tensor's bounds in a snapshot; none when the bytes are not one."""
    if nbytes < 8:
        return ()
    length = int.from_bytes(view[:8], "little")
    if 8 + length > nbytes:
        return ()
    return _cuts_of_header(bytes(view[: 8 + length]), nbytes)


@functools.lru_cache(maxsize=16)
def _cuts_of_header(header: bytes, nbytes: int) -> tuple[int, ...]:
    """Cached: a job commits the same few layouts every step, and parsing a large header costs."""
    try:
        layout = parse_header(header, nbytes)
    except CheckpointCorruptError:
        return ()
    start = layout.data_start
    return (start, *(start + e.begin for e in layout.entries), *(start + e.end for e in layout.entries))


def _is_intact(committed: Committed, buffer: SharedBuffer, copied: memoryview, begin: int, end: int) -> bool:
    """Whether ``copied[begin:end]`` (slot offsets) holds the bytes ``committed`` wrote there.

    A segment only partly inside the range is completed from the slot itself: a torn remainder makes
    the check fail, never pass (the copy is refused; it is only ever a false alarm). A commit made
    without checksums (``checksum_commits=False``) is checked by the sequence counters alone.
    """
    if not committed.crcs:
        return True
    position = begin
    for segment_begin, segment_end, expected in committed.crcs:
        if segment_end <= begin or segment_begin >= end:
            continue
        if segment_begin > position:
            return False  # bytes the commit did not write (borrowed from a third rank): unverifiable
        lo, hi = max(segment_begin, begin), min(segment_end, end)
        crc = crc32(buffer.view()[segment_begin:lo]) if segment_begin < lo else 0
        crc = crc32(copied[lo:hi], crc)
        if hi < segment_end:
            crc = crc32(buffer.view()[hi:segment_end], crc)
        if crc != expected:
            return False
        position = hi
    return position >= end


def _log_torn(rank: int, step: int) -> None:
    # Expected now and then (a reader slower than a step): the caller moves on, as on a moved counter.
    logger.debug("a copy of rank %d step %d failed its commit's crc32s: overwritten meanwhile", rank, step)
