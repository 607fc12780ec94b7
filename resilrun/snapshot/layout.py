"""The byte layout of one rank's snapshot: a safetensors file, in memory or on storage.

A snapshot is exactly a safetensors file: an 8-byte little-endian header length, a JSON header
(padded with spaces to a multiple of 8 bytes, as the format allows), then the tensor bytes. So a
tier-1 memory slot can be written to storage as it is, and any safetensors reader opens our files.

Invariants: parsing never allocates more than the bytes it was given, never follows an offset
outside the data section, rejects overlapping tensors and unknown dtypes, and never unpickles.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from resilrun.errors import CheckpointCorruptError, CheckpointError

FORMAT = "resilrun-snapshot-1"
# A header larger than this is refused before it is read: 100 MB fits millions of tensor entries.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_ALIGN = 8

# safetensors dtype codes <-> (torch dtype name, element size)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "C64": ("complex64", 8),
}
TORCH_TO_CODE = {torch_name: code for code, (torch_name, _) in DTYPES.items()}
# CheckpointCorruptError lives in resilrun.errors (the one hierarchy); it stays importable from here.


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor's place in the data section (offsets relative to the data start)."""

    name: str
    dtype: str  # safetensors code, e.g. "F32"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class Layout:
    """Where every tensor lives in a snapshot buffer; equal layouts can reuse one buffer."""

    entries: tuple[TensorEntry, ...]
    header: bytes  # the 8-byte length prefix + padded JSON header

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def total_bytes(self) -> int:
        return self.data_start + max((e.end for e in self.entries), default=0)

    def signature(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        return tuple((e.name, e.dtype, e.shape) for e in self.entries)


def _element_size(code: str) -> int:
    return DTYPES[code][1]


def build_layout(specs: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> Layout:
    """Lay out tensors ``(name, dtype code, shape)`` back to back.

    safetensors forbids gaps, so alignment comes from order instead: wider dtypes first, which
    keeps every tensor aligned to its element size (typed views need that) with no padding.
    """
    for name, code, _ in specs:
        if code not in DTYPES:
            raise CheckpointError(f"dtype '{code}' of tensor '{name}' cannot be snapshotted")
    entries = []
    offset = 0
    for name, code, shape in sorted(specs, key=lambda spec: -_element_size(spec[1])):
        nbytes = _element_size(code)
        for dim in shape:
            nbytes *= dim
        entries.append(TensorEntry(name, code, tuple(shape), offset, offset + nbytes))
        offset += nbytes
    header_obj: dict[str, Any] = {
        e.name: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]} for e in entries
    }
    header_obj["__metadata__"] = {"format": FORMAT, **(metadata or {})}
    text = json.dumps(header_obj, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % _ALIGN)
    return Layout(tuple(entries), struct.pack("<Q", len(text)) + text)


def parse_header(prefix: bytes | memoryview, total_size: int) -> Layout:
    """Parse and validate a safetensors header from the first bytes of a file of ``total_size``.

    Raises:
        CheckpointCorruptError: truncated, oversized, malformed, overlapping or out-of-range.
    """
    if total_size < 8 or len(prefix) < 8:
        raise CheckpointCorruptError("snapshot is truncated: no header length")
    (length,) = struct.unpack("<Q", bytes(prefix[:8]))
    if length > MAX_HEADER_BYTES or 8 + length > total_size:
        raise CheckpointCorruptError(f"snapshot header length {length} exceeds the file ({total_size} bytes)")
    if len(prefix) < 8 + length:
        raise CheckpointCorruptError("snapshot header is truncated")
    try:
        header = json.loads(bytes(prefix[8 : 8 + length]))
    # ValueError covers bad UTF-8, bad JSON and integers over Python's digit limit; RecursionError
    # a forged header of deeply nested brackets. Neither may escape as a traceback.
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"snapshot header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointCorruptError("snapshot header is not a JSON object")
    data_size = total_size - 8 - length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries.append(_parse_entry(name, info, data_size))
    entries.sort(key=lambda e: e.begin)
    for before, after in zip(entries, entries[1:], strict=False):
        if after.begin < before.end:
            raise CheckpointCorruptError(f"tensors '{before.name}' and '{after.name}' overlap")
    return Layout(tuple(entries), bytes(prefix[: 8 + length]))


def _parse_entry(name: str, info: Any, data_size: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise CheckpointCorruptError(f"header entry '{name}' is not an object")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(code, str) or code not in DTYPES:  # a list here would be unhashable
        raise CheckpointCorruptError(f"tensor '{name}' has unknown dtype {code!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointCorruptError(f"tensor '{name}' has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise CheckpointCorruptError(f"tensor '{name}' points outside the data ({offsets!r}, {data_size} bytes)")
    expected = _element_size(code)
    for dim in shape:
        expected *= dim
    if offsets[1] - offsets[0] != expected:
        raise CheckpointCorruptError(f"tensor '{name}' size does not match its shape and dtype")
    return TensorEntry(name, code, tuple(shape), offsets[0], offsets[1])
