"""Which bytes of a snapshot a reader needs: some tensors' dim-0 rows, and optionally the rest whole.

Why: a rank resuming at another world size needs, of an old rank's snapshot, only the rows of each
sharded tensor that overlap its own new block (FSDP2 shards dim 0, so those rows are one contiguous
run of bytes) and, from the one old rank its unsharded state comes from, every other tensor whole.
A ``Selection`` names that by tensor names and rows, which the reader knows from the snapshot's
values before it knows any file offset; ``ranges`` turns it into byte ranges of one file once its
header is parsed, the same way on every side (the agent reading storage, a peer serving it, and the
receiver checking that the peer sent what was asked).

Invariants: the header is always part of the ranges (a partial copy still parses, so its tensors
can be viewed where they are); ranges are sorted, disjoint, merged and inside the file; a selection
read from a message is checked before use (names are strings, rows are ``0 <= lo <= hi``), and rows
beyond a tensor's end are clipped to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from resilrun.snapshot.layout import Layout

# Selections ride in control messages; a snapshot holds at most a few million tensors.
MAX_SELECTED = 1 << 22


@dataclass(frozen=True, slots=True)
class Selection:
    """Rows ``[lo, hi)`` along dim 0 of the tensors named in ``rows``; every other tensor whole
    when ``rest`` (else not at all)."""

    rows: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    rest: bool = False

    def ranges(self, layout: Layout) -> list[tuple[int, int]]:
        """The byte ranges of the file laid out by ``layout`` that hold the selection (file
        offsets, the header first, merged)."""
        start = layout.data_start
        found = [(0, start)]
        for entry in layout.entries:
            if entry.name in self.rows:
                lo, hi = self.rows[entry.name]
                rows = entry.shape[0] if entry.shape else 1
                lo, hi = min(lo, rows), min(hi, rows)
                if hi <= lo or rows == 0:
                    continue
                row_bytes = entry.nbytes // rows
                found.append((start + entry.begin + lo * row_bytes, start + entry.begin + hi * row_bytes))
            elif self.rest and entry.nbytes:
                found.append((start + entry.begin, start + entry.end))
        return merge(found)

    def to_message(self) -> dict[str, Any]:
        return {"rows": {name: [lo, hi] for name, (lo, hi) in self.rows.items()}, "rest": self.rest}

    @classmethod
    def from_message(cls, message: Any) -> Selection:
        """Raises ValueError for anything but a well-formed selection."""
        if not isinstance(message, dict) or not isinstance(message.get("rest"), bool):
            raise ValueError("a selection is an object with 'rows' and a boolean 'rest'")
        rows = message.get("rows")
        if not isinstance(rows, dict) or len(rows) > MAX_SELECTED:
            raise ValueError("a selection's 'rows' is not an object of tensor names")
        parsed: dict[str, tuple[int, int]] = {}
        for name, bounds in rows.items():
            if (
                not isinstance(bounds, list)
                or len(bounds) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
                or not 0 <= bounds[0] <= bounds[1]
            ):
                raise ValueError(f"a selection's rows of '{str(name)[:200]}' are not [lo, hi] with 0 <= lo <= hi")
            parsed[name] = (bounds[0], bounds[1])
        return cls(parsed, message["rest"])


def merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint ranges covering the same bytes (touching ones joined, empty ones dropped)."""
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def check_ranges(raw: Any, total: int) -> list[tuple[int, int]]:
    """Ranges read from a message: a list of [begin, end] pairs, sorted, disjoint, inside ``total``.

    Raises:
        ValueError: anything else.
    """
    if not isinstance(raw, list) or len(raw) > 2 * MAX_SELECTED:
        raise ValueError("byte ranges are not a list")
    ranges: list[tuple[int, int]] = []
    position = 0
    for item in raw:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in item)
            or not position <= item[0] < item[1] <= total
        ):
            raise ValueError(f"byte range {str(item)[:100]} is not sorted, disjoint and inside {total} bytes")
        ranges.append((item[0], item[1]))
        position = item[1]
    return ranges
