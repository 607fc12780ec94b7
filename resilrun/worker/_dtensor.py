"""DTensors (FSDP2, tensor parallel, HSDP) in snapshots: each rank keeps its local shard, no gather.

Why here and not in the script: a ``fully_shard`` model's state dict and its optimizer's state hold
DTensors, which a snapshot buffer (plain bytes) cannot take as they are ("aten.copy_.default got
mixed torch.Tensor and DTensor"), and a restored plain tensor cannot be loaded into a DTensor
parameter. So a snapshot keeps ``to_local()`` with a description (snapshot/sharding.py), and a
restore wraps the shard back into a DTensor on the live mesh of the same name, with the saved
placements, before the module or optimizer loads it: bitwise, in place, with no collective.

Invariants: a shard is restored only onto a mesh whose device type, shape and ranks equal the saved
one, and only when its shape is the block this rank owns there (a different world size is refused
here: resharding is another path); the mesh table is rebuilt from what was split this commit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from resilrun.errors import CheckpointError
from resilrun.snapshot.sharding import MeshSpec, ShardSpec, contiguous_stride, local_block, parse_shard
from resilrun.snapshot.tree import Joiner
from resilrun.worker import _torch_compat

try:
    from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
except ImportError:  # a torch built without distributed support has no DTensors to snapshot
    DTensor = None  # type: ignore[assignment,misc]  # every isinstance check below then fails


def is_dtensor(value: Any) -> bool:
    return DTensor is not None and isinstance(value, DTensor)


class Sharding:
    """This job's meshes as seen while splitting: the hooks that split and rebuild DTensors."""

    def __init__(self) -> None:
        # id(mesh) -> (mesh, its spec): a mesh lives as long as the model, so this is computed once.
        self._meshes: dict[int, tuple[Any, MeshSpec]] = {}
        self._used: dict[str, dict[str, Any]] = {}

    def split(self, tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """The local shard of a DTensor and where it sits; None for a plain tensor (see tree.Splitter).

        Raises:
            TypeError: a placement a snapshot cannot describe.
        """
        if not is_dtensor(tensor):
            return None
        mesh_spec = self._mesh_spec(tensor.device_mesh)  # type: ignore[attr-defined]  # a DTensor
        placements = tuple(placement_text(p) for p in tensor.placements)  # type: ignore[attr-defined]
        local = tensor.to_local()  # type: ignore[attr-defined]
        shape = tuple(tensor.shape)
        block = local_block(shape, mesh_spec.shape, mesh_spec.coordinate, placements)
        offset = block[1] if block is not None and block[0] == tuple(local.shape) else None
        stride: tuple[int, ...] | None = tuple(tensor.stride())
        if stride == contiguous_stride(shape):
            stride = None
        spec = ShardSpec(mesh_spec.key(), placements, shape, offset, stride)
        self._used[spec.mesh] = mesh_spec.to_json()
        return local, spec.to_json()

    def mesh_table(self) -> dict[str, dict[str, Any]]:
        """The meshes of everything split since the last call, by key (a snapshot's ``meshes``)."""
        used, self._used = self._used, {}
        return used

    def live_meshes(self, tracked: Iterable[Any], *, deep: bool = False) -> dict[str, Any]:
        """The meshes the tracked objects' DTensors live on now, by key: found on the modules'
        parameters and buffers and the optimizers' parameters; with ``deep``, also in the other
        objects' state dicts."""
        live: dict[str, Any] = {}

        def note(values: Iterable[Any]) -> None:
            for value in values:
                if is_dtensor(value):
                    mesh = value.device_mesh
                    live.setdefault(self._mesh_spec(mesh).key(), mesh)

        for obj in tracked:
            if isinstance(obj, torch.nn.Module):
                note(obj.parameters())
                note(obj.buffers())
            elif isinstance(obj, torch.optim.Optimizer):
                note(p for group in obj.param_groups for p in group["params"])
            elif isinstance(obj, torch.Tensor):
                note([obj])
            elif deep:
                note(_leaves(obj.state_dict()))
        return live

    def specs(self, meshes: Iterable[Any]) -> list[tuple[Any, MeshSpec]]:
        """Each mesh with its description (this rank's coordinate on it included)."""
        return [(mesh, self._mesh_spec(mesh)) for mesh in meshes]

    def joiner(self, tracked: Iterable[Any], device: torch.device, *, moved: dict[str, Any] | None = None) -> Joiner:
        """Rebuilds each saved shard as a DTensor on the live mesh of the same key (see tree.Joiner).

        ``moved``: for a restore at another world size, the live mesh standing in for each saved
        mesh key; the shards given are then this rank's new blocks, already assembled.
        """
        objects = list(tracked)
        live = self.live_meshes(objects) if moved is None else dict(moved)
        scanned: list[bool] = [moved is not None]

        def find(key: str) -> Any:
            if key not in live and not scanned[0]:
                scanned[0] = True
                live.update(self.live_meshes(objects, deep=True))
            return live.get(key)

        def join(local: torch.Tensor, doc: Any) -> Any:
            try:
                spec = parse_shard(doc)
            except ValueError as exc:
                raise CheckpointError(f"a sharded tensor of the snapshot is malformed: {exc}") from None
            mesh = find(spec.mesh)
            if mesh is None:
                raise CheckpointError(
                    f"the snapshot holds shards of a device mesh ({spec.mesh}) that no tracked object lives on now",
                    hint="track the same sharded model and optimizer, built on the same mesh, as the run that saved it",
                )
            mesh_spec = self._mesh_spec(mesh)
            block = local_block(spec.shape, mesh_spec.shape, mesh_spec.coordinate, spec.placements)
            saved = (tuple(local.shape), spec.offset if moved is None else block[1] if block else None)
            if block is not None and spec.offset is not None and block != saved:
                raise CheckpointError(
                    f"a saved shard of shape {list(local.shape)} at {list(spec.offset)} is not the block this "
                    f"rank owns ({list(block[0])} at {list(block[1])}) of a tensor of shape {list(spec.shape)}",
                )
            target = device if device.type == mesh.device_type else torch.device(mesh.device_type)
            return DTensor.from_local(
                local.to(target),
                mesh,
                [placement_of(p) for p in spec.placements],
                run_check=False,
                shape=torch.Size(spec.shape),
                stride=spec.stride or contiguous_stride(spec.shape),
            )

        return join

    def _mesh_spec(self, mesh: Any) -> MeshSpec:
        known = self._meshes.get(id(mesh))
        if known is not None and known[0] is mesh:
            return known[1]
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise TypeError("cannot snapshot a DTensor on a device mesh this rank is not part of")
        names = mesh.mesh_dim_names
        spec = MeshSpec(
            device_type=str(mesh.device_type),
            shape=tuple(int(s) for s in mesh.mesh.shape),
            ranks=tuple(int(r) for r in mesh.mesh.flatten().tolist()),
            names=tuple(names) if names is not None else None,
            coordinate=tuple(int(c) for c in coordinate),
        )
        self._meshes[id(mesh)] = (mesh, spec)
        return spec


def placement_text(placement: Placement) -> str:
    """A placement as snapshot/sharding.py writes it.

    Raises:
        TypeError: a placement this version of resilrun cannot describe.
    """
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Shard):
        return f"S{placement.dim}"
    if isinstance(placement, Partial):
        return f"P:{placement.reduce_op}"
    strided = _torch_compat.strided_shard_type()
    if strided is not None and isinstance(placement, strided):
        return f"SS{placement.dim}:{int(placement.split_factor)}"  # type: ignore[attr-defined]  # probed
    raise TypeError(f"cannot snapshot a DTensor placed as {placement!r}")


def placement_of(text: str) -> Placement:
    """The placement a ``placement_text`` string stands for (the text was validated by parse_shard)."""
    if text == "R":
        return Replicate()
    if text.startswith("SS"):
        strided = _torch_compat.strided_shard_type()
        if strided is None:
            raise CheckpointError(f"this torch cannot rebuild the strided shard placement {text}")
        dim, factor = text[2:].split(":")
        return strided(int(dim), split_factor=int(factor))  # type: ignore[no-any-return]  # a Placement
    if text.startswith("S"):
        return Shard(int(text[1:]))
    return Partial(text[2:])


def _leaves(state: Any) -> Iterable[Any]:
    if isinstance(state, dict):
        for value in state.values():
            yield from _leaves(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _leaves(value)
    else:
        yield state
