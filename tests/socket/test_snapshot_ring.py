"""A worker's Snapshotter and the agent's node memory agree on the ring of slots, also when the
node cannot hold the third slot a job with replicas asks for (then both fall back to two), and
when only some snapshots are replicated (then the ring keeps what a node loss resumes from)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from resilrun.agent.state.channel import AgentChannel
from resilrun.agent.state.tiers import NodeTiers
from resilrun.agent.workers.control import WorkerControl
from resilrun.env import SNAPSHOT_AUTO
from resilrun.tiers import memory as memory_module
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.slots import REPLICATED_SLOTS
from resilrun.worker.agent_client import AgentClient
from resilrun.worker.snapshot import Snapshotter


@contextlib.contextmanager
def _ring(replicate_every: int) -> Iterator[tuple[NodeMemoryTier, Snapshotter]]:
    memory = NodeMemoryTier("ring-contract", slots=REPLICATED_SLOTS, replicate_every=replicate_every)
    channel = AgentChannel(memory, NodeTiers(memory, None), WorkerControl())
    snapshotter = Snapshotter(AgentClient(channel.path, channel.token), rank=0)
    try:
        yield memory, snapshotter
    finally:
        snapshotter.close()
        channel.close()
        memory.close()


@pytest.fixture
def ring() -> Iterator[tuple[NodeMemoryTier, Snapshotter]]:
    """Every snapshot replicated (the default)."""
    with _ring(replicate_every=1) as ring:
        yield ring


def _save(snapshotter: Snapshotter, step: int, *, previous: int | None = None, replicate: bool | None = None) -> None:
    snapshotter.save(
        step, {"w": torch.full((256,), float(step))}, {"step": step}, previous=previous, replicate=replicate
    )
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


def _assert_holds_what_a_node_loss_resumes_from(memory: NodeMemoryTier, replicated: list[int], last: int) -> None:
    """A lost node's replicas of a rank are at its newest replicated step, or the one before while
    that push is in flight (until the next snapshot); the survivors' own replicas may have been on
    the lost node, so their node memory must hold that step."""
    held = _held(memory)
    assert last in held, held
    if replicated:
        assert replicated[-1] in held, (held, replicated)
    if len(replicated) > 1 and replicated[-1] == last:
        assert replicated[-2] in held, (held, replicated)
    for step in {last, *replicated[-2:]} & set(held):
        read = memory.read(0, step)
        assert read is not None and read[1] == {"step": step}, step


def test_with_replicas_every_5_steps_the_ring_keeps_the_newest_replicated_step() -> None:
    # Given a snapshot every step and replicas of steps 4, 9, 14, ... (--replicate-every 5)
    with _ring(replicate_every=5) as (memory, snapshotter):
        replicated: list[int] = []
        for step in range(23):
            # When each step is committed
            _save(snapshotter, step, previous=step - 1)
            if (step + 1) % 5 == 0:
                replicated.append(step)
            # Then node memory still holds the step a node loss would resume from
            _assert_holds_what_a_node_loss_resumes_from(memory, replicated, step)
        assert _held(memory) == [19, 21, 22]
        assert sorted(step for step, _ in snapshotter.held.values()) == [19, 21, 22]  # the worker agrees


def test_with_auto_replicas_the_ring_keeps_the_replicated_step_before_the_newest_while_its_push_may_lag() -> None:
    # Given snapshots every 6 steps and every third of them replicated (--replicate-every auto:
    # the workers say which), the schedule a CI run had when a host dropped mid-push of step 59
    with _ring(replicate_every=SNAPSHOT_AUTO) as (memory, snapshotter):
        steps = list(range(5, 66, 6))
        replicated: list[int] = []
        for index, step in enumerate(steps):
            replicate = index % 3 == 0
            _save(snapshotter, step, previous=steps[index - 1] if index else -1, replicate=replicate)
            if replicate:
                replicated.append(step)
            _assert_holds_what_a_node_loss_resumes_from(memory, replicated, step)
            if step == 59:
                # Then with step 59 just replicated, 41 (where the lost rank's replica may still be) is held
                assert _held(memory) == [41, 53, 59]
        assert _held(memory) == [41, 59, 65]  # 53 went: 59's push is done once a snapshot follows it


def test_after_a_rollback_the_abandoned_steps_keep_nothing_and_the_resumed_timeline_is_kept() -> None:
    # Given replicas every 5 steps, trained to step 14 (replicated: 4, 9 and 14)
    with _ring(replicate_every=5) as (memory, snapshotter):
        for step in range(15):
            _save(snapshotter, step, previous=step - 1)
        assert _held(memory) == [9, 13, 14]
        # When a recovery resumes from step 9 (14's replicas were lost, say) and the worker
        # snapshots 10 and 11 again
        _save(snapshotter, 10, previous=9)
        _save(snapshotter, 11, previous=10)
        # Then the ring keeps the resumed timeline's replicated step 9 and its newest steps, and
        # lets go of the abandoned 14, replicated though it was
        assert _held(memory) == [9, 10, 11]


def test_commits_whose_tensors_change_shape_or_number_or_whose_slots_are_mapped_again_load_back_exactly(
    ring: tuple[NodeMemoryTier, Snapshotter],
) -> None:
    # Given a rank whose state changes between commits (a tensor added, one grown past its slot,
    # then the first state again), with a parameter that requires grad among them
    memory, snapshotter = ring
    weight = torch.nn.Parameter(torch.arange(256, dtype=torch.float32))
    states = [
        {"w": weight},
        {"w": weight, "b": torch.arange(4, dtype=torch.int64)},
        {"w": torch.arange(4096, dtype=torch.float32), "s": torch.tensor(7, dtype=torch.int32)},
        {"w": weight},
        {"w": weight * 2},
    ]
    for step, state in enumerate(states, start=1):
        snapshotter.save(step, state, {"step": step})
        snapshotter.flush()
        # Then every step loads back as it was saved, whichever slot and layout it went to
        tensors, values = snapshotter.load(step)
        assert values == {"step": step}
        assert set(tensors) == set(state)
        for name, tensor in state.items():
            assert torch.equal(tensors[name], tensor.detach()), (step, name)
    # and after the slots are mapped again (as after a fetch from another tier) commits still land
    snapshotter.attach()
    snapshotter.save(6, {"w": weight}, {"step": 6})
    snapshotter.flush()
    tensors, _ = snapshotter.load(6)
    assert torch.equal(tensors["w"], weight.detach())


def test_commits_of_state_changed_in_place_reuse_their_slots_and_load_back_as_each_step_was(
    ring: tuple[NodeMemoryTier, Snapshotter],
) -> None:
    # Given one state trained in place (as an optimizer does) and committed more times than the ring
    # has slots, so that every slot is written again with the layout it held
    memory, snapshotter = ring
    weight = torch.nn.Parameter(torch.zeros(64))
    moment = torch.zeros(8, 8, dtype=torch.float64)
    count = torch.tensor(0, dtype=torch.int64)
    for step in range(1, 3 * REPLICATED_SLOTS + 2):
        with torch.no_grad():
            weight.add_(1.5)
        moment.mul_(0.5).add_(step)
        count.add_(1)
        snapshotter.save(step, {"w": weight, "m": moment, "c": count}, {"step": step})
        snapshotter.flush()
        # Then each step loads back with that step's values, not an earlier step's left in the slot
        tensors, values = snapshotter.load(step)
        assert values == {"step": step}
        assert torch.equal(tensors["w"], weight.detach())
        assert torch.equal(tensors["m"], moment)
        assert int(tensors["c"]) == step
