"""policy.decide, one test per row of the module's priority table (first match wins)."""

from __future__ import annotations

import signal

import pytest

from resilrun.agent.supervision.policy import Action, AgentView, decide
from resilrun.rendezvous.protocol import NodeInfo, RdzvState

A = NodeInfo(node_id="a", addr="a", local_world_size=2)
B = NodeInfo(node_id="b", addr="b", local_world_size=2)
RUNNING = RdzvState(round=1, complete=True, participants=(A, B))


def view(
    codes: tuple[int | None, ...], state: RdzvState = RUNNING, *, round: int = 1, sig: int | None = None
) -> AgentView:
    return AgentView(round=round, exit_codes=codes, state=state, shutdown_signal=sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_decide_shuts_down_on_a_signal_before_anything_else(sig: int) -> None:
    closed_newer_failed = RdzvState(round=2, closed=True, outcome="failed", waiting=("c",))
    assert decide(view((1, 0), closed_newer_failed, sig=sig)) is Action.SHUTDOWN
    assert decide(view((None,), sig=sig)) is Action.SHUTDOWN


def test_decide_follows_a_closed_job_before_a_newer_round_or_local_exits() -> None:
    state = RdzvState(round=2, closed=True, outcome="succeeded")
    assert decide(view((1, 0), state)) is Action.CLOSED
    assert decide(view((0, 0), state)) is Action.CLOSED


def test_decide_rejoins_when_another_node_opened_a_newer_round_even_if_a_worker_failed() -> None:
    newer = RdzvState(round=2)
    assert decide(view((None, None), newer)) is Action.REJOIN
    assert decide(view((-9, 0), newer)) is Action.REJOIN
    assert decide(view((0, 0), newer)) is Action.REJOIN


@pytest.mark.parametrize("codes", [(1, None), (None, -9), (0, 3), (0, -15), (2,)])
def test_decide_restarts_the_job_when_a_local_worker_exited_non_zero_or_by_signal(
    codes: tuple[int | None, ...],
) -> None:
    assert decide(view(codes)) is Action.RESTART_JOB


def test_decide_restarts_rather_than_opening_a_round_for_a_waiting_node() -> None:
    state = RdzvState(round=1, complete=True, participants=(A,), waiting=("b",))
    assert decide(view((1,), state)) is Action.RESTART_JOB


def test_decide_finishes_when_every_local_worker_exited_zero() -> None:
    assert decide(view((0, 0))) is Action.FINISH


def test_decide_finishes_rather_than_opening_a_round_for_a_waiting_node() -> None:
    state = RdzvState(round=1, complete=True, participants=(A,), waiting=("b",))
    assert decide(view((0,), state)) is Action.FINISH


def test_decide_opens_a_round_when_a_node_waits_to_join_a_complete_round() -> None:
    state = RdzvState(round=1, complete=True, participants=(A,), waiting=("b",))
    assert decide(view((None, 0), state)) is Action.OPEN_ROUND


@pytest.mark.parametrize("codes", [(None, None), (0, None), ()], ids=["running", "partly-done", "no-workers"])
def test_decide_waits_otherwise(codes: tuple[int | None, ...]) -> None:
    assert decide(view(codes)) is Action.WAIT


def test_decide_waits_for_an_incomplete_round_with_waiting_nodes() -> None:
    state = RdzvState(round=1, complete=False, participants=(A,), waiting=("b",))
    assert decide(view((None,), state)) is Action.WAIT
