"""Pure rules of the durable checkpoint format: key names, manifest and COMPLETE.json validation.

Nothing here does I/O, so every rule is unit-tested on bytes. Invariants: every number read from a
document is checked to be an int of the right range (``True`` is not an int here), every name is
checked before it is used, and every failure is a CheckpointCorruptError that names the object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from resilrun.errors import CheckpointCorruptError
from resilrun.snapshot.crc import crc32
from resilrun.snapshot.layout import DTYPES, FORMAT, MAX_HEADER_BYTES, Layout

COMPLETE_NAME = "COMPLETE.json"
# A manifest holds one entry per tensor (as the header does) plus the tracked values: twice the
# largest header we accept is generous, and refusing more keeps a forged manifest from being loaded.
MAX_MANIFEST_BYTES = 2 * MAX_HEADER_BYTES + 64 * 1024 * 1024
# COMPLETE.json holds ~60 bytes per rank: 64 MiB is a million ranks.
MAX_COMPLETE_BYTES = 64 * 1024 * 1024
MAX_WORLD_SIZE = 1 << 20
# A ranged read (a rank resuming at another world size reads only the rows it needs) is checked
# chunk by chunk: the manifest records a crc32 (and, with a job secret, a GMAC) per chunk. Chunks
# follow the tensors (the header is chunk 0; each tensor is cut into chunks from its own first
# byte), so a range never reads a neighbour's bytes, and a tensor has at most CHUNKS_PER_TENSOR
# chunks of at least CHUNK_BYTES (a power of two): a range reads at most two chunks it does not
# need, 128 KiB or 1/32 of the tensor, while a 100 GB file of 1,000 tensors keeps its lists to
# ~3 MB of manifest (a GMAC per 64 KiB costs ~0.2 s/GiB, per 1 MiB ~0.06, against 0.05 for one).
CHUNK_BYTES = 64 * 1024
CHUNKS_PER_TENSOR = 64
_MIN_CHUNK_BYTES, _MAX_CHUNK_BYTES = 1 << 12, 1 << 30

_KEY = re.compile(r"^step_(\d{12,})/(?:rank_(\d{5,})\.(safetensors|json)|(COMPLETE\.json))$")
_UNSAFE_NAME_CHARS = re.compile(r"[\\\x00-\x1f\x7f]")


# -- names -----------------------------------------------------------------------------------------
def step_prefix(step: int) -> str:
    return f"step_{step:012d}/"


def data_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def data_key(step: int, rank: int) -> str:
    return step_prefix(step) + data_file_name(rank)


def manifest_key(step: int, rank: int) -> str:
    return f"{step_prefix(step)}rank_{rank:05d}.json"


def complete_key(step: int) -> str:
    return step_prefix(step) + COMPLETE_NAME


def parse_key(key: str) -> tuple[int, str, int | None] | None:
    """``(step, kind, rank)`` of a checkpoint key, kind in data/manifest/complete; else None.

    Only canonical spellings count (``step_0000000000001`` with 13 digits is not step 1), so two
    keys can never claim the same object.
    """
    match = _KEY.match(key)
    if match is None:
        return None
    step = int(match.group(1))
    if match.group(4):
        return (step, "complete", None) if key == complete_key(step) else None
    rank = int(match.group(2))
    if match.group(3) == "safetensors":
        return (step, "data", rank) if key == data_key(step, rank) else None
    return (step, "manifest", rank) if key == manifest_key(step, rank) else None


def is_safe_tensor_name(name: str) -> bool:
    """Whether a tensor name is a relative path that cannot climb out of a directory.

    Names are '/'-joined paths (``resilrun.snapshot.tree`` joins tracked names and state-dict keys with
    '/'), so '/' itself is allowed; an absolute name, a '.' or '..' segment, a backslash or a
    control character is not, so no tool that maps names to files can be steered elsewhere.
    """
    if not name or len(name) > 4096 or name.startswith("/") or _UNSAFE_NAME_CHARS.search(name):
        return False
    return not any(part in (".", "..") for part in name.split("/"))


def check_ids(step: int, rank: int, world_size: int) -> None:
    """Raise ValueError (a programmer error) unless ``0 <= step``, ``0 <= rank < world_size``."""
    if not (_is_int(step) and _is_int(rank) and _is_int(world_size)):
        raise ValueError("step, rank and world_size must be ints")
    if step < 0 or not 0 < world_size <= MAX_WORLD_SIZE or not 0 <= rank < world_size:
        raise ValueError(f"invalid step {step}, rank {rank} or world size {world_size}")


# -- documents -------------------------------------------------------------------------------------
def encode(document: dict[str, Any]) -> bytes:
    """Canonical JSON bytes (sorted keys) so the crc32 in COMPLETE.json is stable.

    Raises:
        TypeError: something in ``document`` (the tracked values) is not JSON-serialisable.
    """
    try:
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"checkpoint values must be JSON-serialisable: {exc}") from None


def decode(raw: bytes, where: str) -> dict[str, Any]:
    """Parse a JSON object; malformed, deeply nested or oversized-number input is corrupt."""
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{where} is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(document, dict):
        raise CheckpointCorruptError(f"{where} is not a JSON object")
    return document


def parse_complete(raw: bytes, step: int, where: str) -> dict[str, Any]:
    """Validate COMPLETE.json: format, step, world size and one entry per rank."""
    doc = decode(raw, where)
    _expect(doc.get("format") == FORMAT, where, f"has format {doc.get('format')!r}, not {FORMAT!r}")
    _expect(doc.get("step") == step and _is_int(doc.get("step")), where, f"is not for step {step}")
    world_size: Any = doc.get("world_size")
    ranks: Any = doc.get("ranks")
    _expect(_is_int(world_size) and 0 < world_size <= MAX_WORLD_SIZE, where, f"has world size {world_size!r}")
    _expect(isinstance(ranks, dict) and len(ranks) == world_size, where, "does not list every rank")
    for rank in range(world_size):
        entry = ranks.get(str(rank))
        _expect(
            isinstance(entry, dict) and _is_uint(entry.get("file_bytes")) and _is_crc(entry.get("manifest_crc32")),
            where,
            f"has no valid entry for rank {rank}",
        )
    return doc


def parse_manifest(raw: bytes, step: int, rank: int, world_size: int | None, where: str) -> dict[str, Any]:
    """Validate a rank manifest: identity, file name, sizes, header crc and every tensor entry.

    ``world_size`` None (a partial step) skips that one comparison.
    """
    doc = decode(raw, where)
    _expect(doc.get("format") == FORMAT, where, f"has format {doc.get('format')!r}, not {FORMAT!r}")
    _expect(doc.get("step") == step and _is_int(doc.get("step")), where, f"is not for step {step}")
    _expect(doc.get("rank") == rank and _is_int(doc.get("rank")), where, f"is not for rank {rank}")
    size: Any = doc.get("world_size")
    _expect(_is_int(size) and 0 <= rank < size <= MAX_WORLD_SIZE, where, f"has world size {size!r}")
    _expect(world_size is None or size == world_size, where, f"has world size {size}, not {world_size}")
    name = doc.get("file")
    _expect(name == data_file_name(rank), where, f"names file {str(name)[:200]!r}, not {data_file_name(rank)!r}")
    _expect(_is_uint(doc.get("file_bytes")), where, "has no valid file_bytes")
    _expect(_is_crc(doc.get("header_crc32")), where, "has no valid header_crc32")
    _expect("values" in doc, where, "has no values")
    tensors: Any = doc.get("tensors")
    _expect(isinstance(tensors, dict), where, "has no tensors object")
    for tensor, info in tensors.items():
        _expect(is_safe_tensor_name(tensor), where, f"has an unsafe tensor name {tensor[:200]!r}")
        _expect(isinstance(info, dict), where, f"has an invalid entry for tensor '{tensor}'")
        offsets, shape = info.get("data_offsets"), info.get("shape")
        _expect(
            isinstance(info.get("dtype"), str)
            and info["dtype"] in DTYPES
            and isinstance(shape, list)
            and all(_is_uint(d) for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_uint(o) for o in offsets)
            and offsets[0] <= offsets[1]
            and _is_crc(info.get("crc32")),
            where,
            f"has an invalid entry for tensor '{tensor}'",
        )
    if "chunks" in doc:
        _check_chunks(doc, where)
    return doc


def check_layout(layout: Layout, manifest: dict[str, Any], where: str) -> None:
    """The parsed header must be the one the manifest recorded: same bytes, same tensors."""
    if crc32(layout.header) != manifest["header_crc32"]:
        raise CheckpointCorruptError(f"{where}: the header does not match the checksum in its manifest")
    tensors = manifest["tensors"]
    names = {entry.name for entry in layout.entries}
    for name in sorted(names.symmetric_difference(tensors))[:1]:
        side = "manifest" if name in tensors else "file"
        raise CheckpointCorruptError(f"{where}: tensor '{name}' is only in the {side}")
    for entry in layout.entries:
        info = tensors[entry.name]
        if (info["dtype"], tuple(info["shape"]), tuple(info["data_offsets"])) != (
            entry.dtype,
            entry.shape,
            (entry.begin, entry.end),
        ):
            raise CheckpointCorruptError(f"{where}: tensor '{entry.name}' differs from its manifest entry")
    if layout.total_bytes != manifest["file_bytes"]:
        raise CheckpointCorruptError(f"{where}: the data ends at byte {layout.total_bytes}, not at the file's end")


def check_tensor_crcs(layout: Layout, data: bytes | memoryview, manifest: dict[str, Any], where: str) -> None:
    """Every tensor's bytes must have the crc32 its manifest recorded (crc32 releases the GIL)."""
    view = memoryview(data)
    start = layout.data_start
    for entry in layout.entries:
        if crc32(view[start + entry.begin : start + entry.end]) != manifest["tensors"][entry.name]["crc32"]:
            raise CheckpointCorruptError(f"{where}: tensor '{entry.name}' fails its crc32 checksum")


