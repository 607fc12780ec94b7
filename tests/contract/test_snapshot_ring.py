"""A worker's Snapshotter and the agent's node memory agree on the ring of slots, also when the
node cannot hold the third slot a job with replicas asks for (then both fall back to two)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from resilrun.agent.channel import AgentChannel
from resilrun.agent.control import WorkerControl
from resilrun.agent.tiers import NodeTiers
from resilrun.tiers import memory as memory_module
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.slots import REPLICATED_SLOTS
from resilrun.worker._channel import AgentClient
from resilrun.worker.snapshot import Snapshotter


@pytest.fixture
def ring() -> Iterator[tuple[NodeMemoryTier, Snapshotter]]:
    memory = NodeMemoryTier("ring-contract", slots=REPLICATED_SLOTS)
    channel = AgentChannel(memory, NodeTiers(memory, None), WorkerControl())
    snapshotter = Snapshotter(AgentClient(channel.path, channel.token), rank=0)
    try:
        yield memory, snapshotter
    finally:
        snapshotter.close()
        channel.close()
        memory.close()


def _save(snapshotter: Snapshotter, step: int) -> None:
    snapshotter.save(step, {"w": torch.full((256,), float(step))}, {"step": step})
    snapshotter.flush()


def _held(memory: NodeMemoryTier) -> list[int]:
    return sorted(int(c["step"]) for c in memory.describe(0)["committed"].values())


def test_with_replicas_the_worker_writes_a_ring_of_three(ring: tuple[NodeMemoryTier, Snapshotter]) -> None:
    memory, snapshotter = ring
    assert len(snapshotter.slots) == REPLICATED_SLOTS  # told by the agent at attach
    for step in range(1, 6):
        _save(snapshotter, step)
    assert _held(memory) == [3, 4, 5]
    assert sorted(step for step, _ in snapshotter.held.values()) == [3, 4, 5]


def test_a_node_without_room_for_the_third_slot_falls_back_to_two_and_training_goes_on(
    ring: tuple[NodeMemoryTier, Snapshotter], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    memory, snapshotter = ring
    _save(snapshotter, 1)
    _save(snapshotter, 2)  # slots 0 and 1 exist; then host memory runs short
    monkeypatch.setattr(memory_module.psutil, "virtual_memory", lambda: SimpleNamespace(available=64))
    with caplog.at_level(logging.WARNING, logger="resilrun.tiers.memory"):
        _save(snapshotter, 3)  # wanted the third slot: refused, so it goes where step 1 was
    assert "rank 0 keeps two snapshots in node memory, not three" in caplog.text
    assert len(snapshotter.slots) == len(memory.rank(0).slots) == 2
    assert _held(memory) == [2, 3]
    _save(snapshotter, 4)
    assert _held(memory) == [3, 4]
    tensors, values = snapshotter.load(4)
    assert values == {"step": 4} and torch.equal(tensors["w"], torch.full((256,), 4.0))
