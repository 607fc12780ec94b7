"""Deduplicated snapshots: the owner plan, borrowed ranges, and node memory assembling them.

Node memory is real (memfds, sequence counters); the "workers" are this test writing slots the
way a worker does, so the interleavings (owner late, owner gone, owner rewriting) are exact.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import pytest

from resilrun.errors import CheckpointError
from resilrun.snapshot.dedup import borrowed_ranges, layout_hash, parse_borrowed, plan_owners
from resilrun.snapshot.layout import build_layout
from resilrun.tiers.memory import NodeMemoryTier

SPECS = [("w1", "F32", (64,)), ("w2", "F32", (32,)), ("w3", "F32", (16,)), ("w4", "F32", (16,)), ("bn", "F32", (8,))]
LAYOUT = build_layout(SPECS)
REPLICATED = {"w1", "w2", "w3", "w4"}


def test_the_plan_is_complete_byte_balanced_and_the_same_whatever_the_order_of_the_group() -> None:
    owners = plan_owners(LAYOUT, REPLICATED, [1, 0])
    assert owners == plan_owners(LAYOUT, sorted(REPLICATED), [0, 1])
    assert set(owners) == REPLICATED  # buffers and other per-rank tensors are never planned
    load = {rank: sum(e.nbytes for e in LAYOUT.entries if owners.get(e.name) == rank) for rank in (0, 1)}
    assert load == {0: 256, 1: 256}  # w1 | w2 + w3 + w4
    assert plan_owners(LAYOUT, REPLICATED, [0]) == {}  # alone on its node: nothing to share


def test_borrowed_ranges_cover_exactly_what_others_own_merged_per_owner() -> None:
    owners = {"w2": 1, "w3": 1, "w4": 2}
    ranges = borrowed_ranges(LAYOUT, owners, 0)
    by_name = {e.name: (LAYOUT.data_start + e.begin, LAYOUT.data_start + e.end) for e in LAYOUT.entries}
    assert ranges == ((1, by_name["w2"][0], by_name["w3"][1]), (2, *by_name["w4"]))
    assert borrowed_ranges(LAYOUT, owners, 1) == ((2, *by_name["w4"]),)


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("nope", "must be a list"),
        ([[1, 0]], "integers"),
        ([[1, 0, True]], "integers"),
        ([[0, 0, 8]], "not valid"),  # from itself
        ([[1, 8, 8]], "not valid"),  # empty
        ([[1, 0, 4096]], "not valid"),  # past the end
        ([[1, 0, 16], [2, 8, 24]], "overlap"),
    ],
)
def test_malformed_borrowed_ranges_are_refused(raw: object, problem: str) -> None:
    with pytest.raises(CheckpointError, match=problem):
        parse_borrowed(raw, 0, 1024)


def test_the_layout_hash_of_a_slot_is_the_crc_of_its_header() -> None:
    data = LAYOUT.header + bytes(LAYOUT.total_bytes - LAYOUT.data_start)
    assert layout_hash(data) == zlib.crc32(LAYOUT.header)
    assert layout_hash(b"abc") == 0


# -- node memory --------------------------------------------------------------------------------------
@pytest.fixture
def tier() -> Iterator[NodeMemoryTier]:
    memory = NodeMemoryTier("dedup")
    yield memory
    memory.close()


BORROWED_FROM_1 = ((1, 8, 16),)


def _write(
    tier: NodeMemoryTier, rank: int, step: int, payload: bytes, borrowed: tuple = (), layout: int = 7, round: int = 1
) -> bool:
    """A worker's save: the slot not holding its newest step, bytes between the counter bumps, commit."""
    memory = tier.rank(rank)
    newest = memory.newest()
    slot = 0 if newest is None else (newest.slot + 1) % 2
    buffer = memory.slots[slot] or tier.allocate(rank, slot, len(payload))
    memory.seq.begin(slot)
    view = buffer.view()
    for index, byte in enumerate(payload):
        if not any(begin <= index < end for _, begin, end in borrowed):
            view[index] = byte
    memory.seq.end(slot)
    return tier.commit(rank, step, slot, len(payload), {"step": step}, borrowed, layout, round=round)


