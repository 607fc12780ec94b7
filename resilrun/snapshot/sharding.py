"""How a sharded tensor (a DTensor: FSDP2, tensor parallel, HSDP) is described in a snapshot.

Why a description of our own, in JSON: a snapshot keeps each rank's *local* shard as an ordinary
tensor (no gather, 1/N of the state per rank), and restoring it in place, exporting a full tensor or
resharding to another world size all need to know where that shard sits in the whole. torch's own
objects (``DeviceMesh``, ``Placement``) cannot be stored without pickle, so this module writes the
facts: the global shape, the placements as short strings, the mesh as its device type, shape and
ranks, this rank's coordinate on it and the offset of the local block.

Invariants: everything here is pure (no torch.distributed, no I/O); ``parse_*`` accept only
well-formed documents (a snapshot read from storage is untrusted) and raise ``ValueError`` naming
what is wrong; the block arithmetic is torch's (``torch.chunk`` semantics per mesh dimension, in
mesh-dimension order), checked against torch's own helper in the tests.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from typing import Any

# Placements as written: "R" replicate, "S<d>" shard on tensor dim d, "P:<op>" partial (a pending
# reduction), "SS<d>:<k>" a strided shard (FSDP over tensor parallel on the same dim; k its split factor).
_PLACEMENT = re.compile(r"^(?:R|S(\d{1,3})|P:([a-z_]{1,16})|SS(\d{1,3}):(\d{1,9}))$")
_MAX_DIMS = 64


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """A device mesh as every rank on it sees it (the coordinate is this rank's own)."""

    device_type: str
    shape: tuple[int, ...]
    ranks: tuple[int, ...]  # the mesh's global ranks, row-major
    names: tuple[str, ...] | None
    coordinate: tuple[int, ...]

    def key(self) -> str:
        """Equal on every rank of the mesh and across runs of a job; the coordinate is left out."""
        text = json.dumps([self.device_type, self.shape, self.ranks, self.names], separators=(",", ":"))
        return f"{zlib.crc32(text.encode()):08x}"

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"device_type": self.device_type, "shape": list(self.shape)}
        first, count = self.ranks[0], len(self.ranks)
        # A job's meshes are nearly always consecutive ranks: two numbers instead of thousands per step.
        if self.ranks == tuple(range(first, first + count)):
            doc["first_rank"] = first
        else:
            doc["ranks"] = list(self.ranks)
        if self.names is not None:
            doc["names"] = list(self.names)
        doc["coordinate"] = list(self.coordinate)
        return doc


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Where one rank's local block of a sharded tensor sits in the whole."""

    mesh: str  # a MeshSpec.key() of the snapshot's mesh table
    placements: tuple[str, ...]
    shape: tuple[int, ...]  # the global shape
    offset: tuple[int, ...] | None  # of the local block; None where no single block describes it
    stride: tuple[int, ...] | None = None  # the global stride, only when not the contiguous one

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"mesh": self.mesh, "placements": list(self.placements), "shape": list(self.shape)}
        if self.offset is not None:
            doc["offset"] = list(self.offset)
        if self.stride is not None:
            doc["stride"] = list(self.stride)
        return doc


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for dim in reversed(shape):
        stride.append(running)
        running *= max(dim, 1)
    return tuple(reversed(stride))


def local_block(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[str, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The local shape and global offset of the block at ``coordinate`` (None: not one block).

    Each mesh dimension in order splits the current block of its tensor dim as ``torch.chunk`` does
    (chunks of ceil(n / k), the last ones short or empty). Strided shards interleave blocks, which
    no single offset describes.
    """
    local, offset = list(shape), [0] * len(shape)
    for size, index, placement in zip(mesh_shape, coordinate, placements, strict=True):
        if placement.startswith("SS"):
            return None
        if placement.startswith("S"):
            dim = int(placement[1:])
            chunk = -(-local[dim] // size)
            start = min(chunk * index, local[dim])
            local[dim] = min(local[dim], start + chunk) - start
            offset[dim] += start
    return tuple(local), tuple(offset)


# -- reading (untrusted) ---------------------------------------------------------------------------
def parse_mesh(doc: Any) -> MeshSpec:
    """A mesh table entry from a snapshot.

    Raises:
        ValueError: malformed.
    """
    if not isinstance(doc, dict):
        raise ValueError("a mesh entry is not an object")
    device_type, coordinate = doc.get("device_type"), doc.get("coordinate")
    shape = _ints(doc.get("shape"), "mesh shape")
    if not isinstance(device_type, str) or not 0 < len(device_type) <= 32 or not shape:
        raise ValueError("a mesh entry has no device type or shape")
    count = 1
    for size in shape:
        if size < 1:
            raise ValueError(f"mesh shape {list(shape)} has an empty dimension")
        count *= size
    if "first_rank" in doc:
        first = doc["first_rank"]
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ValueError("a mesh's first rank is not a non-negative int")
        ranks = tuple(range(first, first + count))
    else:
        ranks = _ints(doc.get("ranks"), "mesh ranks")
    if len(ranks) != count:
        raise ValueError(f"mesh of shape {list(shape)} lists {len(ranks)} ranks")
    names = doc.get("names")
    if names is not None and (
        not isinstance(names, list) or len(names) != len(shape) or not all(isinstance(n, str) for n in names)
    ):
        raise ValueError("a mesh's dimension names do not match its shape")
    coord = _ints(coordinate, "mesh coordinate")
    if len(coord) != len(shape) or any(not 0 <= c < s for c, s in zip(coord, shape, strict=True)):
        raise ValueError(f"mesh coordinate {list(coord)} is outside the mesh {list(shape)}")
    return MeshSpec(device_type, shape, ranks, tuple(names) if names is not None else None, coord)


def parse_shard(doc: Any) -> ShardSpec:
    """A sharded tensor's description from a snapshot.

    Raises:
        ValueError: malformed.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("mesh"), str):
        raise ValueError("a sharded tensor names no mesh")
    placements = doc.get("placements")
    if not isinstance(placements, list) or not placements or len(placements) > _MAX_DIMS:
        raise ValueError("a sharded tensor has no placements")
    shape = _ints(doc.get("shape"), "shape")
    for placement in placements:
        match = _PLACEMENT.match(placement) if isinstance(placement, str) else None
        if match is None:
            raise ValueError(f"unknown placement {placement!r}")
        dim = match.group(1) or match.group(3)
        if dim is not None and int(dim) >= len(shape):
            raise ValueError(f"placement {placement} shards a dim the shape {list(shape)} does not have")
    offset = _ints(doc["offset"], "offset") if "offset" in doc else None
    stride = _ints(doc["stride"], "stride") if "stride" in doc else None
    for name, value in (("offset", offset), ("stride", stride)):
        if value is not None and len(value) != len(shape):
            raise ValueError(f"{name} {list(value)} does not match the shape {list(shape)}")
    return ShardSpec(doc["mesh"], tuple(placements), shape, offset, stride)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or len(value) > 1 << 20
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        raise ValueError(f"{what} is not a list of non-negative ints")
    if what in ("shape", "offset", "stride", "mesh shape", "mesh coordinate") and len(value) > _MAX_DIMS:
        raise ValueError(f"{what} has more than {_MAX_DIMS} dims")
    return tuple(value)
