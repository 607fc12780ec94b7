"""Survivor or failure? The agent's verdict on a worker whose script raised, from what the job knows."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from resilrun import keys
from resilrun.agent.control import WorkerControl
from resilrun.agent.inprocess import RAISED_GRACE_S, InProcessRecovery
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import NodeInfo, RdzvState

RUN = "judge"
ME, OTHER = NodeInfo("me", "127.0.0.1", 2), NodeInfo("other", "127.0.0.1", 2)
INTERVAL_S = 0.02
STATE = RdzvState(round=2, complete=True, participants=(ME, OTHER))


class _Agent(InProcessRecovery):
    """Just what ``_judge_raised`` reads: the control, the store, this node, the heartbeat interval."""

    def __init__(self, backend: MemoryBackend) -> None:
        self.control = WorkerControl()
        self.rdzv = SimpleNamespace(backend=backend, me=ME)  # type: ignore[assignment]
        self.run_id = RUN
        self.config = SimpleNamespace(heartbeat_interval_s=INTERVAL_S)  # type: ignore[assignment]
        self.raised_probe = None


@pytest.fixture
def agent() -> _Agent:
    agent = _Agent(MemoryBackend())
    # rank 0 (pid 100) raised in round 2 and waits; rank 1 (pid 101) still runs
    agent.control._raised[100] = (2, time.monotonic())
    return agent


def _round() -> Any:
    workers = [SimpleNamespace(pid=100 + rank, spec=SimpleNamespace(global_rank=rank)) for rank in (0, 1)]
    return SimpleNamespace(state=STATE, workers=workers)


def _ticks(agent: _Agent, codes: tuple[int | None, ...] = (None, None), beat: bool = True) -> None:
    """Supervisor ticks over more than the grace; the other node's agent heartbeats unless ``beat`` is off."""
    deadline = time.monotonic() + RAISED_GRACE_S + 2 * INTERVAL_S + 0.05
    while time.monotonic() < deadline:
        if beat:
            agent.rdzv.backend.add(keys.node_heartbeat(RUN, OTHER.node_id), 1)
        agent._judge_raised(_round(), codes, STATE)
        time.sleep(INTERVAL_S / 2)


def test_nothing_failed_before_it_so_its_own_error_is_the_failure(agent: _Agent) -> None:
    _ticks(agent)
    assert 100 in agent.control._dismissed


def test_a_failure_recorded_by_any_agent_makes_it_a_survivor(agent: _Agent) -> None:
    agent.rdzv.backend.add(keys.round_failure_count(RUN, 2), 1)
    _ticks(agent)
    assert not agent.control._dismissed


def test_a_local_peer_that_exited_makes_it_a_survivor(agent: _Agent) -> None:
    _ticks(agent, codes=(None, -9))
    assert not agent.control._dismissed


def test_a_node_that_stopped_heartbeating_may_be_lost_so_it_keeps_waiting(agent: _Agent) -> None:
    _ticks(agent, beat=False)
    assert not agent.control._dismissed


def test_a_round_that_moved_on_makes_it_a_survivor(agent: _Agent) -> None:
    deadline = time.monotonic() + RAISED_GRACE_S + 0.1
    while time.monotonic() < deadline:
        agent.rdzv.backend.add(keys.node_heartbeat(RUN, OTHER.node_id), 1)
        agent._judge_raised(_round(), (None, None), RdzvState(round=3, complete=True, recovering=True))
        time.sleep(INTERVAL_S / 2)
    assert not agent.control._dismissed