def test_a_snapshot_is_complete_and_announced_only_once_its_owner_committed_the_step(tier: NodeMemoryTier) -> None:
    announced: list[tuple[int, int]] = []
    tier.add_listener(lambda rank, c: announced.append((rank, c.step)))
    # rank 0 owns bytes 0-8 and 16-24 and borrows 8-16 from rank 1; rank 1 the other way round
    assert _write(tier, 0, 5, b"A" * 24, BORROWED_FROM_1) is False
    assert announced == [] and tier.read(0, 5) is None and not tier.is_complete(0, 5)
    assert [c["complete"] for c in tier.describe(0)["committed"].values()] == [False]
    _write(tier, 1, 5, b"B" * 24, ((0, 0, 8), (0, 16, 24)))
    assert sorted(announced) == [(0, 5), (1, 5)]
    assert tier.read(0, 5) == (bytearray(b"A" * 8 + b"B" * 8 + b"A" * 8), {"step": 5})
    assert tier.read(1, 5) == (bytearray(b"A" * 8 + b"B" * 8 + b"A" * 8), {"step": 5})
    assert tier.is_complete(0, 5) and tier.is_complete(1, 5)


def test_an_owner_rewriting_its_slot_makes_the_borrowing_read_none_never_torn(tier: NodeMemoryTier) -> None:
    _write(tier, 1, 5, b"B" * 24)
    _write(tier, 0, 5, b"A" * 24, BORROWED_FROM_1)
    owner = tier.rank(1)
    owner.seq.begin(0)  # rank 1 starts writing its next step over step 5
    assert tier.read(0, 5) is None
    owner.seq.end(0)
    assert tier.read(0, 5) is None  # and once it finished, those are another step's bytes


def test_an_owner_with_another_layout_is_not_borrowed_from_and_deduplication_stops(tier: NodeMemoryTier) -> None:
    _write(tier, 1, 5, b"B" * 24, layout=1)
    assert _write(tier, 0, 5, b"A" * 24, BORROWED_FROM_1, layout=2) is True  # next snapshot: whole
    assert tier.read(0, 5) is None and not tier.is_complete(0, 5)
    assert _write(tier, 0, 6, b"C" * 24, layout=2) is True  # stays off for the rest of the job
    assert tier.read(0, 6) == (bytearray(b"C" * 24), {"step": 6})


def test_bytes_are_never_borrowed_from_an_abandoned_timelines_copy_of_the_step(tier: NodeMemoryTier) -> None:
    _write(tier, 1, 5, b"O" * 24, round=1)  # generation 1 reached step 5, then rolled back
    _write(tier, 0, 5, b"A" * 24, BORROWED_FROM_1, round=2)  # generation 2 trains step 5 again
    assert not tier.is_complete(0, 5) and tier.read(0, 5) is None and tier.lend(0, 5) is None
    _write(tier, 1, 5, b"B" * 24, round=2)
    assert tier.read(0, 5) == (bytearray(b"A" * 8 + b"B" * 8 + b"A" * 8), {"step": 5})


def test_a_rank_whose_owner_is_out_of_step_is_asked_for_a_whole_snapshot(tier: NodeMemoryTier) -> None:
    _write(tier, 1, 3, b"B" * 24)
    assert _write(tier, 0, 4, b"A" * 24, BORROWED_FROM_1) is False  # one step apart: lockstep
    assert _write(tier, 0, 5, b"A" * 24, BORROWED_FROM_1) is True  # two apart: write everything next
    assert _write(tier, 0, 6, b"A" * 24) is False  # a whole snapshot borrows nothing: back to sharing
    assert tier.read(0, 6) == (bytearray(b"A" * 24), {"step": 6})


def test_a_restoring_rank_is_lent_the_owners_slots_that_hold_what_it_borrowed(tier: NodeMemoryTier) -> None:
    _write(tier, 1, 5, b"B" * 24)
    _write(tier, 0, 5, b"A" * 24, BORROWED_FROM_1)
    lent = tier.lend(0, 5)
    assert lent is not None
    borrowed, buffers = lent
    assert borrowed == BORROWED_FROM_1 and list(buffers) == [1]
    assert bytes(buffers[1].view()[8:16]) == b"B" * 8  # the bytes rank 0 reads from rank 1's slot
    assert tier.lend(1, 5) == ((), {})  # nothing borrowed: its own slot is enough


def test_nothing_is_lent_once_an_owner_no_longer_holds_the_step(tier: NodeMemoryTier) -> None:
    _write(tier, 1, 5, b"B" * 24)
    _write(tier, 0, 5, b"A" * 24, BORROWED_FROM_1)
    _write(tier, 1, 6, b"C" * 24)
    _write(tier, 1, 7, b"D" * 24)
    assert tier.lend(0, 5) is None
    assert not tier.is_complete(0, 5)


def test_a_snapshot_installed_from_another_tier_is_complete_and_whole(tier: NodeMemoryTier) -> None:
    data = LAYOUT.header + bytes(LAYOUT.total_bytes - LAYOUT.data_start)
    tier.install(0, 9, data, {"step": 9})
    assert tier.read(0, 9) == (bytearray(data), {"step": 9})
    held = next(iter(tier.rank(0).committed.values()))
    assert held.borrowed == () and held.layout == zlib.crc32(LAYOUT.header)
