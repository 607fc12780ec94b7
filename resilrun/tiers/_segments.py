"""Per-segment crc32s of a snapshot commit, and whether a reader's copy holds what was committed.

Why a read is never torn, on any CPU: the agent hashes each commit's own bytes (crc32 per segment:
the header, each tensor) while handling the commit, before the commit is visible and before it is
answered. Those bytes cannot change then: the worker rewrites a slot only after it has read the
answer to a *later* commit (it writes the slot not holding its newest step, after collecting the
previous commit's answer), and the answer travels through a socket, whose kernel locks order the
worker's stores before the agent's receive and the agent's loads before the worker's next stores,
whatever the CPU's memory model. A reader then checks its private copy, after copying, against those
crc32s: a copy with bytes of two steps fails, however the slot's stores and the sequence counter
became visible to it (on aarch64 the counter alone can read stable over a torn copy). The counter
stays as the cheap early exit. The cost is one crc32 pass per commit on the agent's channel thread
(ISA-L's crc32 outruns the memcpy the worker paid for the same bytes; the worker reads the answer
only at its next step), nothing on the worker; a reader that copies pays one pass over its copy.

Pure functions over bytes: no lock, no slot bookkeeping (that is ``memory.NodeMemoryTier``'s).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator

from resilrun.errors import CheckpointCorruptError
from resilrun.snapshot.crc import crc32
from resilrun.snapshot.dedup import Borrowed
from resilrun.snapshot.layout import parse_header
from resilrun.snapshot.shm import SharedBuffer
from resilrun.tiers.slots import Committed

logger = logging.getLogger(__name__)


def pieces(borrowed: Borrowed, begin: int, end: int) -> Iterator[tuple[int, int, int | None]]:
    """[begin, end) split by which slot holds each part: the owner rank's where borrowed, else None (own)."""
    position = begin
    for owner, lent_begin, lent_end in sorted(borrowed, key=lambda r: r[1]):
        lo, hi = max(lent_begin, begin), min(lent_end, end)
        if lo >= hi:
            continue
        if position < lo:
            yield position, lo, None
        yield lo, hi, owner
        position = hi
    if position < end:
        yield position, end, None


def checksums(view: memoryview, nbytes: int, borrowed: Borrowed) -> tuple[tuple[int, int, int], ...]:
    """(begin, end, crc32) of each segment of ``view[:nbytes]`` outside ``borrowed``.

    Segments are cut at the tensors' bounds (when the bytes are a snapshot) and at the borrowed
    ranges, so that a range another rank borrows is whole segments here, and a crc32 here is the one
    the durable manifest and a peer's trailer carry for that tensor.
    """
    cuts = {0, nbytes, *_tensor_cuts(view, nbytes)}
    for _, begin, end in borrowed:
        cuts.update((begin, end))
    bounds = sorted(cut for cut in cuts if 0 <= cut <= nbytes)
    return tuple(
        (begin, end, crc32(view[begin:end]))
        for begin, end in zip(bounds, bounds[1:], strict=False)
        if not any(lent_begin <= begin and end <= lent_end for _, lent_begin, lent_end in borrowed)
    )


def _tensor_cuts(view: memoryview, nbytes: int) -> tuple[int, ...]:
    """The header's and each tensor's bounds in a snapshot; none when the bytes are not one."""
    if nbytes < 8:
        return ()
    length = int.from_bytes(view[:8], "little")
    if 8 + length > nbytes:
        return ()
    return _cuts_of_header(bytes(view[: 8 + length]), nbytes)


@functools.lru_cache(maxsize=16)
def _cuts_of_header(header: bytes, nbytes: int) -> tuple[int, ...]:
    """Cached: a job commits the same few layouts every step, and parsing a large header costs."""
    try:
        layout = parse_header(header, nbytes)
    except CheckpointCorruptError:
        return ()
    start = layout.data_start
    return (start, *(start + e.begin for e in layout.entries), *(start + e.end for e in layout.entries))


def is_intact(committed: Committed, buffer: SharedBuffer, copied: memoryview, begin: int, end: int) -> bool:
    """Whether ``copied[begin:end]`` (slot offsets) holds the bytes ``committed`` wrote there.

    A segment only partly inside the range is completed from the slot itself: a torn remainder makes
    the check fail, never pass (the copy is refused; it is only ever a false alarm). A commit made
    without checksums (``checksum_commits=False``) is checked by the sequence counters alone.
    """
    if not committed.crcs:
        return True
    position = begin
    for segment_begin, segment_end, expected in committed.crcs:
        if segment_end <= begin or segment_begin >= end:
            continue
        if segment_begin > position:
            return False  # bytes the commit did not write (borrowed from a third rank): unverifiable
        lo, hi = max(segment_begin, begin), min(segment_end, end)
        crc = crc32(buffer.view()[segment_begin:lo]) if segment_begin < lo else 0
        crc = crc32(copied[lo:hi], crc)
        if hi < segment_end:
            crc = crc32(buffer.view()[hi:segment_end], crc)
        if crc != expected:
            return False
        position = hi
    return position >= end


def log_torn(rank: int, step: int) -> None:
    # Expected now and then (a reader slower than a step): the caller moves on, as on a moved counter.
    logger.debug("a copy of rank %d step %d failed its commit's crc32s: overwritten meanwhile", rank, step)
