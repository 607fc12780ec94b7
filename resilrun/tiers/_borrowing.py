"""Which slots a deduplicated snapshot spans, and when it is complete.

A rank's snapshot may borrow byte ranges from other local ranks' snapshots of the same step
(snapshot/dedup.py); it is complete once every owner holds that step with the same layout. These
are decisions over the node's ranks and their committed slots only: ``NodeMemoryTier`` calls them
with its lock held and acts on the answers (announcing, turning borrowing off, reading).
"""

from __future__ import annotations

from collections.abc import Mapping

from resilrun.snapshot.dedup import owners_of
from resilrun.snapshot.shm import SharedBuffer
from resilrun.tiers.slots import Committed, RankMemory, at_step, lender

Ranks = Mapping[int, RankMemory]
Source = tuple[RankMemory, Committed, SharedBuffer]


def affected(ranks: Ranks, rank: int, committed: Committed) -> list[tuple[int, Committed]]:
    """This commit, and the same step of every rank that borrows from ``rank``: the snapshots a
    commit of ``rank`` may have made complete."""
    found = [(rank, committed)]
    for other, memory in ranks.items():
        if other == rank:
            continue
        for candidate in memory.committed.values():
            if candidate.step == committed.step and rank in owners_of(candidate.borrowed):
                found.append((other, candidate))
    return found


def missing(ranks: Ranks, committed: Committed) -> set[int]:
    """Owners that do not hold ``committed``'s step with its layout (empty: the snapshot is complete)."""
    absent = set()
    for owner in owners_of(committed.borrowed):
        memory = ranks.get(owner)
        if memory is None or lender(memory, committed) is None:
            absent.add(owner)
    return absent


def differently_laid_out(
    ranks: Ranks, rank: int, committed: Committed, affected: list[tuple[int, Committed]]
) -> int | None:
    """A local rank that laid out ``committed``'s step differently in the same generation, or None.

    Another generation's copy of the step is an abandoned timeline, not a different layout.
    """
    pairs = [(q, c) for q, c in affected if q != rank]
    for owner in owners_of(committed.borrowed):
        memory = ranks.get(owner)
        match = None if memory is None else at_step(memory, committed.step)
        if match is not None:
            pairs.append((owner, match))
    return next((q for q, c in pairs if c.round == committed.round and c.layout != committed.layout), None)


def out_of_step(ranks: Ranks, committed: Committed, first: bool) -> bool:
    """Whether an owner's newest commit is more than a step away from this one.

    In lockstep (DDP) an owner is at most one step behind, or one ahead when its commit was
    handled before this one's; further apart, it may no longer hold the step when it is read.
    """
    for owner in owners_of(committed.borrowed):
        memory = ranks.get(owner)
        newest = None if memory is None else memory.newest()
        if newest is None:
            if not first:
                return True
        elif not committed.step - 1 <= newest.step <= committed.step + 1:
            return True
    return False


def sources(ranks: Ranks, rank: int, step: int) -> list[Source] | None:
    """Each slot that holds part of ``rank``'s ``step``, its own first; None if one is gone."""
    memory = ranks.get(rank)
    found = None if memory is None else at_step(memory, step)
    if memory is None or found is None or memory.slots[found.slot] is None:
        return None
    held_by = [(memory, found, memory.slots[found.slot])]
    for owner in sorted(owners_of(found.borrowed)):
        owner_memory = ranks.get(owner)
        held = None if owner_memory is None else lender(owner_memory, found)
        if owner_memory is None or held is None:
            return None
        held_by.append((owner_memory, held, owner_memory.slots[held.slot]))
    if any(buffer is None for _, _, buffer in held_by):
        return None
    return held_by  # type: ignore[return-value]  # None excluded just above


def holder(ranks: Ranks, step: int, layout: int, round: int) -> int | None:
    """A local rank holding a complete snapshot of ``step`` of that layout and generation."""
    for rank, memory in sorted(ranks.items()):
        found = at_step(memory, step)
        if found is None or round < 0 or found.round != round or found.layout != layout:
            continue
        if not missing(ranks, found):
            return rank
    return None
