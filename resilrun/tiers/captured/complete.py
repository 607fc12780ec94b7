"""Whether a captured file's bytes are a whole file of its format, or a writer stopped part way.

A closed file is not a complete one: the kernel closes a killed writer's descriptor too, and inotify
reports that close like any other. The formats checkpoints come in end with what says how long they
are (a zip's end-of-central-directory record, a safetensors or .npy header that gives every size),
so a cut-short file is recognised from its bytes alone.

Invariants: nothing here reads or decompresses tensor data, and nothing copies more than a header
or a zip's central directory, so a file of many GB is judged in about the time its index takes to
parse. A format not recognised is passed as complete (None): the settle delay is all there is for
it, and ``is_verifiable`` tells such a pass from a verdict.

torch.distributed.checkpoint's ``.distcp`` files are judged unknown (None) whatever they start with:
they are many torch.save zips and raw byte runs end to end, so a cut at an item's end looks like a
whole zip and a file ending in raw bytes looks like a cut one. A DCP folder is complete when its
``.metadata`` appears (written last, by a rename), and the offsets in it say how long each file is.
"""

from __future__ import annotations

import io
import json
import math
import struct
import zipfile
from typing import Any

Data = bytes | bytearray | memoryview

_ZIP_MAGIC = b"PK\x03\x04"
_EMPTY_ZIP_MAGIC = b"PK\x05\x06"  # a zip with no members: only its end record
_ZIP_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, (version .. sizes), name length, extra length
_NPY_MAGIC = b"\x93NUMPY"
# The safetensors library refuses larger headers; here it also keeps a file that merely has "{" at
# byte 8 from being read as a safetensors header of absurd length.
_SAFETENSORS_MAX_HEADER = 100_000_000


def describe_format(data: Data) -> str:
    """A short name of the format the bytes look like, for logs and status.

    "bytes" for every format this module cannot judge (torch.save's legacy pickle format included).
    """
    head = bytes(data[:64])
    if head.startswith((_ZIP_MAGIC, _EMPTY_ZIP_MAGIC)):
        return "torch.save (zip)" if _is_torch_zip(head) else "zip"
    if head.startswith(_NPY_MAGIC):
        return "numpy"
    if _looks_like_safetensors(data):
        return "safetensors"
    return "bytes"


def incomplete_reason(name: str, data: Data) -> str | None:
    """Why these bytes are not a complete file of their format, or None when they are (or the format is unknown).

    Args:
        name: the file's name or relative path: a ``.safetensors`` suffix marks the format even when
            too few bytes are there to recognise it by; ``.distcp`` files are not judged.
        data: the whole file.

    Returns:
        A short reason naming the format, e.g. "a zip archive (torch.save) without its end-of-central-directory
        record: truncated", or None.
    """
    return _judge(name, memoryview(data).cast("B")) or None


def is_verifiable(name: str, data: Data) -> bool:
    """Whether ``incomplete_reason`` judged these bytes by their format, rather than passing them as unknown.

    What to ask of a file closed as its writer died: None from ``incomplete_reason`` proves it whole
    only when this is True. An empty file is not verifiable (a writer killed before its first write
    leaves one), nor is a ``.distcp`` file, legacy torch.save pickle, or plain bytes.
    """
    return _judge(name, memoryview(data).cast("B")) is not None


_COMPLETE = ""  # _judge's answer for "known format, complete"; None is "unknown format"


def _judge(name: str, view: memoryview) -> str | None:
    """A reason (incomplete), ``_COMPLETE`` (a known format, whole) or None (a format not judged)."""
    if len(view) == 0 or name.endswith(".distcp"):
        return None
    head = bytes(view[:16])
    for magic, what in ((_ZIP_MAGIC, "a zip archive"), (_NPY_MAGIC, "a numpy .npy file")):
        # A writer stopped inside the magic itself. Not "PK" alone: two letters are as likely a text file.
        if len(head) < len(magic) and magic.startswith(head) and (len(head) >= 3 or not head.isascii()):
            return f"{what} cut short inside its {len(magic)}-byte signature: truncated"
    if head.startswith((_ZIP_MAGIC, _EMPTY_ZIP_MAGIC)):
        return _zip_reason(view)
    if head.startswith(_NPY_MAGIC):
        return _npy_reason(view)
    if name.endswith(".safetensors") or _looks_like_safetensors(view):
        return _safetensors_reason(view, by_name=name.endswith(".safetensors"))
    return None


# -- zip (torch.save since torch 1.6, numpy.savez) ---------------------------------------------------
class _Reader(io.RawIOBase):
    """A seekable file over a buffer without copying it (io.BytesIO copies a memoryview)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos : self._pos + len(buffer)]
        buffer[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


def _is_torch_zip(head: bytes) -> bool:
    """torch.save's first member is ``<archive>/data.pkl`` (after a 30-byte local header)."""
    if len(head) < 30 or not head.startswith(_ZIP_MAGIC):
        return False
    _, name_length, _ = _ZIP_LOCAL_HEADER.unpack_from(head)
    return head[30 : 30 + name_length].endswith(b"/data.pkl")


