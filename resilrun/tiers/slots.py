"""One rank's node-memory slots (a ring: two, or three with peer replicas), and what its worker
committed to each.

Two slots are double buffering: a crash mid-copy never destroys the newest complete step. With
replicas a third keeps one more step, so that the survivors of a node loss still hold the step the
lost node's replicas have when those lag a step behind training (tiers/peer/replicator.py bounds that lag).
When only some snapshots are replicated (``--replicate-every``), the ring is not written in turn:
it keeps the newest replicated step, and the one before it until the worker's next snapshot
(``next_slot``), whatever the other snapshots in between.

A commit names the step, the slot, its sequence counter at commit time (a reader's copy of the
slot may be of that step only if the counter has not moved since) and the crc32s of the bytes it
wrote (the copy is of that step only if it has them), and, for a deduplicated snapshot
(snapshot/dedup.py), the byte ranges it borrows from other local ranks' commits of the same step:
those lend bytes only within one layout and one generation (``same_timeline``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from resilrun.snapshot.dedup import Borrowed
from resilrun.snapshot.shm import SeqCounters, SharedBuffer

SLOTS = 2
REPLICATED_SLOTS = 3
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
    # Ranges the worker left to other local ranks' snapshots of the same step (snapshot/dedup.py), and
    # the crc32 of its header: a range is borrowed only from an owner whose layout is the same.
    borrowed: Borrowed = ()
    layout: int = 0
    # Ranges equal on every rank of the job (DDP state): a peer holding the same step fills them itself.
    shared: tuple[tuple[int, int], ...] = ()
    # The generation the step was trained in (-1: installed from another tier). Bytes are borrowed
    # only within one generation: after a rollback a slot may still hold the abandoned timeline's
    # copy of a step number that is being trained again.
    round: int = -1
    # (begin, end, crc32) of every segment the commit wrote itself (the header, each tensor, and
    # whatever lies between borrowed ranges), hashed by the agent while the bytes cannot change: a
    # reader's copy is of this step only if it has these crc32s (see tiers/_segments.py).
    crcs: tuple[tuple[int, int, int], ...] = ()
    # Where the bytes came from: "worker" (trained here), or the tier a restore brought them from
    # ("peer", "persistent"). The persister does not write back what it would read: a step restored
    # from storage rewritten rank by rank would leave it torn until every rank had rewritten it.
    origin: str = "worker"
    # The step this rank snapshotted before this one (-1: none; None: not said). Tiers that copy
    # every N-th step choose by it, so with unevenly spaced snapshots (--snapshot-every auto) every
    # rank still copies the same steps (agent/state/persister.py's ``persists``).
    previous: int | None = None
    # Whether the peers get this snapshot, as the workers' schedule agreed (--replicate-every auto;
    # the same on every rank); None: the agent's --replicate-every N decides (``replicated``).
    replicate: bool | None = None

    def crosses(self, every: int) -> bool:
        """Whether this is the first snapshot at or past a multiple of ``every`` steps."""
        previous = self.step - 1 if self.previous is None else self.previous
        return (self.step + 1) // every > (previous + 1) // every

    def replicated(self, every: int) -> bool:
        """Whether the replicator copies this snapshot to the peers: as the workers said, else the
        first at or past each multiple of ``every`` (``--replicate-every N``)."""
        return self.crosses(every) if self.replicate is None else self.replicate


class RankMemory:
    """The slots of one global rank."""

    def __init__(self, rank: int, run_id: str, slots: int = SLOTS) -> None:
        self.rank = rank
        self.run_id = run_id
        self.ctl = SharedBuffer.create(_CTL_BYTES, f"resilrun-{run_id}-r{rank}-ctl")
        self.seq = SeqCounters(self.ctl)
        self.slots: list[SharedBuffer | None] = [None] * slots
        # slot -> its commit, oldest commit first (``record``): after a rollback the order of the
        # commits, not their step numbers, says which one the worker wrote last.
        self.committed: dict[int, Committed] = {}

    def newest(self) -> Committed | None:
        return max(self.committed.values(), key=lambda c: c.step, default=None)

    def record(self, committed: Committed) -> None:
        """Note a commit to its slot as the newest one (caller holds the tier's lock)."""
        self.committed.pop(committed.slot, None)
        self.committed[committed.slot] = committed

    def next_slot(self, every: int) -> int:
        """The slot the next commit goes to: never the last one committed, and, with a third slot,
        never the newest snapshot replicated to the peers (``every``: ``--replicate-every``, as
        ``Committed.replicated`` reads it), nor, while that is the last commit, the replicated one
        before it.

        Why: a node loss resumes every rank from a step the lost ranks' replicas hold, and a
        survivor's own replicas may have been on the lost node, so the survivor must still hold
        that step itself. A lost rank's newest complete replica is its newest replicated step, or
        the one before while that push is in flight; and a worker reads the answer to a replicated
        commit (which waits for its push, the commit gate) before its next snapshot, so once any
        rank has trained past its next snapshot every rank's push of that step is done. Steps
        past the last one committed were abandoned by a rollback (a recovery resumed from an
        older step): they keep nothing.
        """
        order = list(self.committed.values())
        if not order:
            return 0
        keep = {order[-1].slot}
        if len(self.slots) > SLOTS:
            replicated = [c for c in order if c.replicated(every) and c.step <= order[-1].step]
            keep.update(c.slot for c in replicated[-1:])
            if len(replicated) > 1 and replicated[-1] is order[-1]:
                keep.add(replicated[-2].slot)
        free = [slot for slot in range(len(self.slots)) if slot not in self.committed]
        free += [c.slot for c in order if c.slot not in keep]  # else the oldest commit
        return free[0]

    def close(self) -> None:
        for buffer in self.slots:
            if buffer is not None:
                buffer.close()
        self.ctl.close()


def at_step(memory: RankMemory, step: int) -> Committed | None:
    """The rank's commit of ``step``; of two (a rollback's abandoned copy and the new one), the newer generation's."""
    return max((c for c in memory.committed.values() if c.step == step), key=lambda c: c.round, default=None)


def lender(memory: RankMemory, borrower: Committed) -> Committed | None:
    """The rank's commit that ``borrower`` may take bytes from: same step, layout and generation."""
    return next((c for c in memory.committed.values() if c.step == borrower.step and same_timeline(c, borrower)), None)


def crcs_at(committed: Committed, bounds: Sequence[int]) -> tuple[int | None, ...]:
    """``committed``'s crc32 of each segment ``bounds[i]..bounds[i + 1]``; None where it wrote none
    of that exact segment (borrowed bytes)."""
    recorded = {(begin, end): crc for begin, end, crc in committed.crcs}
    return tuple(recorded.get((begin, end)) for begin, end in zip(bounds, bounds[1:], strict=False))


def same_timeline(owner: Committed, borrower: Committed) -> bool:
    """Whether ``owner``'s snapshot can lend bytes to ``borrower``'s (same step is checked by the caller)."""
    return owner.layout == borrower.layout and owner.round == borrower.round
