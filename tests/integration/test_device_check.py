"""A spare is checked before it takes a rank (issue 48, health check): its device, and its first
collective with the others; one that fails is reported and skipped, and the next spare takes the
rank in-process; the result is bitwise a failure-free run's. The failures are injected
(``unhealthy:rank=1,round=1``: the device of the process that joins rank 1 in generation 1 does not
answer; ``isolated:...``: that process never completes its first collective), as no device or link
here can be broken."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import assert_nothing_left, clean_checksum, events, resumed
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration

ARGS = ["--steps", "30", "--hidden", "64", "--sleep", "0.05"]


@pytest.mark.parametrize(
    ("fault", "env", "check", "reason"),
    [
        # the first spare to take rank 1 finds its device not answering
        ("unhealthy", {}, "device", "injected: the device did not answer (unhealthy:rank=1,round=1)"),
        # it never completes its first collective with rank 0 (its links are down), within 3 s
        (
            "isolated",
            {"RESILRUN_PEER_CHECK_S": "3"},
            "collective",
            "its first collective with the other ranks did not complete within 3 s",
        ),
    ],
    ids=["device", "collective"],
)
def test_a_spare_that_fails_its_check_is_skipped_and_the_next_one_takes_the_rank(
    launcher, tmp_path: Path, fault: str, env: dict[str, str], check: str, reason: str
) -> None:
    # Given 2 workers and 2 hot spares; rank 1 is killed at step 8, and the first spare to take
    # rank 1 fails its check
    target = tmp_path / "faulty.sha"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "2", "--max-restarts", "0",
        str(EXAMPLE), *ARGS, "--checksum-file", str(target),
        env={"RESILRUN_FAULTS": f"kill:rank=1,step=8;{fault}:rank=1,round=1", **env},
    )  # fmt: skip
    assert run.wait(180) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)
    # Then the failure is reported, with its reason, for the spare given rank 1 in generation 1
    (sick,) = events(run, kind="device_unhealthy")
    assert (sick["rank"], sick["round"], sick["device"], sick["check"]) == (1, 1, "cpu", check)
    assert sick["reason"] == reason
    # and the next spare took rank 1 in generation 2 while rank 0 stayed in its process: no
    # restart, nothing lost, the result a failure-free run's
    promoted = events(run, kind="spare_promoted")
    assert [(p["rank"], p["round"]) for p in promoted] == [(1, 1), (1, 2)]
    assert promoted[0]["spare_pid"] == sick["pid"] != promoted[1]["spare_pid"]
    assert events(run, kind="restart") == []
    assert resumed(run) == dict.fromkeys(range(2), (7, "memory"))
    assert target.read_text() == clean_checksum(launcher, tmp_path, 2, *ARGS)
