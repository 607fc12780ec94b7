"""The restore of a job whose world size changed since its newest snapshot (an elastic job that lost
a node and had no spare node, or grew by one; a new job started on an old ``--checkpoint-uri``).

Plan: every rank reports what its node and the node's peers hold, as (old rank, step, world size),
and the newest persisted step; the newest step of which *every* old rank is held somewhere, in node
memory, a peer's replica or storage, wins (``snapshot.restore.plan_reshard``): no step lost when the
lost node's ranks were replicated. Execute: each new rank reads the old ranks it needs (``_reshard``:
the one its unsharded state comes from, and those whose blocks of a sharded tensor overlap its own)
in place where node memory holds them, and has its agent bring in just the bytes it reads of the
others, from a peer or storage, and builds its state from their views.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from resilrun.errors import StateLostError
from resilrun.snapshot.restore import ReshardPlan, plan_reshard
from resilrun.snapshot.selection import Selection
from resilrun.worker import _reshard
from resilrun.worker._dtensor import Sharding
from resilrun.worker.snapshot import Snapshotter

logger = logging.getLogger(__name__)

# All-gathers a list of ints (the same length on every rank) -> every rank's list, by rank.
Gather = Callable[[list[int]], list[list[int]]]


def plan(snapshotter: Snapshotter, gather: Gather) -> ReshardPlan | None:
    """Agree with every rank on the step to resume from and the world size that wrote it.

    Returns None for a fresh start (nothing held anywhere).

    Raises:
        StateLostError: snapshots exist, but no step is held for every rank of its world.
    """
    inventory = snapshotter.inventory()
    persisted = inventory.persisted or [-1, -1]
    mine = [int(persisted[0]), int(persisted[1])] + [int(v) for entry in inventory.entries for v in entry]
    longest = max(row[0] for row in gather([len(mine)]))
    rows = gather(mine + [-1] * (longest - len(mine)))
    held: set[tuple[int, int, int]] = set()
    stored: set[tuple[int, int]] = set()
    for row in rows:
        if row[0] >= 0:
            stored.add((row[0], row[1]))
        for index in range(2, len(row) - 2, 3):
            if row[index] >= 0:
                held.add((row[index], row[index + 1], row[index + 2]))
    chosen = plan_reshard(held, stored)
    if chosen is None and (held or stored):
        steps = sorted({step for _, step, _ in held} | {step for step, _ in stored})
        raise StateLostError(
            f"the job's size changed and no snapshot step is held for every rank of the world that wrote it "
            f"(steps seen: {steps[-5:]})",
            hint="the nodes holding them and their replicas were lost together; use --replicas 2 or a "
            "--checkpoint-uri to survive that; to start over from step 0 on purpose, use a new --rdzv-id",
        )
    return chosen


@dataclass
class Resized:
    """What a new rank restores from: tensors by name (its sharded blocks built, the rest views of
    one old rank's snapshot), that rank's values, the live meshes by saved mesh key, and the views
    to release once loaded."""

    tensors: dict[str, torch.Tensor]
    meta: Any
    meshes: dict[str, Any]
    source: int
    read: list[int] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    releases: list[Callable[[], None]] = field(default_factory=list)

    def release(self) -> None:
        releases, self.releases = self.releases, []
        for release in releases:
            release()


def bring_in(
    snapshotter: Snapshotter, chosen: ReshardPlan, *, rank: int, tracked: dict[str, Any], sharding: Sharding
) -> Resized:
    """Bring in what this rank reads of the old ranks' snapshots and build its tensors from them.

    From an old rank in node memory the views are read in place; from one on a peer or in storage
    the agent brings in only the bytes this rank reads (``_reshard.rows_of``: the dim-0 rows of
    each sharded tensor that overlap its new block, and from the source rank everything else).

    Raises:
        CheckpointError: a snapshot is gone or cannot be resharded (the caller plans again).
    """
    started = time.monotonic()
    step, world = chosen.step, chosen.world_size
    source = rank % world
    opened: dict[int, dict[str, torch.Tensor]] = {}
    result = Resized({}, None, {}, source)
    try:
        meta, _ = snapshotter.peek(source, step, world)
        result.meta = meta
        live = sharding.specs(sharding.live_meshes(tracked.values(), deep=True).values())
        names = [n for n in tracked if n in meta.get("objects", {})]
        targets = _reshard.plan(meta.get("objects"), meta.get("meshes", {}), live, names)
        for old in sorted(_reshard.needed(targets) | {source}):
            select = Selection(_reshard.rows_of(targets, old), rest=old == source)
            opened[old] = _open(snapshotter, result, old, step, world, select)
        result.tensors = {n: t for n, t in opened[source].items() if n not in targets}
        for name, target in targets.items():
            result.tensors[name] = _reshard.assemble(target, opened)
            result.meshes[target.spec.mesh] = target.mesh
        result.read = sorted(opened)
    except BaseException:
        result.release()
        raise
    result.seconds = time.monotonic() - started
    return result


def _open(
    snapshotter: Snapshotter, result: Resized, rank: int, step: int, world: int, select: Selection
) -> dict[str, torch.Tensor]:
    """Views of old ``rank``'s tensors: in place from node memory, or of just the selected bytes."""
    part = snapshotter.open_part(rank, step, world, select)
    if part is None:
        views, _, release = snapshotter.open_rank(rank, step, world)
    else:
        views, moved, release = part
        result.nbytes += moved.nbytes
    result.releases.append(release)
    return views
