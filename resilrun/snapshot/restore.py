"""Pure restore planning: the newest step every rank can restore, and the fastest tier holding it.

Tiers, fastest first: each rank's own node memory, a peer's replica, persistent storage. A step is
restorable only when every rank has it in some tier; among the tiers that have the chosen step, a
rank uses the fastest. Plan first, then execute (so a plan is a table test, not an integration test).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

# How many steps per rank each tier reports to the plan (every rank sends the same number, newest
# first): node memory holds a step per slot; the peers a rank's replicas (two per holder) and the
# holders' own steps.
MEMORY_STEPS = 3  # the longest ring of node-memory slots a rank has (tiers/slots.py, with replicas)
PEER_STEPS = 3


class Tier(IntEnum):
    """Lower is faster."""

    MEMORY = 1
    PEER = 2
    PERSISTENT = 3


@dataclass(frozen=True, slots=True)
class RestorePlan:
    step: int
    sources: tuple[Tier, ...]  # by rank

    @property
    def slowest(self) -> Tier:
        return max(self.sources)


def plan_restore(available: Sequence[dict[Tier, frozenset[int]]]) -> RestorePlan | None:
    """Choose the newest step every rank holds somewhere; None when there is none.

    Args:
        available: per rank, the steps each tier holds for it.
    """
    if not available:
        return None
    per_rank = [frozenset().union(*tiers.values()) if tiers else frozenset() for tiers in available]
    common = frozenset.intersection(*per_rank)
    if not common:
        return None
    step = max(common)
    sources = tuple(min(tier for tier, steps in tiers.items() if step in steps) for tiers in available)
    return RestorePlan(step, sources)


# -- at another world size -------------------------------------------------------------------------
def world_of(values: object) -> int:
    """The world size a snapshot was written at, from its values (-1: written before it was recorded)."""
    world = values.get("world_size") if isinstance(values, dict) else None
    return world if isinstance(world, int) and not isinstance(world, bool) and world > 0 else -1


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """The step a job at a new world size resumes from, and the world size that wrote it."""

    step: int
    world_size: int
    persistent_only: bool  # some rank of it is held only in persistent storage


def plan_reshard(held: Iterable[tuple[int, int, int]], persisted: Iterable[tuple[int, int]]) -> ReshardPlan | None:
    """The newest step whose every rank is held somewhere: in some node's memory or a peer's replica
    (``held``: (rank, step, world size) triples from every node), or in persistent storage
    (``persisted``: complete (step, world size) pairs). None when there is no such step.

    A step number can have been trained at two world sizes (the job resized after some ranks had
    committed it), so a snapshot is (step, world size), and all of its ranks must be of that world.
    """
    ranks: dict[tuple[int, int], set[int]] = {}
    for rank, step, world in held:
        if world > 0 and 0 <= rank < world:
            ranks.setdefault((step, world), set()).add(rank)
    whole = {key for key, found in ranks.items() if len(found) == key[1]}
    stored = {(step, world) for step, world in persisted if world > 0}
    if not whole | stored:
        return None
    step, world = max(whole | stored, key=lambda key: (key[0], key in whole))
    return ReshardPlan(step, world, (step, world) not in whole)
