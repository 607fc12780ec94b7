"""Deduplicated snapshots: which local rank copies which data-parallel replicated tensor.

Why: under DDP every rank of a node holds the same parameters and optimizer state after each step,
so copying all of them from every rank moves L times the bytes one copy needs through the node's
memory bus, and that traffic is what per-step snapshots cost the training step. Instead each of
the L local ranks copies a byte-balanced 1/L of the replicated tensors (plus everything of its
own), and its snapshot *borrows* the rest from the owners' snapshots of the same step. The agent
assembles a complete snapshot whenever one leaves node memory whole (upload, replica), and a
restoring rank maps the owners' slots and reads the borrowed tensors there, so the stored format
is unchanged.

Invariants: the plan is a pure function of the layout, the replicated names and the group, so
every rank of the group computes the same owners without talking; a borrowed range is an absolute
byte range of the slot, valid only in an owner whose snapshot of the same step has the same layout.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Collection, Sequence

from resilrun.errors import CheckpointError
from resilrun.snapshot.layout import Layout

# (owner rank, begin, end): bytes [begin, end) of a slot that the owner's slot of the same step holds.
Borrowed = tuple[tuple[int, int, int], ...]


def plan_owners(layout: Layout, replicated: Collection[str], group: Sequence[int]) -> dict[str, int]:
    """The owner of each replicated tensor: largest first to the least-loaded rank of ``group``.

    Ties go to the lowest rank and names break size ties, so the plan is the same on every rank.
    """
    ranks = sorted(set(group))
    if len(ranks) < 2:
        return {}
    load = dict.fromkeys(ranks, 0)
    owners: dict[str, int] = {}
    shared = sorted((e for e in layout.entries if e.name in replicated), key=lambda e: (-e.nbytes, e.name))
    for entry in shared:
        owner = min(ranks, key=lambda r: (load[r], r))
        owners[entry.name] = owner
        load[owner] += entry.nbytes
    return owners


def borrowed_ranges(layout: Layout, owners: dict[str, int], rank: int) -> Borrowed:
    """The slot ranges ``rank`` leaves to other owners, adjacent ranges of one owner merged."""
    ranges: list[tuple[int, int, int]] = []
    base = layout.data_start
    for entry in sorted(layout.entries, key=lambda e: e.begin):
        owner = owners.get(entry.name, rank)
        if owner == rank or entry.nbytes == 0:
            continue
        begin, end = base + entry.begin, base + entry.end
        if ranges and ranges[-1][0] == owner and ranges[-1][2] == begin:
            ranges[-1] = (owner, ranges[-1][1], end)
        else:
            ranges.append((owner, begin, end))
    return tuple(ranges)


def shared_ranges(layout: Layout, replicated: Collection[str]) -> tuple[tuple[int, int], ...]:
    """Slot ranges of the replicated tensors, adjacent ones merged: what every rank holds alike."""
    ranges: list[tuple[int, int]] = []
    base = layout.data_start
    for entry in sorted(layout.entries, key=lambda e: e.begin):
        if entry.name not in replicated or entry.nbytes == 0:
            continue
        begin, end = base + entry.begin, base + entry.end
        if ranges and ranges[-1][1] == begin:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((begin, end))
    return tuple(ranges)


def parse_shared(raw: object, rank: int, nbytes: int) -> tuple[tuple[int, int], ...]:
    """Validate a commit's shared ranges (sorted, disjoint, inside the snapshot).

    Raises:
        CheckpointError: they are not.
    """
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise CheckpointError(f"rank {rank}: shared ranges must be a list")
    ranges: list[tuple[int, int]] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and all(type(v) is int for v in item)):
            raise CheckpointError(f"rank {rank}: a shared range must be [begin, end] integers")
        begin, end = item
        if not 0 <= begin < end <= nbytes or (ranges and begin < ranges[-1][1]):
            raise CheckpointError(f"rank {rank}: shared range {item} is out of order or outside the snapshot")
        ranges.append((begin, end))
    return tuple(ranges)


def parse_borrowed(raw: object, rank: int, nbytes: int) -> Borrowed:
    """Validate a commit's borrowed ranges (from a worker's message).

    Raises:
        CheckpointError: malformed, overlapping, outside the snapshot, or borrowed from itself.
    """
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise CheckpointError(f"rank {rank}: borrowed ranges must be a list")
    ranges: list[tuple[int, int, int]] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and all(type(v) is int for v in item)):
            raise CheckpointError(f"rank {rank}: a borrowed range must be [owner, begin, end] integers")
        owner, begin, end = item
        if owner == rank or owner < 0 or not 0 <= begin < end <= nbytes:
            raise CheckpointError(f"rank {rank}: borrowed range {item} is not valid for a {nbytes}-byte snapshot")
        ranges.append((owner, begin, end))
    ordered = sorted(ranges, key=lambda r: r[1])
    for before, after in zip(ordered, ordered[1:], strict=False):
        if after[1] < before[2]:
            raise CheckpointError(f"rank {rank}: borrowed ranges {list(before)} and {list(after)} overlap")
    return tuple(ranges)


def layout_hash(snapshot: bytes | bytearray | memoryview) -> int:
    """crc32 of a snapshot's header (length prefix included): equal for equal layouts."""
    if len(snapshot) < 8:
        return 0
    (length,) = struct.unpack_from("<Q", snapshot, 0)
    return zlib.crc32(snapshot[: 8 + min(length, len(snapshot) - 8)])


def owners_of(borrowed: Borrowed) -> frozenset[int]:
    return frozenset(owner for owner, _, _ in borrowed)
