"""A rank's state in the status document, from what its agent knows (docs/status.md, ranks[].state)."""

from __future__ import annotations

import pytest

from resilrun.agent.status import RankState


@pytest.mark.parametrize(
    ("exit_code", "silent_s", "stepped", "expected"),
    [
        (None, None, False, RankState.STARTING),
        (None, None, True, RankState.RUNNING),
        (None, 1.0, False, RankState.RUNNING),
        (None, 5.0, True, RankState.UNRESPONSIVE),
        (0, 9.0, True, RankState.FINISHED),
        (-9, None, False, RankState.FAILED),
        (1, 0.1, True, RankState.FAILED),
    ],
)
def test_a_ranks_state_comes_from_its_exit_its_heartbeat_and_its_progress(
    exit_code: int | None, silent_s: float | None, stepped: bool, expected: RankState
) -> None:
    assert RankState.of(exit_code, silent_s, timeout_s=3.0, stepped=stepped) is expected
