"""Checkpointless recovery: a hot spare takes the failed rank, survivors keep their processes.

What each recovery did is read from the agents' events (events.jsonl, docs/status.md): which spare
took which rank, which generation each survivor entered in its own process, the step and tier each
rank resumed from, and that no restart happened. Log lines are asserted only where they are the
product (the error a user reads).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.conftest import assert_nothing_left, clean_checksum, events, resumed, wait_for
from tests.integration.test_tier1_restore import ARGS, EXAMPLE, _clean_checksum

pytestmark = pytest.mark.integration


def promoted(*launches, warm: bool | None = None) -> list[int]:  # noqa: ANN002 - Launch objects
    """The ranks a spare process took, in order (``warm``: only hot spares, or only new processes)."""
    found = events(*launches, kind="spare_promoted")
    return [e["rank"] for e in found if "rank" in e and (warm is None or e["warm"] is warm)]


def survivors_kept_their_process(launch, rank: int, generation: int) -> bool:  # noqa: ANN001 - a Launch
    """Rank ``rank`` entered ``generation`` in the process that started it in round 0."""
    started = events(launch, kind="round_started", round=0)[0]
    pid = started["pids"][started["ranks"].index(rank)]
    entered = events(launch, kind="generation_entered", round=generation)
    return bool(entered) and pid in entered[0]["pids"]


@pytest.mark.parametrize(
    ("spares", "warm"),
    [
        ("1", True),
        # No spare: a new process is started for the rank while the survivor waits in its own.
        ("0", False),
    ],
    ids=["hot-spare", "new-process"],
)
def test_sigkilled_worker_is_replaced_in_process_and_the_survivor_keeps_its_process(
    launcher, tmp_path: Path, spares: str, warm: bool
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
    assert promoted(run, warm=warm) == [1]
    assert survivors_kept_their_process(run, rank=0, generation=1)
    assert events(run, kind="restart") == []
    # and both resumed from step 11: no step redone beyond the one in flight
    assert resumed(run) == {0: (11, "memory"), 1: (11, "memory")}
    assert "rank 0 recovering in-process into generation 1" in err  # what the user reads in the log
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
    # Then every survivor on both nodes recovered in-process and all resumed from step 8
    assert promoted(*nodes, warm=True) == [3]
    first, second = sorted(nodes, key=lambda n: events(n, kind="round_started")[0]["ranks"])
    assert survivors_kept_their_process(first, 0, 1) and survivors_kept_their_process(first, 1, 1)
    assert survivors_kept_their_process(second, 2, 1)
    assert resumed(*nodes) == dict.fromkeys(range(4), (8, "memory"))
    assert events(*nodes, kind="restart") == []
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
    assert promoted(run, warm=True) == [0, 1]
    assert resumed(run)[0] == (14, "memory")
    assert events(run, kind="restart") == []
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
    hung = events(run, kind="hang_detected")
    assert [h["rank"] for h in hung] == [1] and hung[0]["reason"].startswith("no heartbeat")
    assert promoted(run, warm=True) == [1]
    assert resumed(run)[0] == (11, "memory")
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
    assert promoted(run) == [1]  # one recovery, then the repeat took the restart path (none left)
    assert events(run, kind="exit")[-1]["outcome"] == "failed"
    assert "ValueError: bad batch at step 5" in run.stderr()  # the root cause the user reads
    # and the agent read it from the spare's error file in generation 1's folder (made when the
    # spare took the rank: without it the report said "no error file", and torch's @record, which
    # writes that file itself, raised FileNotFoundError over the script's own exception)
    second = [e for e in events(run, kind="failure_detected") if e.get("round") == 1]
    assert [e["message"] for e in second] == ["ValueError: bad batch at step 5"], second


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
    assert sorted(promoted(run, warm=True)) == [0, 1]
    assert events(run, kind="restart") == []
    assert resumed(run)[0] == (11, "memory")
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
    hung = events(run, kind="hang_detected")
    assert sorted(h["rank"] for h in hung) == [0, 1]
    assert all(h["reason"].startswith("no first step after") for h in hung)
    assert len(events(run, kind="generation_entered")) == 1  # both replaced in one recovery
    assert events(run, kind="restart") == []
    assert target.read_text() == _clean_checksum(launcher, tmp_path, 2)


def test_failures_alternating_between_ranks_at_one_step_exhaust_the_in_process_budget(launcher, tmp_path: Path) -> None:
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
    assert len(promoted(run)) == 3, err[-3000:]  # MAX_RECOVERIES_WITHOUT_PROGRESS
    assert events(run, kind="exit")[-1]["outcome"] == "failed"
    assert "no restart left (--max-restarts 0)" in err  # the error the user reads


def test_the_children_a_killed_worker_leaves_behind_end_with_it(launcher, tmp_path: Path) -> None:
    # Given 2 workers that each start a helper process that does not watch its parent, and a hot spare
    script = Path(__file__).resolve().parents[1] / "helpers" / "with_helper_process.py"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "0",
        str(script), "--out", str(tmp_path), env={"RESILRUN_FAULTS": "kill:rank=1,step=5"},
    )  # fmt: skip
    # When rank 1 is SIGKILLed at step 5 and the spare takes its place
    # (deadlines: the whole test takes about 12 s alone on 2 cores)
    wait_for(lambda: events(run, kind="spare_promoted", rank=1), 60, "the spare to take rank 1's place")
    killed = events(run, kind="round_started", round=0)[0]
    dead_pid = killed["pids"][killed["ranks"].index(1)]
    orphan = int((tmp_path / f"helper_{dead_pid}").read_text())
    # Then its helper is ended by the agent at once, while the job goes on (not left to run for the
    # job's lifetime and beyond, reparented to init)
    wait_for(lambda: not _running(orphan), 3, f"the dead worker's helper {orphan} to end")
    assert run.popen.poll() is None  # the job was still running: the helper was ended by the recovery
    assert run.wait(60) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for whoever adopted it to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_with_a_snapshot_every_4_steps_a_failure_redoes_the_steps_since_the_last_one_bitwise(
    launcher, tmp_path: Path
) -> None:
    # Given snapshots of steps 3, 7, 11, ... only, and rank 1 SIGKILLed as step 10 starts
    target = tmp_path / "faulty.sha"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "0",
        "--snapshot-every", "4", str(EXAMPLE), *ARGS, "--checksum-file", str(target),
        env={"RESILRUN_FAULTS": "kill:rank=1,step=10"},
    )  # fmt: skip
    assert run.wait(150) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)
    # Then both ranks resumed from step 7, the newest snapshot (steps 8 and 9 are redone), in-process,
    assert resumed(run) == {0: (7, "memory"), 1: (7, "memory")}
    assert events(run, kind="restart") == []
    # and the recovery says so: 2 steps redone (the newest finished step, 9, not the newest snapshot)
    assert [e["steps_redone"] for e in events(run, kind="recovered")] == [2]
    # and the redone steps are the same steps: bitwise the failure-free run's result
    assert target.read_text() == _clean_checksum(launcher, tmp_path, 2)


# State large next to its step time: a snapshot costs far more than 1% of a step, so auto spaces them.
AUTO_ARGS = ["--steps", "70", "--hidden", "64", "--state-mib", "16", "--sleep", "0.03"]


def test_with_snapshot_every_auto_a_failure_redoes_the_steps_at_risk_bitwise(launcher, tmp_path: Path) -> None:
    # Given --snapshot-every auto under a 1% budget and rank 1 SIGKILLed as step 50 starts (after
    # the first decision, at step 46: 3 warm-up snapshots, then a window of 24+ steps)
    target = tmp_path / "faulty.sha"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "0",
        "--snapshot-every", "auto", "--max-overhead", "1", str(EXAMPLE), *AUTO_ARGS, "--checksum-file", str(target),
        env={"RESILRUN_FAULTS": "kill:rank=1,step=50"},
    )  # fmt: skip
    assert run.wait(150) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)
    # Then the ranks agreed an interval longer than one step, measured, under the budget
    decided = events(run, kind="snapshot_interval")
    assert decided and decided[0]["step"] < 50, decided
    first = decided[0]
    assert first["interval"] > 1 and first["overhead"] <= 0.01 and first["snapshot_cost_s"] > 0, first
    # and both ranks resumed in-process from the same snapshot, the newest before the failure:
    # at most one interval back
    restored = {step for step, _ in resumed(run).values()}
    assert len(restored) == 1 and set(resumed(run)) == {0, 1}
    (step,) = restored
    assert 49 - first["interval"] <= step <= 49 and events(run, kind="restart") == []
    # and what was at risk is what was redone: the steps finished since that snapshot
    assert [e["steps_redone"] for e in events(run, kind="recovered")] == [49 - step]
    # and redoing them gives the failure-free result, bitwise
    assert target.read_text() == clean_checksum(launcher, tmp_path, 2, *AUTO_ARGS)


def test_steps_without_a_snapshot_still_count_as_progress_for_the_hang_timeout(launcher, tmp_path: Path) -> None:
    # Given no snapshot before the end (--snapshot-every 1000) and a hang timeout far shorter than
    # the training (24 steps of 0.25 s): progress reaches the agent with the heartbeat, not a commit
    target = tmp_path / "run.sha"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--hang-timeout", "2",
        "--snapshot-every", "1000", str(EXAMPLE), *ARGS, "--sleep", "0.25", "--checksum-file", str(target),
    )  # fmt: skip
    # Then no worker is taken for hung, and the result is the failure-free run's
    assert run.wait(150) == 0, run.stderr()[-3000:]
    assert "no step committed" not in run.stderr()
    assert target.read_text() == _clean_checksum(launcher, tmp_path, 2)
