"""Events, store history and recovery timelines from the agent's hooks (fake workers, memory store)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resilrun.agent.observability.events import EventLog, read_events
from resilrun.agent.observability.telemetry import AgentTelemetry, Telemetry
from resilrun.agent.workers.failures import ProcessFailure
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import NodeInfo, RdzvState
from resilrun.status import records
from resilrun.status.view import compose, read_raw

RUN = "job1"


def worker(
    rank: int, pid: int, *, spare: bool = False, exit_observed_at: float | None = None, started_at: float = 900.0
) -> Any:
    spec = SimpleNamespace(global_rank=rank, local_rank=rank % 2, env={"RESILRUN_SPARE": "1" if spare else "0"})
    popen = SimpleNamespace(returncode=-9)
    return SimpleNamespace(spec=spec, pid=pid, exit_observed_at=exit_observed_at, started_at=started_at, popen=popen)


def failure(rank: int, pid: int, at: float) -> ProcessFailure:
    return ProcessFailure(rank, rank % 2, 0, "h", pid, -9, at, "Signal 9 (SIGKILL) received by PID 7")


@pytest.fixture
def telemetry(tmp_path: Path) -> AgentTelemetry:
    events = EventLog(tmp_path / "events.jsonl", node_id="a", host="h")
    return AgentTelemetry(events, MemoryBackend(), RUN)


def state(round: int, **changes: Any) -> RdzvState:
    nodes = (NodeInfo("a", "127.0.0.1", 2),)
    return RdzvState(round=round, complete=True, participants=nodes, **changes)


def test_the_base_telemetry_accepts_every_hook_and_records_nothing() -> None:
    hooks = Telemetry()
    assert hooks.round_started(state(0), 0, []) is None
    assert hooks.committed(0, 1, 10, 0.1) is None
    assert hooks.exit("succeeded") is None
    assert vars(hooks) == {}  # nothing kept


def test_events_are_json_lines_with_the_envelope_and_unknown_kinds_are_refused(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", node_id="n1", host="h")
    log.node_rank = 3
    log.record("exit", outcome="succeeded")
    with pytest.raises(ValueError, match="unknown event"):
        log.record("made_up")
    log.close()
    (event,) = read_events(tmp_path / "events.jsonl")
    assert event["event"] == "exit" and event["outcome"] == "succeeded"
    assert event["node_id"] == "n1" and event["node_rank"] == 3 and event["time"].endswith("+00:00")
    assert isinstance(event["wall"], float) and isinstance(event["mono"], float)


def test_a_torn_last_line_is_skipped_when_reading_events(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "exit"}\n{"event": "rec')
    assert read_events(path) == [{"event": "exit"}]


def test_an_in_process_recovery_leaves_events_a_history_record_and_a_complete_timeline(
    telemetry: AgentTelemetry,
) -> None:
    # Given a node running ranks 0 and 1 that committed step 14, when rank 1 dies and a spare takes it
    old = [worker(0, 10), worker(1, 11, exit_observed_at=1000.0)]
    telemetry.round_started(state(0), 0, old)
    for rank in (0, 1):
        telemetry.committed(rank, 14, 100, 0.001)
    telemetry.failures(0, [failure(1, 11, 1000.0)])
    new = state(1, recovering=True, recoveries=1, failure=failure(1, 11, 1000.0).to_dict())
    spare = worker(1, 12, spare=True)
    telemetry.recovery_decided(new, [old[1]], {1: spare}, 0.05)
    telemetry.generation_entered(new, 0, [old[0], spare])
    # and the workers report their milestones
    for pid, rank in ((10, 0), (12, 1)):
        telemetry.worker_report(pid, {"event": "collectives_rebuilt", "rank": rank, "round": 1, "seconds": 0.1,
                                      "at": 1000.2})  # fmt: skip
        telemetry.worker_report(pid, {"event": "state_restored", "rank": rank, "round": 1, "step": 14,
                                      "tier": "memory", "bytes": 100, "seconds": 0.01, "at": 1000.3})  # fmt: skip
    telemetry.worker_report(10, {"event": "first_step", "rank": 0, "round": 1, "step": 15, "at": 1000.5})
    assert "recovered" not in [e["event"] for e in read_events(telemetry.events.path)]
    telemetry.worker_report(12, {"event": "first_step", "rank": 1, "round": 1, "step": 15, "at": 1000.7})
    # Then the events tell the story in order
    kinds = [e["event"] for e in read_events(telemetry.events.path)]
    assert kinds[:4] == ["round_started", "failure_detected", "spare_promoted", "generation_entered"]
    assert kinds.count("state_transferred") == 2 and kinds[-1] == "recovered"
    # and status shows one complete recovery: 0.7 s from detection to the last rank's first step
    doc = compose(read_raw(telemetry.backend, RUN))
    (part,) = records.read_parts(telemetry.backend, RUN, 1, 1)
    assert [part["ranks"][r]["replacement"] for r in ("0", "1")] == [False, True]
    (entry,) = doc["history"]
    assert entry["failed_ranks"] == [1]
    assert entry["replacements"] == [{"rank": 1, "failed_pid": 11, "spare_pid": 12, "warm": True}]
    assert entry["rerun"] is False  # the survivors resumed through the API
    assert entry["complete"] and entry["duration_s"] == 0.7 and entry["steps_redone"] == 0
    assert entry["timeline"]["replacement_chosen"] == 0.05 and entry["timeline"]["state_bytes"] == 200


def test_a_replacement_started_after_the_failure_is_recorded_as_not_warm(telemetry: AgentTelemetry) -> None:
    old = [worker(0, 10), worker(1, 11, exit_observed_at=1000.0)]
    telemetry.round_started(state(0), 0, old)
    new_process = worker(1, 12, spare=True, started_at=1000.5)  # no spare was left: started for the rank
    telemetry.recovery_decided(state(1, recovering=True, recoveries=1), [old[1]], {1: new_process}, 2.5)
    promoted = [e for e in read_events(telemetry.events.path) if e["event"] == "spare_promoted"]
    assert [(e["rank"], e["spare_pid"], e["warm"]) for e in promoted] == [(1, 12, False)]


def test_a_rank_that_got_ahead_counts_its_extra_step_as_redone(telemetry: AgentTelemetry) -> None:
    telemetry.round_started(state(0), 0, [worker(0, 10), worker(1, 11)])
    telemetry.committed(0, 15, 100, None)  # rank 0 finished step 15; rank 1 only 14
    telemetry.committed(1, 14, 100, None)
    telemetry.generation_entered(state(1, recovering=True), 0, [worker(0, 10), worker(1, 12)])
    for pid, rank in ((10, 0), (12, 1)):
        telemetry.worker_report(pid, {"event": "state_restored", "rank": rank, "round": 1, "step": 14,
                                      "tier": "memory", "bytes": 1, "seconds": 0.0, "at": 1.0})  # fmt: skip
    (part,) = records.read_parts(telemetry.backend, RUN, 1, 1)
    assert part["steps_redone"] == 1 and part["newest_step_before"] == 15


def test_a_failure_reported_again_by_the_restart_path_is_recorded_once(telemetry: AgentTelemetry) -> None:
    telemetry.failures(0, [failure(1, 11, 5.0)])
    telemetry.failures(0, [failure(1, 11, 5.0)])
    assert [e["event"] for e in read_events(telemetry.events.path)] == ["failure_detected"]
    assert telemetry.counts["failures"] == 1


def test_a_restart_and_a_node_loss_are_job_history_records_and_the_node_is_marked_lost(
    telemetry: AgentTelemetry,
) -> None:
    old = state(2)
    cause = failure(3, 0, 50.0)
    telemetry.restart(old, RdzvState(round=3, restarts=1, failure=cause.to_dict()), cause)
    telemetry.node_lost(old, [failure(2, 0, 60.0)], ("b",))
    kinds = [r["kind"] for r in records.read_history(telemetry.backend, RUN)]
    assert kinds == ["restart", "node_lost"]
    assert records.lost_marker(telemetry.backend, RUN, "b")["round"] == 2  # type: ignore[index]
    assert [e["event"] for e in read_events(telemetry.events.path)] == ["restart", "node_lost"]


def test_worker_reports_for_a_round_not_entered_after_a_failure_are_ignored(telemetry: AgentTelemetry) -> None:
    telemetry.worker_report(10, {"event": "first_step", "rank": 0, "round": 0, "step": 0, "at": 1.0})
    assert read_events(telemetry.events.path) == []


def test_step_rate_is_smoothed_from_commit_times(telemetry: AgentTelemetry, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("resilrun.agent.observability.telemetry.time.monotonic", lambda: now[0])
    for step in range(5):
        telemetry.committed(0, step, 10, None)
        now[0] += 0.5
    assert telemetry.progress[0]["step"] == 4
    assert telemetry.progress[0]["step_time_s"] == pytest.approx(0.5)


def test_compute_time_is_smoothed_and_kept_through_commits_that_carry_none(telemetry: AgentTelemetry) -> None:
    telemetry.committed(0, 0, 10, None)
    assert "compute_s" not in telemetry.progress[0]  # nothing measured yet (no step timed)
    telemetry.committed(0, 1, 10, None, 0.1)
    assert telemetry.progress[0]["compute_s"] == pytest.approx(0.1)
    telemetry.committed(0, 2, 10, None, 0.6)
    assert telemetry.progress[0]["compute_s"] == pytest.approx(0.1 + 0.2 * 0.5)  # one step moves it a fifth
    telemetry.committed(0, 3, 10, None)  # a step whose gradients the probe did not see
    assert telemetry.progress[0]["compute_s"] == pytest.approx(0.2)


def test_a_peer_behind_that_is_no_longer_a_target_leaves_status_and_says_so_once(telemetry: AgentTelemetry) -> None:
    telemetry.replica_health("198.18.0.2:29500", False, "connection reset by peer")
    assert telemetry.replicas_behind() == {"198.18.0.2:29500": "connection reset by peer"}
    telemetry.replica_dropped("198.18.0.2:29500")  # its node was lost; a spare node's peer replaces it
    telemetry.replica_dropped("198.18.0.3:29500")  # one that was never behind: nothing to say
    assert telemetry.replicas_behind() == {}
    kinds = [(e["event"], e.get("peer")) for e in read_events(telemetry.events.path)]
    assert kinds == [("replica_behind", "198.18.0.2:29500"), ("replica_dropped", "198.18.0.2:29500")]
