"""A spare's device is checked before it takes a rank (issue 48, health check): one that fails is
reported and skipped, and the next spare takes the rank in-process; the result is bitwise a
failure-free run's. The failure is injected (``unhealthy:rank=1,round=1``: the device of the
process that joins rank 1 in generation 1 does not answer), as no device here can be broken."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import assert_nothing_left, clean_checksum, events, resumed
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration

ARGS = ["--steps", "30", "--hidden", "64", "--sleep", "0.05"]


def test_a_spare_whose_device_fails_its_check_is_skipped_and_the_next_one_takes_the_rank(
    launcher, tmp_path: Path
) -> None:
    # Given 2 workers and 2 hot spares; rank 1 is killed at step 8, and the first spare to take
    # rank 1 finds its device not answering
    target = tmp_path / "faulty.sha"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "2", "--max-restarts", "0",
        str(EXAMPLE), *ARGS, "--checksum-file", str(target),
        env={"RESILRUN_FAULTS": "kill:rank=1,step=8;unhealthy:rank=1,round=1"},
    )  # fmt: skip
    assert run.wait(180) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)
    # Then the check's failure is reported, with its reason, for the spare given rank 1 in generation 1
    (sick,) = events(run, kind="device_unhealthy")
    assert (sick["rank"], sick["round"], sick["device"]) == (1, 1, "cpu")
    assert sick["reason"].startswith("injected: the device did not answer")
    # and the next spare took rank 1 in generation 2, in-process: no restart, nothing lost
    promoted = events(run, kind="spare_promoted")
    assert [(p["rank"], p["round"]) for p in promoted] == [(1, 1), (1, 2)]
    assert promoted[0]["spare_pid"] == sick["pid"] != promoted[1]["spare_pid"]
    assert events(run, kind="restart") == []
    assert resumed(run) == dict.fromkeys(range(2), (7, "memory"))
    assert target.read_text() == clean_checksum(launcher, tmp_path, 2, *ARGS)
