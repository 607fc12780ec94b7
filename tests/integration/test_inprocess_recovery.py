"""Checkpointless recovery: a hot spare takes the failed rank, survivors keep their processes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.conftest import assert_nothing_left
from tests.integration.test_tier1_restore import ARGS, EXAMPLE, _clean_checksum

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("spares", "replacement"),
    [
        ("1", "hot spare takes over"),
        # No spare: a new process is started for the rank while the survivor waits in its own.
        ("0", "no warm spare for 1 failed rank(s): starting a new worker process"),
    ],
    ids=["hot-spare", "new-process"],
)
def test_sigkilled_worker_is_replaced_in_process_and_the_survivor_keeps_its_process(
    launcher, tmp_path: Path, spares: str, replacement: str
) -> None:
    # Given 2 workers, no restart allowed; rank 1 is SIGKILLed at step 12
    target = tmp_path / "faulty.sha"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", spares, "--max-restarts", "0",
        str(EXAMPLE), *ARGS, "--checksum-file", str(target), env={"RESILRUN_FAULTS": "kill:rank=1,step=12"},
    )  # fmt: skip
    assert run.wait(150) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)
    err = run.stderr()
    # Then rank 1 was replaced without a restart, rank 0 recovered in its own process,
    assert replacement in err
    assert "rank 0 recovering in-process into generation 1" in err
    assert "restarting the job" not in err
    # and both resumed from step 11: no step redone beyond the one in flight
    assert "rank 0 resumed from step 11 (node memory)" in err
    assert "rank 1 resumed from step 11 (node memory)" in err
    assert target.read_text() == _clean_checksum(launcher, tmp_path, 2)


def test_two_nodes_recover_in_process_from_a_worker_failure_on_the_other_node(launcher, tmp_path: Path) -> None:
    # Given 2 nodes x 2 workers, one spare per node; rank 3 exits with code 9 at step 9
    port = free_port()
    target = tmp_path / "faulty.sha"
    flags = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--spares", "1"]
    nodes = [
        launcher("resilrun", *flags, str(EXAMPLE), *ARGS, "--checksum-file", str(target),
                 env={"RESILRUN_FAULTS": "exit:rank=3,step=9,code=9"})
        for _ in range(2)
    ]  # fmt: skip
    for node in nodes:
        assert node.wait(150) == 0, node.stderr()[-3000:]
        assert_nothing_left(node)
    err = nodes[0].stderr() + nodes[1].stderr()
    # Then every survivor on both nodes recovered in-process and all resumed from step 8
    for rank in (0, 1, 2):
        assert f"rank {rank} recovering in-process" in err
    for rank in range(4):
        assert f"rank {rank} resumed from step 8 (node memory)" in err
    assert "restarting the job" not in err
    assert target.read_text() == _clean_checksum(launcher, tmp_path, 4)


def test_two_successive_failures_and_a_failure_in_the_first_step(launcher, tmp_path: Path) -> None:
    # Given two spares: rank 0 dies in the very first step, then rank 1 dies at step 15 of the next generation
    target = tmp_path / "faulty.sha"
    plan = "kill:rank=0,step=0,attempt=0; exit:rank=1,step=15,attempt=1,code=4"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "2",
        str(EXAMPLE), *ARGS, "--checksum-file", str(target), env={"RESILRUN_FAULTS": plan},
    )  # fmt: skip
    assert run.wait(180) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)
    err = run.stderr()
    assert err.count("hot spare takes over") == 2
    assert "rank 0 resumed from step 14 (node memory)" in err
    assert target.read_text() == _clean_checksum(launcher, tmp_path, 2)


def test_a_frozen_worker_is_detected_killed_and_replaced_by_a_spare(launcher, tmp_path: Path) -> None:
    # Given rank 1 SIGSTOPs itself at step 12 (a hang: the process exists but runs nothing)
    target = tmp_path / "faulty.sha"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "1", "--heartbeat-timeout", "5",
        str(EXAMPLE), *ARGS, "--checksum-file", str(target), env={"RESILRUN_FAULTS": "hang:rank=1,step=12"},
    )  # fmt: skip
    # Then the agent sees its heartbeat stop, kills it, and a spare takes over; no orphan is left
    assert run.wait(150) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)
    err = run.stderr()
    assert "rank 1 hung: no heartbeat" in err
    assert "hot spare takes over" in err
    assert "rank 0 resumed from step 11 (node memory)" in err
    assert target.read_text() == _clean_checksum(launcher, tmp_path, 2)


def test_a_failure_that_repeats_at_the_same_step_is_not_recovered_forever(launcher, tmp_path: Path) -> None:
    # Given a bug that kills rank 1 at step 5 every time, and spares that would replace it each time
    script = Path(__file__).resolve().parents[1] / "helpers" / "buggy_step.py"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "0", str(script)
    )
    # Then one in-process recovery is tried, the repeat is recognised, and the job fails cleanly, and
    # quickly: a rank's own exception ends its process at once (only a broken collective waits for
    # the next generation, up to --heartbeat-timeout + 40 s, which would show here as 90 s)
    started = time.monotonic()
    assert run.wait(150) == 1, run.stderr()[-3000:]
    assert time.monotonic() - started < 60
    err = run.stderr()
    assert err.count("hot spare takes over") == 1
    assert "no progress since the last in-process recovery" in err
    assert "ValueError: bad batch at step 5" in err


def test_a_failure_during_a_recovery_is_recovered_too(launcher, tmp_path: Path) -> None:
    # Given rank 1 SIGKILLed at step 12, and rank 0 SIGKILLed while it restores in the recovery
    # that follows (attempt 1): a second, independent failure in the middle of the first recovery
    target = tmp_path / "faulty.sha"
    plan = "kill:rank=1,step=12; kill:rank=0,step=restore,attempt=1"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "2", "--max-restarts", "0",
        str(EXAMPLE), *ARGS, "--checksum-file", str(target), env={"RESILRUN_FAULTS": plan},
    )  # fmt: skip
    # Then both are replaced by spares in-process (no restart allowed), resuming at step 11
    assert run.wait(180) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)
    err = run.stderr()
    assert err.count("hot spare takes over") == 2
    assert "restarting the job" not in err
    assert "rank 0 resumed from step 11 (node memory)" in err
    assert target.read_text() == _clean_checksum(launcher, tmp_path, 2)


def test_a_worker_stuck_before_its_first_step_is_caught_by_the_first_step_timeout(launcher, tmp_path: Path) -> None:
    # Given rank 1 deadlocks at the start of step 0 (its heartbeats go on: only a step timeout sees it).
    # Rank 0 then waits in a collective for it, so it makes no step either, and the agent cannot
    # tell which of the two is stuck: both are replaced (two spares).
    target = tmp_path / "faulty.sha"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "2", "--first-step-timeout", "15",
        str(EXAMPLE), *ARGS, "--checksum-file", str(target), env={"RESILRUN_FAULTS": "stall:rank=1,step=0"},
    )  # fmt: skip
    # Then the first-step allowance runs out, the workers are killed and spares take over
    assert run.wait(150) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)
    err = run.stderr()
    assert "rank 0 hung: no first step after" in err
    assert "rank 1 hung: no first step after" in err
    assert err.count("hot spare takes over") == 1
    assert "restarting the job" not in err
    assert target.read_text() == _clean_checksum(launcher, tmp_path, 2)


def test_failures_alternating_between_ranks_at_one_step_exhaust_the_in_process_budget(
    launcher, tmp_path: Path
) -> None:
    # Given ranks 0 and 1 killed in turn as step 5 starts, in every incarnation, spares to replace each
    plan = "; ".join(f"kill:rank={attempt % 2},step=5,attempt={attempt}" for attempt in range(8))
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "2", "--max-restarts", "0",
        str(EXAMPLE), *ARGS, env={"RESILRUN_FAULTS": plan},
    )  # fmt: skip
    # Then the job is recovered in-process a bounded number of times, then takes the restart path
    # (none left: it fails) instead of recovering for as long as the failures go on
    assert run.wait(150) == 1, run.stderr()[-3000:]
    assert_nothing_left(run)
    err = run.stderr()
    assert "in-process recovery budget spent: 3 recoveries in a row without a newer step than 4" in err
    assert err.count("hot spare takes over") == 3, err[-3000:]
    assert "no restart left (--max-restarts 0)" in err
