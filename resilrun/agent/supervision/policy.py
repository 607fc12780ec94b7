"""Pure supervision policy: what the agent does next, from what it observed.

Priority (first match wins), so a shutdown request beats everything and a job-wide decision made
by another node beats a local observation:

| observation                                   | action        |
|-----------------------------------------------|---------------|
| SIGTERM/SIGINT received                       | SHUTDOWN      |
| the job is closed                             | CLOSED        |
| a newer generation of the same nodes (recovery)| FOLLOW_RECOVERY |
| another node opened a newer round             | REJOIN        |
| another node's heartbeat went stale           | NODE_LOST     |
| a local worker exited non-zero or by a signal | RESTART_JOB   |
| every local worker exited 0                   | FINISH        |
| a node waits to join and the round has room   | OPEN_ROUND    |
| otherwise                                     | WAIT          |
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from resilrun.agent.workers.procs import WorkerState
from resilrun.rendezvous.protocol import RdzvState


class Action(Enum):
    WAIT = "wait"
    SHUTDOWN = "shutdown"
    CLOSED = "closed"
    REJOIN = "rejoin"
    FOLLOW_RECOVERY = "follow_recovery"
    NODE_LOST = "node_lost"
    RESTART_JOB = "restart_job"
    FINISH = "finish"
    OPEN_ROUND = "open_round"


@dataclass(frozen=True, slots=True)
class AgentView:
    """An immutable snapshot of what the agent saw in one monitor tick."""

    round: int
    exit_codes: tuple[int | None, ...]
    state: RdzvState
    shutdown_signal: int | None = None
    lost_nodes: tuple[str, ...] = ()
    # The newer round is an in-process recovery this node can join without restarting its workers.
    can_follow_recovery: bool = False


def decide(view: AgentView) -> Action:
    """See the module table."""
    if view.shutdown_signal is not None:
        return Action.SHUTDOWN
    if view.state.closed:
        return Action.CLOSED
    if view.state.round != view.round:
        return Action.FOLLOW_RECOVERY if view.can_follow_recovery else Action.REJOIN
    if view.lost_nodes:
        return Action.NODE_LOST
    states = [WorkerState.of(code) for code in view.exit_codes]
    if any(state.ended and state is not WorkerState.SUCCEEDED for state in states):
        return Action.RESTART_JOB
    if states and all(state is WorkerState.SUCCEEDED for state in states):
        return Action.FINISH
    if view.state.complete and view.state.waiting:
        return Action.OPEN_ROUND
    return Action.WAIT
