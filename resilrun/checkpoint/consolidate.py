"""Whole tensors from a persisted step: each rank's sharded leaves placed where their description says.

Why a pass over every rank: a sharded tensor's step holds 1/N of it per rank file; the whole exists
nowhere. The ranks are read one at a time, each block copied into its place in a preallocated
tensor, so memory is the consolidated state plus one rank's file. Plain (unsharded) tensors come from
one rank, by default rank 0: DDP keeps them equal on every rank.

Invariants: nothing here trusts the files beyond their checksums: every block must be the one its
rank owns by the saved mesh and placements (so no offset can write outside its tensor), every rank
must describe a tensor as rank 0 does, and the blocks of the copies that count (coordinate 0 along
every replicated mesh dimension) must cover each tensor exactly once; otherwise a
CheckpointCorruptError names the tensor. Partial sums and strided shards cannot be consolidated and
say so.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from resilrun.errors import CheckpointCorruptError, CheckpointError
from resilrun.snapshot.layout import DTYPES, Layout
from resilrun.snapshot.sharding import MeshSpec, ShardSpec, local_block, parse_mesh, parse_shard

_SHARDED = "__dtensor__"


@dataclass(frozen=True, slots=True)
class RankFile:
    """One rank's snapshot of the step as read (and verified) from storage."""

    rank: int
    layout: Layout
    data: bytes
    meta: Any  # the manifest's "values": {"format", "objects", "values", "meshes"?, "kinds"?}

    def tensor(self, name: str) -> torch.Tensor:
        """A private copy of the named tensor (the file's bytes can be dropped afterwards)."""
        entry = next((e for e in self.layout.entries if e.name == name), None)
        if entry is None:
            raise CheckpointCorruptError(f"rank {self.rank}'s snapshot names a tensor '{name}' it does not hold")
        dtype = getattr(torch, DTYPES[entry.dtype][0])
        start = self.layout.data_start + entry.begin
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: copied right away
            raw = torch.frombuffer(self.data, dtype=torch.uint8, count=entry.nbytes, offset=start)
        return raw.clone().view(dtype).view(entry.shape)

    def dtype_of(self, name: str) -> str:
        entry = next((e for e in self.layout.entries if e.name == name), None)
        if entry is None:
            raise CheckpointCorruptError(f"rank {self.rank}'s snapshot names a tensor '{name}' it does not hold")
        return entry.dtype


def sharded_leaves(tree: Any) -> Iterator[tuple[str, Any]]:
    """``(tensor name, description)`` of every sharded leaf of a snapshot tree."""
    if isinstance(tree, list):
        for value in tree:
            yield from sharded_leaves(value)
    elif isinstance(tree, dict):
        if _SHARDED in tree:
            name = tree[_SHARDED]
            if not isinstance(name, str):
                raise CheckpointCorruptError("a sharded leaf of the snapshot has no tensor name")
            yield name, tree.get("spec")
            return
        for value in tree.values():
            yield from sharded_leaves(value)


