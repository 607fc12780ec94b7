"""Survivor or failure? The agent's verdict on a worker whose script raised, from what the job knows.

Driven by a fake clock: each tick advances it, nothing sleeps.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from resilrun import keys
from resilrun.agent.supervision.worker_verdicts import RAISED_GRACE_S, RaisedVerdict
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.failures import FailureLedger
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import NodeInfo, RdzvState

RUN = "judge"
ME, OTHER = NodeInfo("me", "127.0.0.1", 2), NodeInfo("other", "127.0.0.1", 2)
INTERVAL_S = 0.02
STATE = RdzvState(round=2, complete=True, participants=(ME, OTHER))


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def verdict(clock: FakeClock) -> RaisedVerdict:
    backend = MemoryBackend()
    verdict = RaisedVerdict(WorkerControl(), FailureLedger(backend, RUN), backend, ME.node_id, INTERVAL_S, clock=clock)
    # rank 0 (pid 100) raised in round 2 and waits; rank 1 (pid 101) still runs
    verdict.control._raised[100] = (2, clock.now)
    return verdict


def _round(state: RdzvState = STATE) -> Any:
    workers = [SimpleNamespace(pid=100 + rank, spec=SimpleNamespace(global_rank=rank)) for rank in (0, 1)]
    return SimpleNamespace(state=state, workers=workers)


def _ticks(
    verdict: RaisedVerdict,
    clock: FakeClock,
    codes: tuple[int | None, ...] = (None, None),
    beat: bool = True,
    current: RdzvState = STATE,
    over_s: float = RAISED_GRACE_S + 2 * INTERVAL_S + 0.05,
) -> None:
    """Supervisor ticks over ``over_s`` of fake time; the other node's agent heartbeats unless ``beat`` is off."""
    end = clock.now + over_s
    while clock.now < end:
        if beat:
            verdict.backend.add(keys.node_heartbeat(RUN, OTHER.node_id), 1)
        verdict.judge(_round(), codes, current)
        clock.now += INTERVAL_S / 2


def test_nothing_failed_before_it_so_its_own_error_is_the_failure(verdict: RaisedVerdict, clock: FakeClock) -> None:
    _ticks(verdict, clock)
    assert 100 in verdict.control._dismissed


def test_the_verdict_waits_out_the_grace_first(verdict: RaisedVerdict, clock: FakeClock) -> None:
    _ticks(verdict, clock, over_s=RAISED_GRACE_S)  # less than the grace plus 1.5 heartbeat intervals
    assert not verdict.control._dismissed


def test_a_failure_recorded_by_any_agent_makes_it_a_survivor(verdict: RaisedVerdict, clock: FakeClock) -> None:
    verdict.backend.add(keys.round_failure_count(RUN, 2), 1)
    _ticks(verdict, clock)
    assert not verdict.control._dismissed


def test_a_local_peer_that_exited_makes_it_a_survivor(verdict: RaisedVerdict, clock: FakeClock) -> None:
    _ticks(verdict, clock, codes=(None, -9))
    assert not verdict.control._dismissed


def test_a_node_that_stopped_heartbeating_may_be_lost_so_it_keeps_waiting(
    verdict: RaisedVerdict, clock: FakeClock
) -> None:
    _ticks(verdict, clock, beat=False)
    assert not verdict.control._dismissed


def test_a_round_that_moved_on_makes_it_a_survivor(verdict: RaisedVerdict, clock: FakeClock) -> None:
    _ticks(verdict, clock, current=RdzvState(round=3, complete=True, recovering=True))
    assert not verdict.control._dismissed
