"""Restores at another world size, on pure data: which step is chosen (``plan_reshard``), which old
ranks a new rank reads, and that the new blocks assembled from the old ones are the whole tensor's
slices, for FSDP and HSDP meshes growing and shrinking."""

from __future__ import annotations

import itertools

import pytest
import torch

from resilrun.errors import CheckpointError
from resilrun.snapshot.restore import ReshardPlan, plan_reshard, world_of
from resilrun.snapshot.sharding import MeshSpec, ShardSpec, local_block
from resilrun.worker import _reshard


# -- choosing the step -----------------------------------------------------------------------------
def test_the_newest_step_held_for_every_rank_of_its_world_wins() -> None:
    held = [(0, 20, 3), (1, 20, 3), (2, 20, 3), (0, 21, 3), (1, 21, 3)]  # rank 2's step 21 was lost
    assert plan_reshard(held, []) == ReshardPlan(20, 3, False)


def test_a_step_number_trained_at_two_world_sizes_counts_per_world() -> None:
    # ranks 0-1 of the new world (2) committed step 21; the old world (3) had only two of its ranks' 21
    held = [(0, 21, 3), (1, 21, 3), (0, 21, 2), (1, 21, 2), (0, 20, 3), (1, 20, 3), (2, 20, 3)]
    assert plan_reshard(held, []) == ReshardPlan(21, 2, False)


def test_persistent_storage_covers_what_no_node_holds() -> None:
    assert plan_reshard([(0, 30, 2)], [(25, 2)]) == ReshardPlan(25, 2, True)
    assert plan_reshard([(0, 25, 2), (1, 25, 2)], [(25, 2)]) == ReshardPlan(25, 2, False)  # nodes first
    assert plan_reshard([], []) is None
    assert plan_reshard([(0, 5, -1)], []) is None  # a snapshot from before world sizes were recorded


def test_world_of_reads_only_a_positive_int() -> None:
    assert world_of({"world_size": 4}) == 4
    assert world_of({"world_size": True}) == -1
    assert world_of({"world_size": 0}) == -1
    assert world_of(None) == -1


# -- the blocks ------------------------------------------------------------------------------------
class _Mesh:
    """Stands in for a live DeviceMesh: only identity matters here."""


def _old_snapshots(whole: torch.Tensor, old: MeshSpec, placements: tuple[str, ...]):
    """Per old rank: its tensors by name and the objects/meshes it would have saved."""
    tensors, objects = {}, None
    for flat, rank in enumerate(old.ranks):
        coordinate = _reshard._unravel(flat, old.shape)
        shape, offset = local_block(tuple(whole.shape), old.shape, coordinate, placements)  # type: ignore[misc]
        local = whole
        for dim, (start, size) in enumerate(zip(offset, shape, strict=True)):
            local = local.narrow(dim, start, size)
        tensors[rank] = {"model/w": local.clone()}
        spec = ShardSpec(old.key(), placements, tuple(whole.shape), offset).to_json()
        objects = {"model": {"__dict__": [["w", {"__dtensor__": "model/w", "spec": spec}]]}}
    return tensors, objects, {old.key(): old.to_json()}