class Assembler:
    """Builds the whole tensors of one step's sharded leaves, one rank file at a time."""

    def __init__(self, first: RankFile, objects: list[str]) -> None:
        """``first``: rank 0's file, whose descriptions the others must match; ``objects``: the
        tracked names to assemble (others are skipped)."""
        self._objects = objects
        self._specs: dict[str, tuple[ShardSpec, str]] = {}  # name -> (rank 0's spec, dtype code)
        self.whole: dict[str, torch.Tensor] = {}
        self._covered: dict[str, int] = {}
        for name, doc in self._leaves(first):
            spec = _parse(doc, name)
            code = first.dtype_of(name)
            for placement in spec.placements:
                if placement.startswith("P:"):
                    raise CheckpointError(f"'{name}' holds partial sums ({placement}), which cannot be consolidated")
                if placement.startswith("SS"):
                    raise CheckpointError(
                        f"'{name}' is a strided shard ({placement}: FSDP over tensor parallel on one dim), "
                        "which this version cannot consolidate"
                    )
            self._specs[name] = (spec, code)
            self.whole[name] = torch.empty(spec.shape, dtype=getattr(torch, DTYPES[code][0]))
            self._covered[name] = 0

    def add(self, file: RankFile) -> None:
        """Copy the blocks of ``file`` into place.

        Raises:
            CheckpointCorruptError: a block that is not its rank's, or a description unlike rank 0's.
        """
        meshes = _meshes(file)
        for name, doc in self._leaves(file):
            if name not in self._specs:
                raise CheckpointCorruptError(f"rank {file.rank} holds a shard of '{name}', which rank 0 does not")
            expected, code = self._specs[name]
            spec = _parse(doc, name)
            if (spec.shape, spec.placements, spec.mesh) != (expected.shape, expected.placements, expected.mesh):
                raise CheckpointCorruptError(f"rank {file.rank} describes '{name}' unlike rank 0 does")
            if file.dtype_of(name) != code:
                raise CheckpointCorruptError(f"rank {file.rank}'s shard of '{name}' has another dtype than rank 0's")
            mesh = meshes.get(spec.mesh)
            if mesh is None:
                raise CheckpointCorruptError(f"rank {file.rank}'s snapshot lacks the mesh of '{name}'")
            if mesh.ranks[_flat_index(mesh.coordinate, mesh.shape)] != file.rank:
                raise CheckpointCorruptError(f"rank {file.rank} claims another rank's place on the mesh of '{name}'")
            local = file.tensor(name)
            block = local_block(spec.shape, mesh.shape, mesh.coordinate, spec.placements)
            if block is None or spec.offset is None or block != (tuple(local.shape), spec.offset):
                raise CheckpointCorruptError(
                    f"rank {file.rank}'s shard of '{name}' ({list(local.shape)} at {spec.offset}) is not the block "
                    f"its place on the mesh owns"
                )
            if any(p == "R" and c != 0 for p, c in zip(spec.placements, mesh.coordinate, strict=True)):
                continue  # a replica of a block another rank provides
            target = self.whole[name]
            for dim, (start, size) in enumerate(zip(block[1], block[0], strict=True)):
                target = target.narrow(dim, start, size)
            target.copy_(local)
            self._covered[name] += local.numel()

    def check_complete(self) -> None:
        """Raises CheckpointCorruptError unless every element of every tensor came from exactly one block."""
        for name, covered in self._covered.items():
            if covered != self.whole[name].numel():
                raise CheckpointCorruptError(
                    f"the shards of '{name}' cover {covered} of its {self.whole[name].numel()} elements"
                )

    def _leaves(self, file: RankFile) -> Iterator[tuple[str, Any]]:
        objects = file.meta.get("objects") if isinstance(file.meta, dict) else None
        if not isinstance(objects, dict):
            raise CheckpointCorruptError(f"rank {file.rank}'s snapshot has no tracked objects")
        for obj in self._objects:
            yield from sharded_leaves(objects.get(obj))


def _flat_index(coordinate: tuple[int, ...], shape: tuple[int, ...]) -> int:
    index = 0
    for coord, size in zip(coordinate, shape, strict=True):
        index = index * size + coord
    return index


def _parse(doc: Any, name: str) -> ShardSpec:
    try:
        return parse_shard(doc)
    except ValueError as exc:
        raise CheckpointCorruptError(f"the description of '{name}' is malformed: {exc}") from None


def _meshes(file: RankFile) -> dict[str, MeshSpec]:
    table = file.meta.get("meshes", {}) if isinstance(file.meta, dict) else {}
    if not isinstance(table, dict):
        raise CheckpointCorruptError(f"rank {file.rank}'s mesh table is malformed")
    meshes = {}
    for key, doc in table.items():
        try:
            mesh = parse_mesh(doc)
        except ValueError as exc:
            raise CheckpointCorruptError(f"rank {file.rank}'s mesh {key} is malformed: {exc}") from None
        if mesh.key() != key:
            raise CheckpointCorruptError(f"rank {file.rank}'s mesh {key} does not match its own description")
        meshes[key] = mesh
    return meshes
