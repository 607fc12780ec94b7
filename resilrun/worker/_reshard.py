"""Resuming at another world size: each new rank builds its own block of every sharded tensor from
the blocks the old ranks saved, and takes everything else from one old rank's snapshot.

Why this works without a gather: a snapshot of a DTensor records its global shape, placements and
mesh (snapshot/sharding.py), so every old rank's block is known from any one rank's description; a
new rank intersects its block on the live mesh (found by device type and dimension names: its ranks
and sizes changed with the world) with the old blocks, and reads only the old ranks whose blocks
overlap it. Replicated mesh dimensions hold copies: the copy at coordinate 0 is read.

Unsharded state (a DDP model, its optimizer state, the RNG, tracked values) comes from old rank
``new_rank % old_world_size``: equal on every rank under DDP; a new rank beyond the old world gets a
copy of another rank's RNG state, which a script that needs distinct streams reseeds. Plain tensors
sharded by hand (not DTensors) cannot be resharded: they come from that one rank too.

Invariants: every element of a new block comes from exactly one old block (checked), and nothing
here does I/O: the caller supplies the old ranks' tensors by name, of which only the rows
``rows_of`` names need to hold data (the caller reads no more than those).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from resilrun.errors import CheckpointError
from resilrun.snapshot.sharding import MeshSpec, ShardSpec, local_block, parse_mesh, parse_shard

_SHARDED = "__dtensor__"


@dataclass(frozen=True, slots=True)
class Piece:
    """One old rank's block of a tensor."""

    rank: int
    shape: tuple[int, ...]
    offset: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Target:
    """This rank's new block of one sharded tensor, and the old blocks that overlap it."""

    name: str
    spec: ShardSpec  # as saved: global shape and placements (the mesh key is the old one)
    mesh: Any  # the live DeviceMesh it goes on
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    pieces: tuple[Piece, ...]


def plan(objects: Any, meshes: Any, live: Iterable[tuple[Any, MeshSpec]], names: Iterable[str]) -> dict[str, Target]:
    """This rank's block of every sharded leaf of the tracked ``names``, with the old pieces it needs.

    Args:
        objects, meshes: the ``objects`` and ``meshes`` of an old rank's snapshot values.
        live: the live meshes (and their specs) of this rank's tracked objects.

    Raises:
        CheckpointError: a description that cannot be resharded (strided or partial placements, no
            live mesh like the saved one), or a malformed one.
    """
    old_meshes = _parse_meshes(meshes)
    candidates = list(live)
    targets: dict[str, Target] = {}
    for obj in names:
        for name, doc in _sharded_leaves(objects.get(obj) if isinstance(objects, dict) else None):
            try:
                spec = parse_shard(doc)
            except ValueError as exc:
                raise CheckpointError(f"the snapshot's description of '{name}' is malformed: {exc}") from None
            if any(p.startswith(("SS", "P:")) for p in spec.placements):
                raise CheckpointError(
                    f"'{name}' is placed {list(spec.placements)}: strided shards and partial sums cannot be resharded",
                    hint="resume at the world size that wrote the snapshot",
                )
            old = old_meshes.get(spec.mesh)
            if old is None:
                raise CheckpointError(f"the snapshot lacks the mesh of '{name}'")
            mesh, now = _match(old, candidates, name)
            block = local_block(spec.shape, now.shape, now.coordinate, spec.placements)
            assert block is not None  # no strided placements here
            targets[name] = Target(name, spec, mesh, block[0], block[1], _pieces(spec, old, block))
    return targets


def needed(targets: Mapping[str, Target]) -> set[int]:
    """The old ranks whose snapshots hold a part of any target."""
    return {piece.rank for target in targets.values() for piece in target.pieces}


def rows_of(targets: Mapping[str, Target], rank: int) -> dict[str, tuple[int, int]]:
    """The rows along dim 0 of old ``rank``'s block of each target that overlap this rank's new
    block (``(0, 0)``: none): all it reads of that rank's sharded tensors. FSDP2 shards dim 0,
    so these are one contiguous run of bytes; other dims are read whole."""
    rows = {}
    for name, target in targets.items():
        rows[name] = (0, 0)
        for piece in target.pieces:
            if piece.rank != rank:
                continue
            if not piece.shape:
                rows[name] = (0, 1)
                continue
            lo = max(piece.offset[0], target.offset[0]) - piece.offset[0]
            hi = min(piece.offset[0] + piece.shape[0], target.offset[0] + target.shape[0]) - piece.offset[0]
            rows[name] = (lo, max(lo, hi))
    return rows


