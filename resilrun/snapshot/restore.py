"""Pure restore planning: the newest step every rank can restore, and the fastest tier holding it.

Tiers, fastest first: each rank's own node memory, a peer's replica, persistent storage. A step is
restorable only when every rank has it in some tier; among the tiers that have the chosen step, a
rank uses the fastest. Plan first, then execute (so a plan is a table test, not an integration test).
"""

from __future__ import annotations

from collections.abc import Sequence
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
