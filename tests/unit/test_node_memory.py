"""Tier 1 (node memory): slots, commits, consistent reads while the worker keeps writing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from resilrun.errors import CheckpointError
from resilrun.state.memory import NodeMemoryTier


@pytest.fixture
def tier() -> Iterator[NodeMemoryTier]:
    memory = NodeMemoryTier("unit")
    yield memory
    memory.close()


def _write(tier: NodeMemoryTier, rank: int, step: int, slot: int, payload: bytes) -> None:
    """What a worker does: bump the slot's counter, copy, bump again, commit."""
    buffer = tier.rank(rank).slots[slot] or tier.allocate(rank, slot, len(payload))
    assert buffer is not None
    seq = tier.rank(rank).seq
    seq.begin(slot)
    buffer.view()[: len(payload)] = payload
    seq.end(slot)
    tier.commit(rank, step, slot, len(payload), {"step": step})


def test_a_committed_step_reads_back_with_its_values(tier: NodeMemoryTier) -> None:
    _write(tier, 0, 5, 0, b"five" * 10)
    _write(tier, 0, 6, 1, b"six!" * 10)
    assert tier.read(0, 5) == (b"five" * 10, {"step": 5})
    assert tier.read(0, 6) == (b"six!" * 10, {"step": 6})
    assert tier.read(0, 7) is None and tier.read(3, 5) is None
    assert sorted(int(c["step"]) for c in tier.describe(0)["committed"].values()) == [5, 6]


def test_a_slot_rewritten_after_its_commit_never_reads_as_the_old_step(tier: NodeMemoryTier) -> None:
    # Given step 5 committed in slot 0
    _write(tier, 0, 5, 0, b"A" * 64)
    # When the worker rewrites slot 0 with step 7 bytes completely but has not committed yet
    memory = tier.rank(0)
    buffer = memory.slots[0]
    assert buffer is not None
    memory.seq.begin(0)
    buffer.view()[:64] = b"B" * 64
    memory.seq.end(0)
    # Then a read of step 5 says "gone", never returns step 7's bytes labelled as step 5
    assert tier.read(0, 5) is None


def test_a_read_during_a_write_is_refused(tier: NodeMemoryTier) -> None:
    _write(tier, 0, 5, 0, b"A" * 64)
    tier.rank(0).seq.begin(0)  # the worker is mid-copy
    assert tier.read(0, 5) is None


def test_install_places_a_fetched_snapshot_in_the_free_slot(tier: NodeMemoryTier) -> None:
    _write(tier, 1, 5, 0, b"old" * 8)
    tier.install(1, 9, b"fetched!" * 4, {"step": 9})
    assert tier.read(1, 9) == (b"fetched!" * 4, {"step": 9})
    assert tier.read(1, 5) == (b"old" * 8, {"step": 5})  # the other slot is untouched


def test_bad_slots_and_commits_to_unallocated_slots_are_errors(tier: NodeMemoryTier) -> None:
    with pytest.raises(CheckpointError, match="slot 2 does not exist"):
        tier.allocate(0, 2, 16)
    with pytest.raises(CheckpointError, match="unallocated slot"):
        tier.commit(0, 1, 1, 16, {})
    with pytest.raises(CheckpointError, match="node memory cannot hold"):
        tier.allocate(0, 0, 1 << 62)


def test_background_threads_yield_the_cpu_to_training_and_never_raise_their_priority() -> None:
    import os
    import threading

    from resilrun.state._priority import BACKGROUND_NICE, yield_to_training

    seen: list[int] = []
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # (pytest may itself run niced)

    def background() -> None:
        yield_to_training()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(base, 15))
        yield_to_training()  # already lower: left alone
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen == [max(base, BACKGROUND_NICE), max(base, 15)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller is untouched


def test_a_full_node_memory_is_a_clear_checkpoint_error_and_keeps_the_other_slot(tier: NodeMemoryTier) -> None:
    # Given rank 0 with step 1 committed in slot 0
    import os
    import resource

    _write(tier, 0, 1, 0, b"a" * 8192)
    fds_before = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # When node memory cannot take a new buffer (a file-size limit makes the memfd's ftruncate fail
    # with EFBIG, as a full memory cgroup would with ENOMEM)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(CheckpointError, match=r"node memory is full: could not allocate .* rank 0: File too large"):
            tier.allocate(0, 1, 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    # Then the committed step is still there, and no descriptor leaked
    assert tier.read(0, 1) == (b"a" * 8192, {"step": 1})
    assert len(os.listdir("/proc/self/fd")) == fds_before
