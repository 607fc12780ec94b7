"""How a failed job ends: the error (and so the exit code) says the state was refused or lost when
any rank of the last round said so, even when the first failure on record is another account of it.

Seen in CI (test_persistent_restore's forged step): rank 1 found step 19 forged, wrote its error
file and was on its way out with the "state refused" code when rank 0, told by rank 1's refusal,
exited with that code first; the agent then stopped rank 1 with SIGTERM. The earliest failure was
rank 1's (its error file's time), recorded with the signal, so the job ended as a plain failure
(exit 1) instead of a refused checkpoint (exit 4). No process runs: failures go straight into the
round's ledger in a memory store and the job's close is followed as any node follows it.
"""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

import pytest

from resilrun.agent.workers.failures import FailureLedger, ProcessFailure, ending_cause
from resilrun.env import STATE_LOST_EXIT_CODE, STATE_REFUSED_EXIT_CODE
from resilrun.errors import StateLostError, StateRefusedError, WorkerGroupFailed
from resilrun.rendezvous.memory import MemoryBackend
from tests.unit.test_exit_barrier import RUN, FakeClock, PollBudget, make_config, start_round, supervisor


def failure(rank: int, code: int, at: float, message: str) -> ProcessFailure:
    return ProcessFailure(
        global_rank=rank, local_rank=rank, node_rank=0, host="vm", pid=100 + rank, exit_code=code, timestamp=at,
        message=message,
    )  # fmt: skip


REFUSED_THEN_STOPPED = [
    failure(1, -int(signal.SIGTERM), 10.0, "StateRefusedError: rank 1's file is not authentic"),
    failure(0, STATE_REFUSED_EXIT_CODE, 10.1, "StateRefusedError: another rank's copy of step 19 was refused"),
]


def test_the_job_ends_refused_when_a_rank_refused_the_state_after_the_first_failure_on_record() -> None:
    assert ending_cause(REFUSED_THEN_STOPPED) == REFUSED_THEN_STOPPED[1]


def test_an_ordinary_failure_ends_the_job_as_the_first_failure_on_record() -> None:
    crashed = [failure(1, 3, 10.0, "exited with code 3"), failure(0, -int(signal.SIGTERM), 10.2, "Signal 15")]
    assert ending_cause(crashed) == crashed[0]
    assert ending_cause([]) is None


def test_of_a_lost_and_a_refused_state_the_earlier_says_how_the_job_ends() -> None:
    both = [failure(0, STATE_LOST_EXIT_CODE, 10.3, "lost"), failure(1, STATE_REFUSED_EXIT_CODE, 10.2, "refused")]
    assert ending_cause(both) == both[1]


@pytest.mark.parametrize(
    ("failures", "error"),
    [
        (REFUSED_THEN_STOPPED, StateRefusedError),
        ([failure(1, -int(signal.SIGTERM), 10.0, "Signal 15"), failure(0, STATE_LOST_EXIT_CODE, 10.1, "lost")],
         StateLostError),
        ([failure(1, 3, 10.0, "exited with code 3")], WorkerGroupFailed),
    ],
    ids=["refused", "lost", "failed"],
)  # fmt: skip
def test_following_the_failed_close_raises_what_ended_the_job(
    tmp_path: Path, failures: list[ProcessFailure], error: type[Exception]
) -> None:
    backend = MemoryBackend()
    state = start_round(backend, ["a"])
    FailureLedger(backend, RUN).record(state.round, failures)
    closed = dataclasses.replace(state, closed=True, outcome="failed")
    node = supervisor(backend, "a", FakeClock(), make_config(max_restarts=0), PollBudget(10), tmp_path)
    with pytest.raises(error):
        node.restarts.follow_close(closed)
