"""WorkerControl: what the supervisor learns about its workers' progress and waits."""

from __future__ import annotations

import threading
import time

from resilrun.agent.workers.control import WorkerControl
from tests.conftest import wait_until


def test_the_first_step_allowance_runs_from_the_generation_start_until_a_step_is_committed() -> None:
    now = [100.0]  # (binary-exact steps: the allowance is compared exactly)
    control = WorkerControl(monotonic=lambda: now[0])
    control.begin_generation([10, 11])
    control.register_api(10)
    now[0] += 0.25
    # Only workers on the resilrun API are judged (a plain torchrun script reports no steps)
    assert control.first_step_pending_for(10) == 0.25
    assert control.first_step_pending_for(11) is None
    control.report_step(10, 0)
    assert control.first_step_pending_for(10) is None
    assert control.stalled_for(10) is not None
    # A new generation (a recovery) restarts the allowance and forgets the old progress
    control.begin_generation([10])
    assert control.first_step_pending_for(10) is not None
    assert control.stalled_for(10) is None
    assert control.newest_step([10]) is None
    control.finished(10)
    assert control.first_step_pending_for(10) is None


def test_a_spare_waits_for_its_assignment_and_a_survivor_for_its_generation() -> None:
    control = WorkerControl()
    results: dict[str, object] = {}

    def spare() -> None:
        results["spare"] = control.await_assignment(7, timeout_s=5)

    def survivor() -> None:
        results["survivor"] = control.await_generation(8, after_round=0, timeout_s=5)

    threads = [threading.Thread(target=spare), threading.Thread(target=survivor)]
    for thread in threads:
        thread.start()
    wait_until(lambda: control.waiting_spares() == [7])
    control.assign(7, {"RANK": "1"})
    control.publish_generation(1, {8: {"RANK": "0"}})
    for thread in threads:
        thread.join(5)
    assert results == {"spare": {"RANK": "1"}, "survivor": {"RANK": "0"}}
    # A generation never moves backwards, and waits end with None at their deadline
    control.publish_generation(0, {8: {"RANK": "9"}})
    assert control.await_generation(8, after_round=0, timeout_s=0.05) == {"RANK": "0"}
    assert control.await_generation(8, after_round=1, timeout_s=0.05) is None
    assert control.await_assignment(9, timeout_s=0.05) is None


def _wait_in_thread(control: WorkerControl, pid: int, round: int, raised: bool) -> tuple[threading.Thread, list]:
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(control.await_generation(pid, round, 30.0, raised)))
    thread.start()
    return thread, answer


def test_a_worker_that_raised_waits_until_the_supervisor_dismisses_it() -> None:
    control = WorkerControl()
    thread, answer = _wait_in_thread(control, 11, 0, raised=True)
    wait_until(lambda: 11 in control.raised_workers())
    assert control.raised_workers()[11][0] == 0
    # When the supervisor finds no failure before it: the worker is told "no" at once
    control.dismiss(11)
    thread.join(5)
    assert answer == [None] and not thread.is_alive()
    assert control.raised_workers() == {}


def test_a_worker_that_raised_gets_the_generation_when_a_peer_failed_first() -> None:
    control = WorkerControl()
    thread, answer = _wait_in_thread(control, 12, 3, raised=True)
    wait_until(lambda: 12 in control.raised_workers())
    control.publish_generation(4, {12: {"RANK": "0"}})
    thread.join(5)
    assert answer == [{"RANK": "0"}]
    # and a dismissal for a worker no longer waiting is a no-op (it cannot poison its next wait)
    control.dismiss(12)
    thread, answer = _wait_in_thread(control, 12, 4, raised=False)
    control.publish_generation(5, {12: {"RANK": "1"}})
    thread.join(5)
    assert answer == [{"RANK": "1"}]


def test_a_recovery_waiting_for_a_spare_wakes_when_the_spare_starts_waiting() -> None:
    control = WorkerControl()
    assert control.wait_for_waiting_spares([21], 1, 0.0) is False
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(control.wait_for_waiting_spares([21], 1, 30.0)))
    waiter.start()
    spare = threading.Thread(target=control.await_assignment, args=(21, 30.0))
    spare.start()
    waiter.join(5)
    assert woke == [True], "the recovery was not woken by the spare"
    control.assign(21, {"RANK": "1"})
    spare.join(5)
    assert not spare.is_alive()


def test_a_dismissal_reaches_the_scripts_wait_not_the_watchdogs_wait_on_the_same_pid() -> None:
    # Given a worker whose script raised and waits, while its watchdog thread waits on the same pid
    control = WorkerControl()
    thread, answer = _wait_in_thread(control, 13, 0, raised=True)
    wait_until(lambda: 13 in control.raised_workers())
    control.dismiss(13)
    # Then the watchdog's wait neither returns on it nor consumes it (it runs to its own timeout),
    started = time.monotonic()
    assert control.await_generation(13, 0, 0.3) is None
    assert time.monotonic() - started >= 0.25
    # and the script's wait is told "no"
    thread.join(5)
    assert answer == [None] and not thread.is_alive()