def tensor_chunk(nbytes: int, chunk: int, per_tensor: int) -> int:
    """The chunk size of a tensor of ``nbytes``: at least ``chunk``, at most ``per_tensor`` chunks."""
    wanted = -(-nbytes // per_tensor)
    return max(chunk, 1 << (wanted - 1).bit_length()) if wanted > 1 else chunk


def chunk_bounds(
    data_start: int, tensors: Iterable[tuple[int, int]], chunk: int, per_tensor: int
) -> list[tuple[int, int]]:
    """The chunks of a file (file offsets): its header, then each tensor's bytes (data offsets
    ``(begin, end)``) cut from the tensor's start (``tensor_chunk``); empty tensors have none."""
    bounds = [(0, data_start)]
    for begin, end in sorted(tensors):
        size = tensor_chunk(end - begin, chunk, per_tensor)
        bounds.extend((data_start + o, data_start + min(o + size, end)) for o in range(begin, end, size))
    return bounds


def layout_chunks(layout: Layout) -> list[tuple[int, int]]:
    """The chunks a writer records for ``layout`` (``CHUNK_BYTES``, ``CHUNKS_PER_TENSOR``)."""
    return chunk_bounds(layout.data_start, ((e.begin, e.end) for e in layout.entries), CHUNK_BYTES, CHUNKS_PER_TENSOR)


def manifest_chunks(manifest: dict[str, Any]) -> list[tuple[int, int]]:
    """The chunks a (validated) manifest's crc32s are of, from its tensors' offsets alone."""
    offsets = [tuple(info["data_offsets"]) for info in manifest["tensors"].values()]
    data_start = manifest["file_bytes"] - max((end for _, end in offsets), default=0)
    chunks = manifest["chunks"]
    return chunk_bounds(data_start, offsets, chunks["bytes"], chunks["per_tensor"])  # type: ignore[arg-type]


def _check_chunks(doc: dict[str, Any], where: str) -> None:
    chunks = doc["chunks"]
    _expect(isinstance(chunks, dict), where, "has an invalid chunk list")
    size, per_tensor = chunks.get("bytes"), chunks.get("per_tensor")
    _expect(
        _is_int(size) and _MIN_CHUNK_BYTES <= size <= _MAX_CHUNK_BYTES and size & (size - 1) == 0,
        where,
        "has an invalid chunk size",
    )
    _expect(_is_int(per_tensor) and 1 <= per_tensor <= 1 << 16, where, "has an invalid chunks-per-tensor count")
    crcs = chunks.get("crc32")
    count = 1
    for info in doc["tensors"].values():
        nbytes = info["data_offsets"][1] - info["data_offsets"][0]
        count += -(-nbytes // tensor_chunk(nbytes, size, per_tensor))
    _expect(
        isinstance(crcs, list) and len(crcs) == count and all(_is_crc(c) for c in crcs),
        where,
        "does not carry one valid crc32 per chunk of its file",
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_uint(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _is_crc(value: Any) -> bool:
    return _is_int(value) and 0 <= value < 1 << 32


def _expect(condition: bool, where: str, problem: str) -> None:
    if not condition:
        raise CheckpointCorruptError(f"{where} {problem}")
