"""A worker's exit read for its meaning in one place (agent/workers/procs.py WorkerState)."""

from __future__ import annotations

import pytest

from resilrun.agent.workers.procs import WorkerState
from resilrun.env import STATE_LOST_EXIT_CODE, STATE_REFUSED_EXIT_CODE


@pytest.mark.parametrize(
    ("code", "state"),
    [
        (None, WorkerState.RUNNING),
        (0, WorkerState.SUCCEEDED),
        (1, WorkerState.FAILED),
        (-9, WorkerState.FAILED),  # SIGKILL
        (STATE_LOST_EXIT_CODE, WorkerState.STATE_LOST),
        (STATE_REFUSED_EXIT_CODE, WorkerState.STATE_REFUSED),
    ],
)
def test_each_exit_is_one_state_and_only_running_has_not_ended(code: int | None, state: WorkerState) -> None:
    assert WorkerState.of(code) is state
    assert state.ended is (code is not None)
