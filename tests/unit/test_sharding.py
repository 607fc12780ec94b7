"""Sharded tensors in snapshots: the block arithmetic agrees with torch's, descriptions read from a
snapshot are validated, and a DTensor model and optimizer round-trip through flatten/unflatten as
their local shards, bitwise, onto the live mesh.

A one-rank gloo group (a HashStore, no sockets) is enough for a real DeviceMesh, FSDP2 and DTensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from resilrun.errors import CheckpointError
from resilrun.snapshot.sharding import MeshSpec, contiguous_stride, local_block, parse_mesh, parse_shard
from resilrun.snapshot.tree import flatten, unflatten
from resilrun.worker._dtensor import Sharding, placement_of, placement_text

dtensor = pytest.importorskip("torch.distributed.tensor")


# -- the block arithmetic --------------------------------------------------------------------------
def _torch_block(shape: tuple[int, ...], mesh: tuple[int, ...], coord: tuple[int, ...], placements: tuple[str, ...]):
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return _compute_local_shape_and_global_offset(shape, mesh, list(coord), [placement_of(p) for p in placements])


@pytest.mark.parametrize(
    ("shape", "mesh", "placements"),
    [
        ((7, 5), (2,), ("S0",)),
        ((1, 7), (2,), ("S0",)),  # an empty shard on rank 1
        ((10,), (4,), ("S0",)),  # chunks of 3: 3, 3, 3, 1
        ((5,), (4,), ("S0",)),  # chunks of 2: 2, 2, 1, 0
        ((6, 9), (2, 2), ("R", "S0")),  # HSDP
        ((6, 9), (2, 3), ("S0", "S1")),  # 2-D sharding on two dims
        ((13, 3), (2, 3), ("S0", "S0")),  # the same dim split twice
        ((8, 4), (2, 2), ("S1", "R")),
        ((4,), (3,), ("R",)),
    ],
)
def test_local_block_is_the_block_torch_assigns_at_every_coordinate(shape, mesh, placements) -> None:
    for coord in itertools.product(*(range(n) for n in mesh)):
        mine = local_block(shape, mesh, coord, placements)
        assert mine is not None
        theirs = _torch_block(shape, mesh, coord, placements)
        assert mine[0] == tuple(theirs[0]), coord
        if all(mine[0]):  # an empty block has no meaningful offset
            assert mine[1] == tuple(theirs[1]), coord


def test_a_strided_shard_is_not_one_block() -> None:
    assert local_block((8,), (2, 2), (0, 1), ("SS0:2", "S0")) is None


def test_contiguous_stride() -> None:
    assert contiguous_stride((7, 5, 3)) == (15, 3, 1)
    assert contiguous_stride((0, 4)) == (4, 1)


# -- descriptions from a snapshot are untrusted ----------------------------------------------------
def test_a_mesh_round_trips_and_consecutive_ranks_take_two_numbers() -> None:
    spec = MeshSpec("cpu", (2, 2), (4, 5, 6, 7), ("replicate", "shard"), (1, 0))
    doc = spec.to_json()
    assert "ranks" not in doc and doc["first_rank"] == 4
    assert parse_mesh(doc) == spec
    scattered = MeshSpec("cuda", (2,), (0, 8), None, (1,))
    assert parse_mesh(scattered.to_json()) == scattered
    assert spec.key() == MeshSpec("cpu", (2, 2), (4, 5, 6, 7), ("replicate", "shard"), (0, 0)).key()


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"device_type": "cpu", "shape": [2], "first_rank": 0, "coordinate": [2]},  # outside the mesh
        {"device_type": "cpu", "shape": [2], "ranks": [0], "coordinate": [0]},  # too few ranks
        {"device_type": "cpu", "shape": [0], "first_rank": 0, "coordinate": [0]},
        {"device_type": "cpu", "shape": [2], "first_rank": True, "coordinate": [0]},
        {"device_type": "", "shape": [2], "first_rank": 0, "coordinate": [0]},
        {"device_type": "cpu", "shape": [2], "first_rank": 0, "coordinate": [0], "names": ["a", "b"]},
    ],
)
def test_a_malformed_mesh_is_refused(doc) -> None:
    with pytest.raises(ValueError):
        parse_mesh(doc)


@pytest.mark.parametrize(
    "doc",
    [
        None,
        {"placements": ["S0"], "shape": [2]},  # no mesh
        {"mesh": "m", "placements": [], "shape": [2]},
        {"mesh": "m", "placements": ["S1"], "shape": [2]},  # no dim 1
        {"mesh": "m", "placements": ["X"], "shape": [2]},
        {"mesh": "m", "placements": [0], "shape": [2]},
        {"mesh": "m", "placements": ["S0"], "shape": [-1]},
        {"mesh": "m", "placements": ["S0"], "shape": [2], "offset": [0, 0]},
        {"mesh": "m", "placements": ["S0"], "shape": [2.0]},
    ],
)
def test_a_malformed_shard_description_is_refused(doc) -> None:
    with pytest.raises(ValueError):
        parse_shard(doc)


def test_placements_round_trip_through_their_text() -> None:
    for text in ("R", "S0", "S3", "P:sum", "P:avg", "SS0:2"):
        assert placement_text(placement_of(text)) == text
        parse_shard({"mesh": "m", "placements": [text], "shape": [1, 1, 1, 1]})


# -- a real DTensor model and optimizer ------------------------------------------------------------
@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fsdp_model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 1))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


def _snapshot(sharding: Sharding, objects: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, trees = {}, {}
    for name, obj in objects.items():
        found, trees[name] = flatten(obj.state_dict(), name, sharding.split)
        tensors.update({key: value.clone() for key, value in found.items()})  # as node memory would hold them
    return tensors, trees


def test_an_fsdp2_model_and_optimizer_round_trip_as_local_shards_bitwise(group) -> None:
    # Given an FSDP2 model and AdamW trained 3 steps, snapshotted as plain local tensors
    model, opt = _fsdp_model_and_optimizer(seed=0)
    _train(model, opt, 3)
    sharding = Sharding()
    tensors, trees = _snapshot(sharding, {"model": model, "optimizer": opt})
    assert all(type(t) is torch.Tensor for t in tensors.values())
    meshes = sharding.mesh_table()
    assert len(meshes) == 1 and next(iter(meshes.values()))["names"] == ["shard"]
    expected = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    # When a fresh model and optimizer (another init, no optimizer state yet) load the snapshot
    fresh, fresh_opt = _fsdp_model_and_optimizer(seed=1)
    join = Sharding().joiner([fresh, fresh_opt], torch.device("cpu"))
    fresh.load_state_dict(unflatten(trees["model"], tensors, join))
    fresh_opt.load_state_dict(unflatten(trees["optimizer"], tensors, join))
    # Then parameters and optimizer state are DTensors equal to the saved ones, and training goes on alike
    for name, param in fresh.named_parameters():
        assert isinstance(param, dtensor.DTensor) and torch.equal(param.full_tensor(), expected[name])
    _train(model, opt, 2)
    _train(fresh, fresh_opt, 2)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name


def test_a_shard_of_a_mesh_no_tracked_object_has_is_refused_with_a_reason(group) -> None:
    model, opt = _fsdp_model_and_optimizer(seed=0)
    tensors, trees = _snapshot(Sharding(), {"model": model})
    plain = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 1))
    join = Sharding().joiner([plain], torch.device("cpu"))
    with pytest.raises(CheckpointError, match="no tracked object lives on now"):
        unflatten(trees["model"], tensors, join)


def test_a_shard_of_another_size_is_refused(group) -> None:
    model, _ = _fsdp_model_and_optimizer(seed=0)
    tensors, trees = _snapshot(Sharding(), {"model": model})
    name = next(n for n in tensors if n.endswith("0.weight"))
    tensors[name] = tensors[name][:3]  # a shard from a run at another world size
    join = Sharding().joiner([model], torch.device("cpu"))
    with pytest.raises(CheckpointError, match="is not the block this rank owns"):
        unflatten(trees["model"], tensors, join)


def test_a_sharded_leaf_without_a_joiner_is_refused(group) -> None:
    model, _ = _fsdp_model_and_optimizer(seed=0)
    tensors, trees = _snapshot(Sharding(), {"model": model})
    with pytest.raises(ValueError, match="shard of a sharded tensor"):
        unflatten(trees["model"], tensors)
