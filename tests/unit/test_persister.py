"""The persister commits a step once every rank is uploaded, and never hides a broken upload."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch

from resilrun.agent.state.persister import Persister
from resilrun.storage import MemoryStorage
from resilrun.tiers import durable
from resilrun.tiers.memory import NodeMemoryTier
from tests.conftest import make_snapshot


def fed_by(memory: NodeMemoryTier, storage: Any, **kwargs: Any) -> Persister:
    """A persister fed by node memory's announcements, as the agent's commit pipeline wires it."""
    persister = Persister(memory, storage, **kwargs)
    memory.add_listener(persister.on_commit)
    return persister


class _ShortSizes(MemoryStorage):
    """A store whose HEAD reports 0 bytes (seen with a broken S3 proxy): uploads look truncated."""

    def size(self, key: str) -> int:
        super().size(key)
        return 0


def _commit(memory: NodeMemoryTier, step: int) -> None:
    payload = make_snapshot({"w": torch.full((64,), float(step))})
    buffer = memory.rank(0).slots[0] or memory.allocate(0, 0, len(payload))
    memory.rank(0).seq.begin(0)
    buffer.view()[: len(payload)] = payload
    memory.rank(0).seq.end(0)
    memory.commit(0, step, 0, len(payload), {"step": step})


@pytest.mark.parametrize(("storage_type", "committed"), [(MemoryStorage, True), (_ShortSizes, False)])
def test_a_step_is_committed_only_when_storage_holds_it_and_a_mismatch_is_an_error(
    storage_type: type[MemoryStorage], committed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="resilrun")
    memory, storage = NodeMemoryTier("persister-test"), storage_type()
    persister = fed_by(memory, storage, every=1, keep_last=2, count_persisted=lambda step: 1, world_size=lambda: 1)
    try:
        _commit(memory, 0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "step 0" not in caplog.text:
            time.sleep(0.02)
    finally:
        persister.close(10)
        memory.close()
    if committed:
        assert durable.latest_complete_step(storage) == 0
        assert "step 0 persisted for all 1 ranks" in caplog.text
    else:
        assert durable.latest_complete_step(storage) is None
        assert "step 0 not committed: storage does not hold what was uploaded" in caplog.text
        assert "is 0 bytes but its manifest says" in caplog.text


def test_a_copy_torn_behind_a_stable_counter_is_not_uploaded_and_the_next_step_is() -> None:
    memory, storage = NodeMemoryTier("persister-torn"), MemoryStorage()
    torn = {1}

    def tear(rank: int, committed: object) -> None:
        # Registered before the persister, so it runs first: bytes of another step land in the slot
        # while the counter reads stable (stores a weakly ordered CPU reordered past the counter's).
        if getattr(committed, "step", None) in torn:
            buffer = memory.rank(rank).slots[0]
            assert buffer is not None
            buffer.view()[-64:] = b"\xee" * 64

    memory.add_listener(tear)
    persister = fed_by(memory, storage, every=1, keep_last=5, count_persisted=lambda step: 1, world_size=lambda: 1)
    try:
        _commit(memory, 1)
        _commit(memory, 2)
    finally:
        persister.close(10)  # uploads already due finish first
        memory.close()
    assert durable.latest_complete_step(storage) == 2
    assert [info.step for info in durable.list_steps(storage)] == [2]  # step 1 was torn: skipped, never uploaded


def test_a_node_the_fence_refuses_neither_uploads_nor_counts_and_one_refused_midway_uploads_but_never_counts() -> None:
    memory, storage = NodeMemoryTier("persister-fenced"), MemoryStorage()
    answers = iter([False, True, False])  # step 1: refused; step 2: refused after its upload
    counted: list[int] = []

    def count(step: int) -> int:
        counted.append(step)
        return 1

    fence = answers.__next__
    persister = fed_by(
        memory, storage, every=1, keep_last=5, count_persisted=count, world_size=lambda: 1, may_write=fence
    )
    try:
        for step in (1, 2):
            _commit(memory, step)
    finally:
        persister.close(10)
        memory.close()
    # Step 1 never reached storage; step 2 did, but was not counted: it has no COMPLETE.json
    assert [(info.step, info.complete) for info in durable.list_steps(storage)] == [(2, False)]
    assert counted == []


def test_a_step_restored_from_storage_is_not_uploaded_again_but_the_next_one_is() -> None:
    # Given storage holding step 0 of a one-rank job (a new job resuming on an old --checkpoint-uri)
    from resilrun.agent.state.tiers import NodeTiers

    storage = MemoryStorage()
    durable.write_rank(storage, 0, 0, 1, make_snapshot({"w": torch.zeros(64)}), {"step": 0})
    durable.commit_step(storage, 0, 1)
    before = {key: storage.get(key) for key in storage.list("step_")}
    memory = NodeMemoryTier("persister-restored")
    persister = fed_by(memory, storage, every=1, keep_last=5, count_persisted=lambda step: 1, world_size=lambda: 1)
    try:
        # When the step is restored from storage into node memory, and the worker then trains step 1
        NodeTiers(memory, storage).fetch(0, 0, "persistent")
        _commit(memory, 1)
    finally:
        persister.close(10)
        memory.close()
    # Then step 0's objects are those it was restored from (a rewrite would leave its manifests out
    # of step with COMPLETE.json until every rank rewrote: a torn step if the job died meanwhile),
    assert {key: storage.get(key) for key in before} == before
    assert durable.latest_complete_step(storage) == 1  # and what the worker trained is persisted