def assemble(target: Target, sources: Mapping[int, Mapping[str, torch.Tensor]]) -> torch.Tensor:
    """This rank's new block of ``target``, copied together from the old ranks' tensors.

    Raises:
        CheckpointError: an old block that is not the shape its description says.
    """
    dtype = None
    out: torch.Tensor | None = None
    covered = 0
    for piece in target.pieces:
        local = sources[piece.rank].get(target.name)
        if local is None or tuple(local.shape) != piece.shape:
            raise CheckpointError(f"old rank {piece.rank}'s block of '{target.name}' is not the one its mesh gives it")
        if out is None:
            dtype = local.dtype
            out = torch.empty(target.shape, dtype=dtype)
        low = [max(a, b) for a, b in zip(piece.offset, target.offset, strict=True)]
        high = [
            min(a + n, b + m) for a, n, b, m in zip(piece.offset, piece.shape, target.offset, target.shape, strict=True)
        ]
        src, dst = local, out
        for dim, (lo, hi) in enumerate(zip(low, high, strict=True)):
            src = src.narrow(dim, lo - piece.offset[dim], hi - lo)
            dst = dst.narrow(dim, lo - target.offset[dim], hi - lo)
        dst.copy_(src)
        covered += dst.numel()
    if out is None:  # an empty block: nothing overlaps it
        out = torch.empty(target.shape, dtype=_dtype_from(sources, target))
    if covered != out.numel():
        raise CheckpointError(f"the old blocks of '{target.name}' cover {covered} of the {out.numel()} elements needed")
    return out


def _dtype_from(sources: Mapping[int, Mapping[str, torch.Tensor]], target: Target) -> torch.dtype:
    for tensors in sources.values():
        if target.name in tensors:
            return tensors[target.name].dtype
    return torch.float32


def _pieces(spec: ShardSpec, old: MeshSpec, block: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[Piece, ...]:
    """The old blocks (one holder each: coordinate 0 along replicated dims) overlapping ``block``."""
    pieces = []
    for flat, rank in enumerate(old.ranks):
        coordinate = _unravel(flat, old.shape)
        if any(p == "R" and c != 0 for p, c in zip(spec.placements, coordinate, strict=True)):
            continue
        found = local_block(spec.shape, old.shape, coordinate, spec.placements)
        assert found is not None
        shape, offset = found
        overlaps = all(
            min(a + n, b + m) > max(a, b) for a, n, b, m in zip(offset, shape, block[1], block[0], strict=True)
        )
        if overlaps:
            pieces.append(Piece(rank, shape, offset))
    return tuple(pieces)


def _match(old: MeshSpec, live: list[tuple[Any, MeshSpec]], name: str) -> tuple[Any, MeshSpec]:
    """The live mesh standing in for ``old``: same device type, dimensions and dimension names."""
    found = [
        (mesh, spec)
        for mesh, spec in live
        if spec.device_type == old.device_type and len(spec.shape) == len(old.shape) and spec.names == old.names
    ]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise CheckpointError(
            f"'{name}' was sharded on a {len(old.shape)}-D {old.device_type} mesh {list(old.names or ())}, and "
            f"{what} tracked object lives on one like it now",
            hint="name the mesh dimensions (init_device_mesh(..., mesh_dim_names=...)), the same at every world size",
        )
    return found[0]


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coordinate = []
    for size in reversed(shape):
        coordinate.append(flat % size)
        flat //= size
    return tuple(reversed(coordinate))


def _parse_meshes(table: Any) -> dict[str, MeshSpec]:
    if not isinstance(table, dict):
        return {}
    meshes = {}
    for key, doc in table.items():
        try:
            meshes[key] = parse_mesh(doc)
        except ValueError as exc:
            raise CheckpointError(f"the snapshot's mesh {key} is malformed: {exc}") from None
    return meshes


def _sharded_leaves(tree: Any) -> Iterable[tuple[str, Any]]:
    if isinstance(tree, list):
        for value in tree:
            yield from _sharded_leaves(value)
    elif isinstance(tree, dict):
        if _SHARDED in tree:
            yield str(tree[_SHARDED]), tree.get("spec")
            return
        for value in tree.values():
            yield from _sharded_leaves(value)
