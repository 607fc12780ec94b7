"""A process's device check before it takes a rank (worker/health.py), the fault that fails it, and
what the agent does with a spare that fails it (the next spare takes the rank, no restart)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from resilrun.agent.supervision.rounds import RoundEnd
from resilrun.agent.workers.control import WorkerControl
from resilrun.env import UNHEALTHY_EXIT_CODE
from resilrun.worker import health
from resilrun.worker.faults import isolated, parse_faults, unhealthy
from tests.unit.test_recovery_paths import World, fail, finish_all, make_job, run_round


def test_a_working_device_answers_and_multiplies_within_the_budget() -> None:
    check = health.check_device(torch.device("cpu"))
    assert check.reason == "" and check.device == "cpu"
    assert check.answer_s is not None and check.gflops is not None and check.gflops > 0
    assert health.judge(check, expected_gflops=None) == ""


def test_a_device_that_does_not_answer_within_the_budget_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health, "_measure", lambda device: time.sleep(5))
    started = time.monotonic()
    check = health.check_device(torch.device("cpu"), budget_s=0.2)
    assert time.monotonic() - started < 2  # the caller is not held by a hung device
    assert check.reason == "the device did not answer within 0.2 s"
    assert health.judge(check, None) == check.reason


def test_an_error_of_the_device_is_its_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(device: torch.device) -> health.DeviceCheck:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(health, "_measure", broken)
    assert health.check_device(torch.device("cpu")).reason.startswith("RuntimeError: CUDA error")


def test_speed_is_judged_on_gpus_against_half_the_nodes_rate_and_never_on_cpus() -> None:
    slow_gpu = health.DeviceCheck("cuda:1", 0.001, 300.0)
    assert "300 GFLOP/s, under 0.5x this node's 1000" in health.judge(slow_gpu, expected_gflops=1000.0)
    assert health.judge(health.DeviceCheck("cuda:1", 0.001, 600.0), expected_gflops=1000.0) == ""
    assert health.judge(slow_gpu, expected_gflops=None) == ""  # nothing to compare with yet
    assert health.judge(health.DeviceCheck("cpu", 0.001, 1.0), expected_gflops=1000.0) == ""  # shared cores


def test_the_injected_failure_names_the_rank_and_generation() -> None:
    plan = parse_faults("unhealthy:rank=1,round=1;kill:rank=1,step=8")
    assert unhealthy(plan, rank=1, round=1).startswith("injected: the device did not answer")
    assert unhealthy(plan, rank=1, round=0) == unhealthy(plan, rank=0, round=1) == ""
    assert health.check_device(torch.device("cpu"), fail="x").reason == "x"
    with pytest.raises(ValueError, match="needs rank= and round="):
        parse_faults("unhealthy:rank=1,step=3")


def test_the_node_reference_is_the_median_of_the_passing_checks() -> None:
    control = WorkerControl()
    assert control.expected_gflops() is None
    for gflops, passed in ((100.0, True), (300.0, True), (5.0, False), (200.0, True), (None, True)):
        control.device_checked(gflops, passed=passed)
    assert control.expected_gflops() == 200.0


def test_a_spare_whose_device_fails_its_check_is_skipped_for_the_next_spare(tmp_path: Path) -> None:
    # Given a hot-spare pair: rank 3 fails, and the spare that takes it fails its device check at once
    job = make_job(tmp_path, spares=2)
    first: dict[str, int] = {}

    def first_spare_unhealthy(world: World) -> None:
        spare = world.worker(3)
        first["pid"] = spare.pid
        spare.exit(UNHEALTHY_EXIT_CODE)

    job.world.at(3, fail(3))
    job.world.at(6, first_spare_unhealthy)
    job.world.at(12, finish_all)

    assert run_round(job) is RoundEnd.DONE

    # Then the next spare took the rank in-process: no restart, even though no step came in between
    state = job.world.state()
    assert (state.restarts, state.recoveries) == (0, 2)
    workers = job.sup.membership.current.workers  # type: ignore[union-attr]
    assert workers[1].spec.global_rank == 3 and workers[1].pid != first["pid"]
    assert job.telemetry.kinds().count("recovery") == 2


def test_the_same_rank_failing_again_without_progress_still_restarts(tmp_path: Path) -> None:
    # (the exemption is for a failed device check only: a rank that fails at once again is a bug)
    job = make_job(tmp_path, spares=2)
    job.world.at(3, fail(3))
    job.world.at(6, fail(3))
    job.world.at(14, finish_all)
    run_round(job)
    assert job.world.state().restarts == 1


def test_the_check_leaves_the_scripts_random_stream_alone() -> None:
    # (it drew its matrices from the default generator once: a spare's check shifted the dropout
    # masks of a run recovered before its first snapshot, which then differed from a failure-free one)
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    assert health.check_device(torch.device("cpu")).reason == ""
    assert torch.equal(torch.rand(4), expected)


def test_isolation_is_injected_for_the_process_joining_one_rank_in_one_generation() -> None:
    plan = parse_faults("kill:rank=1,step=8;isolated:rank=1,round=1")
    assert isolated(plan, rank=1, round=1)
    assert not isolated(plan, rank=1, round=2) and not isolated(plan, rank=0, round=1)
    with pytest.raises(ValueError, match="needs rank= and round="):
        parse_faults("isolated:rank=1")


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_first_collective_completes_and_is_timed_without_a_budget_left_running(world_of_one: None) -> None:
    overdue: list[float] = []
    seconds = health.hand_off(torch.device("cpu"), 0.2, overdue.append, hang=False)
    assert 0 <= seconds < 0.2
    time.sleep(0.3)
    assert overdue == []  # done in time: the budget's timer was cancelled


def test_a_first_collective_past_its_budget_is_told_overdue(world_of_one: None) -> None:
    # Given an isolated process (its all-reduce never completes); hand_off blocks, so on a thread
    overdue = threading.Event()
    budgets: list[float] = []

    def told(budget_s: float) -> None:
        budgets.append(budget_s)
        overdue.set()

    threading.Thread(
        target=health.hand_off, args=(torch.device("cpu"), 0.2, told), kwargs={"hang": True}, daemon=True
    ).start()
    # Then the process is told once its budget is spent (the caller's ``overdue`` ends the process)
    assert overdue.wait(5)
    assert budgets == [0.2]


def test_the_budget_starts_once_every_rank_reached_the_hand_off(world_of_one: None) -> None:
    # Given the others still re-running their set-up for longer than the budget
    overdue: list[float] = []
    seconds = health.hand_off(
        torch.device("cpu"), 0.2, overdue.append, hang=False, everyone_here=lambda: time.sleep(0.4)
    )
    # Then the spare is not charged for their time: its collective took far less than its budget
    time.sleep(0.3)
    assert overdue == [] and seconds < 0.2