@pytest.mark.parametrize(
    ("old_shape", "new_shape", "placements", "names"),
    [
        ((3,), (2,), ("S0",), ("shard",)),  # FSDP 3 -> 2
        ((2,), (3,), ("S0",), ("shard",)),  # FSDP 2 -> 3
        ((4,), (3,), ("S1",), ("shard",)),
        ((2, 2), (2, 3), ("R", "S0"), ("replicate", "shard")),  # HSDP grows
        ((2, 3), (1, 2), ("R", "S0"), ("replicate", "shard")),  # HSDP shrinks
        ((2, 2), (3, 1), ("S0", "S1"), ("dp", "tp")),
    ],
)
def test_new_blocks_assembled_from_old_ones_are_the_whole_tensors_slices(
    old_shape: tuple[int, ...], new_shape: tuple[int, ...], placements: tuple[str, ...], names: tuple[str, ...]
) -> None:
    whole = torch.arange(11 * 7, dtype=torch.float32).reshape(11, 7)
    count = 1
    for size in old_shape:
        count *= size
    old = MeshSpec("cpu", old_shape, tuple(range(count)), names, (0,) * len(old_shape))
    sources, objects, meshes = _old_snapshots(whole, old, placements)
    mesh = _Mesh()
    new_count = 1
    for size in new_shape:
        new_count *= size
    for coordinate in itertools.product(*(range(n) for n in new_shape)):
        live = MeshSpec("cpu", new_shape, tuple(range(new_count)), names, coordinate)
        targets = _reshard.plan(objects, meshes, [(mesh, live)], ["model"])
        target = targets["model/w"]
        assert target.mesh is mesh
        # Only the rows rows_of names are read of each old block: poison the others
        read = {}
        for rank in _reshard.needed(targets):
            lo, hi = _reshard.rows_of(targets, rank)["model/w"]
            block = torch.full_like(sources[rank]["model/w"], float("nan"))
            block[lo:hi] = sources[rank]["model/w"][lo:hi]
            read[rank] = {"model/w": block}
        built = _reshard.assemble(target, read)
        expected = whole
        for dim, (start, size) in enumerate(zip(target.offset, target.shape, strict=True)):
            expected = expected.narrow(dim, start, size)
        assert torch.equal(built, expected), coordinate


def test_only_the_overlapping_old_ranks_are_read() -> None:
    whole = torch.arange(12.0).reshape(12, 1)
    old = MeshSpec("cpu", (4,), (0, 1, 2, 3), ("shard",), (0,))
    _, objects, meshes = _old_snapshots(whole, old, ("S0",))
    first = MeshSpec("cpu", (2,), (0, 1), ("shard",), (0,))
    second = MeshSpec("cpu", (2,), (0, 1), ("shard",), (1,))
    assert _reshard.needed(_reshard.plan(objects, meshes, [(_Mesh(), first)], ["model"])) == {0, 1}
    assert _reshard.needed(_reshard.plan(objects, meshes, [(_Mesh(), second)], ["model"])) == {2, 3}


def test_replicas_are_read_once_from_coordinate_zero() -> None:
    whole = torch.arange(8.0)
    old = MeshSpec("cpu", (2, 2), (0, 1, 2, 3), ("replicate", "shard"), (0, 0))
    _, objects, meshes = _old_snapshots(whole, old, ("R", "S0"))
    live = MeshSpec("cpu", (1,), (0,), ("shard",), (0,))
    with pytest.raises(CheckpointError, match="2-D cpu mesh"):  # a 1-D mesh does not stand in for it
        _reshard.plan(objects, meshes, [(_Mesh(), live)], ["model"])
    live = MeshSpec("cpu", (1, 1), (0,), ("replicate", "shard"), (0, 0))
    assert _reshard.needed(_reshard.plan(objects, meshes, [(_Mesh(), live)], ["model"])) == {0, 1}


def test_strided_shards_and_partial_sums_are_not_resharded() -> None:
    old = MeshSpec("cpu", (2,), (0, 1), ("shard",), (0,))
    for placement in ("SS0:2", "P:sum"):
        spec = {"mesh": old.key(), "placements": [placement], "shape": [4]}
        objects = {"model": {"__dict__": [["w", {"__dtensor__": "model/w", "spec": spec}]]}}
        with pytest.raises(CheckpointError, match="cannot be resharded"):
            _reshard.plan(objects, {old.key(): old.to_json()}, [(_Mesh(), old)], ["model"])


def test_an_old_block_of_the_wrong_shape_is_refused() -> None:
    whole = torch.arange(6.0)
    old = MeshSpec("cpu", (2,), (0, 1), ("shard",), (0,))
    sources, objects, meshes = _old_snapshots(whole, old, ("S0",))
    sources[1]["model/w"] = sources[1]["model/w"][:2]
    live = MeshSpec("cpu", (1,), (0,), ("shard",), (0,))
    targets = _reshard.plan(objects, meshes, [(_Mesh(), live)], ["model"])
    with pytest.raises(CheckpointError, match="not the one its mesh gives it"):
        _reshard.assemble(targets["model/w"], sources)