def _zip_reason(view: memoryview) -> str | None:
    """A reason, or ``_COMPLETE``: the end record is there and every member's bytes lie within the data."""
    what = "a zip archive (torch.save)" if _is_torch_zip(bytes(view[:64])) else "a zip archive"
    try:
        with zipfile.ZipFile(_Reader(view)) as archive:
            members = archive.infolist()
    except zipfile.BadZipFile as exc:
        if "not a zip file" in str(exc):  # zipfile's words for "no end-of-central-directory record"
            return f"{what} without its end-of-central-directory record: truncated"
        return f"{what} whose central directory does not parse ({exc}): truncated or damaged"
    except (OSError, EOFError, ValueError, struct.error) as exc:
        return f"{what} whose central directory does not parse ({exc}): truncated or damaged"
    for member in members:
        # Each member's bytes follow its local header, whose name and extra field may differ in length
        # from the central directory's copy: read the local header itself.
        start = member.header_offset
        header = bytes(view[start : start + _ZIP_LOCAL_HEADER.size])
        if len(header) < _ZIP_LOCAL_HEADER.size:
            return f"{what} whose member {member.filename!r} starts past the end of the data: truncated"
        signature, name_length, extra_length = _ZIP_LOCAL_HEADER.unpack(header)
        if signature != _ZIP_MAGIC:
            return f"{what} whose member {member.filename!r} has no local header: damaged"
        end = start + _ZIP_LOCAL_HEADER.size + name_length + extra_length + member.compress_size
        if end > len(view):
            return f"{what} whose member {member.filename!r} ends past the end of the data: truncated"
    return _COMPLETE


# -- safetensors -----------------------------------------------------------------------------------
def _looks_like_safetensors(data: Data) -> bool:
    """An 8-byte little-endian header length of a plausible size, then a JSON object."""
    if len(data) < 9 or data[8] != ord("{"):
        return False
    (length,) = struct.unpack("<Q", bytes(data[:8]))
    return length <= _SAFETENSORS_MAX_HEADER


def _safetensors_reason(view: memoryview, *, by_name: bool) -> str | None:
    """A reason, ``_COMPLETE``, or None: recognised by its bytes only (``by_name`` False), a header that
    is no safetensors header means another format, not a damaged file."""
    what = "a safetensors file"
    if len(view) < 8:
        return f"{what} of {len(view)} bytes, shorter than its 8-byte header length: truncated"
    (length,) = struct.unpack("<Q", view[:8])
    if length > _SAFETENSORS_MAX_HEADER:
        return f"{what} whose header length ({length} bytes) is not plausible: damaged" if by_name else None
    if 8 + length > len(view):
        return f"{what} whose {length}-byte JSON header is cut short at {len(view)} bytes: truncated"
    try:
        header = json.loads(bytes(view[8 : 8 + length]))
        ends = [_data_end(entry) for key, entry in header.items() if key != "__metadata__"]
    except (ValueError, AttributeError, TypeError, KeyError) as exc:
        return f"{what} whose header does not parse ({exc}): damaged" if by_name else None
    expected = 8 + length + max(ends, default=0)
    if len(view) < expected:
        return f"{what} of {len(view)} bytes whose header describes {expected}: truncated"
    if len(view) > expected:
        return f"{what} of {len(view)} bytes whose header describes only {expected}: trailing bytes"
    return _COMPLETE


def _data_end(entry: Any) -> int:
    begin, end = entry["data_offsets"]
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
        raise ValueError(f"data_offsets {entry['data_offsets']!r}")
    return end


# -- numpy .npy ------------------------------------------------------------------------------------
def _npy_reason(view: memoryview) -> str | None:
    """A reason, ``_COMPLETE``, or None for what the header cannot size (pickled objects, version 3)."""
    import numpy as np  # only when a .npy file is judged: the agent need not import numpy otherwise

    what = "a numpy .npy file"
    if len(view) < 10:
        return f"{what} of {len(view)} bytes, shorter than its header: truncated"
    major = view[6]
    if major not in (1, 2):  # version 3 (utf-8 field names) has no public reader: unknown
        return None
    size_format = "<H" if major == 1 else "<I"
    (header_length,) = struct.unpack_from(size_format, view, 8)
    header_end = 8 + struct.calcsize(size_format) + header_length
    if header_end > len(view):
        return f"{what} whose {header_length}-byte header is cut short at {len(view)} bytes: truncated"
    stream = io.BytesIO(bytes(view[:header_end]))
    try:
        version = np.lib.format.read_magic(stream)
        # The header is the user's own script's; a large one (many fields) is no reason to refuse it.
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(stream, max_header_size=header_length + 1)
    except (ValueError, SyntaxError, TypeError) as exc:
        return f"{what} whose header does not parse ({exc}): damaged"
    if dtype.hasobject:  # pickled objects follow: their length is not in the header
        return None
    expected = header_end + math.prod(shape) * dtype.itemsize
    if len(view) < expected:
        return f"{what} of {len(view)} bytes whose header describes {expected}: truncated"
    return _COMPLETE
