"""Worker failure records: error files in torchrun's format, signals, root cause, the report."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from resilrun.agent.workers.failures import FailureLedger, ProcessFailure, collect_failure, format_report, root_cause
from resilrun.rendezvous.memory import MemoryBackend


def torchrun_error_file(path: Path, message: str, callstack: str, timestamp: str) -> Path:
    path.write_text(
        json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": callstack, "timestamp": timestamp}}}),
        encoding="utf-8",
    )
    return path


def collect(error_file: Path, *, exit_code: int = 1, observed_at: float = 100.0, **kw: Any) -> ProcessFailure:
    args: dict[str, Any] = {"global_rank": 3, "local_rank": 1, "node_rank": 1, "pid": 4242}
    args.update(kw)
    return collect_failure(exit_code=exit_code, observed_at=observed_at, error_file=error_file, **args)


def failure(rank: int, timestamp: float, message: str = "boom", exit_code: int = 1, **kw: Any) -> ProcessFailure:
    fields: dict[str, Any] = {
        "global_rank": rank,
        "local_rank": rank % 2,
        "node_rank": rank // 2,
        "host": f"host{rank // 2}",
        "pid": 1000 + rank,
        "exit_code": exit_code,
        "timestamp": timestamp,
        "message": message,
    }
    fields.update(kw)
    return ProcessFailure(**fields)


# -- collect_failure -------------------------------------------------------------------------------
def test_collect_failure_prefers_the_workers_error_file(tmp_path: Path) -> None:
    path = torchrun_error_file(
        tmp_path / "error.json", "ValueError: bad batch", 'Traceback:\n  File "train.py"\nValueError', "1700000000"
    )
    record = collect(path, observed_at=1800000000.0)
    assert record.message == "ValueError: bad batch"
    assert record.traceback == 'Traceback:\n  File "train.py"\nValueError'
    assert record.timestamp == 1700000000.0
    assert record.error_file == str(path)
    assert (record.global_rank, record.local_rank, record.node_rank, record.pid, record.exit_code) == (3, 1, 1, 4242, 1)
    assert record.host == socket.gethostname()


def test_collect_failure_without_an_error_file_describes_the_exit_code(tmp_path: Path) -> None:
    record = collect(tmp_path / "missing.json", exit_code=7, observed_at=12.5)
    assert "exited with code 7" in record.message
    assert "no error file" in record.message
    assert record.traceback is None
    assert record.timestamp == 12.5
    assert record.error_file is None


def test_collect_failure_of_a_sigkilled_worker_names_the_signal(tmp_path: Path) -> None:
    record = collect(tmp_path / "missing.json", exit_code=-9, pid=77)
    assert record.message == "Signal 9 (SIGKILL) received by PID 77"
    assert record.signal_name == "SIGKILL"


def test_collect_failure_of_an_unknown_signal_numbers_it(tmp_path: Path) -> None:
    record = collect(tmp_path / "missing.json", exit_code=-200)
    assert "Signal 200 (signal 200)" in record.message
    assert record.signal_name == "signal 200"


def test_signal_name_is_none_for_a_plain_exit_code() -> None:
    assert failure(0, 1.0, exit_code=3).signal_name is None
    assert failure(0, 1.0, exit_code=-15).signal_name == "SIGTERM"


@pytest.mark.parametrize(
    "content", ["{not json", "", '{"message": {"message": "x", "extraInfo": {"timestamp": "soon"}}}']
)
def test_collect_failure_survives_a_corrupt_error_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "error.json"
    path.write_text(content, encoding="utf-8")
    record = collect(path, exit_code=1, observed_at=5.0)
    assert record.timestamp == 5.0
    assert record.exit_code == 1
    assert record.error_file == str(path)


def test_collect_failure_survives_an_error_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    record = collect(path, exit_code=2)
    assert "exited with code 2" in record.message


def test_collect_failure_reads_a_plain_string_message(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "plain text failure"}), encoding="utf-8")
    assert collect(path).message == "plain text failure"


def test_collect_failure_without_extra_info_keeps_the_observed_time(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": {"message": "oops"}}), encoding="utf-8")
    record = collect(path, observed_at=9.0)
    assert (record.message, record.timestamp, record.traceback) == ("oops", 9.0, None)


@pytest.mark.parametrize(
    "content",
    ["[]", "null", '"boom"', "42", '{"message": {"message": "x", "extraInfo": "oops"}}'],
    ids=["list", "null", "string", "number", "extrainfo-string"],
)
def test_collect_failure_survives_an_error_file_whose_json_is_not_an_object(tmp_path: Path, content: str) -> None:
    path = tmp_path / "error.json"
    path.write_text(content, encoding="utf-8")
    record = collect(path, exit_code=1, observed_at=5.0)
    assert record.exit_code == 1


def test_process_failure_round_trips_through_a_dict_and_ignores_unknown_keys() -> None:
    original = failure(2, 3.5, traceback="tb", error_file="/x/error.json")
    data = {**original.to_dict(), "future_field": 1}
    assert ProcessFailure.from_dict(data) == original
    assert json.loads(json.dumps(original.to_dict())) == original.to_dict()


# -- root_cause / format_report -------------------------------------------------------------------
def test_root_cause_is_the_earliest_failure_whatever_the_order() -> None:
    early, mid, late = failure(2, 10.0), failure(0, 20.0), failure(1, 30.0)
    assert root_cause([late, early, mid]) is early
    assert root_cause([mid, late]) is mid


def test_root_cause_of_no_failures_is_none() -> None:
    assert root_cause([]) is None


def test_format_report_without_failures_says_so() -> None:
    assert format_report("job failed", []) == "job failed: no failure record"


def test_format_report_names_the_root_cause_with_its_details() -> None:
    cause = failure(
        3, 1.0, message="RuntimeError: NaN loss", exit_code=-9, traceback="line one\nline two\n", error_file="/e.json"
    )
    report = format_report("resilrun: the job failed", [failure(0, 5.0), cause])
    lines = report.splitlines()
    assert lines[0] == "resilrun: the job failed"
    assert lines[1] == "Root cause (first observed failure):"
    assert "  rank:       3 (local_rank 1, node_rank 1)" in lines
    assert "  host:       host1" in lines
    assert "  exit code:  -9 (SIGKILL) (pid 1003)" in lines
    assert "  message:    RuntimeError: NaN loss" in lines
    assert "  error file: /e.json" in lines
    assert lines[lines.index("  traceback:") + 1 :][:2] == ["    line one", "    line two"]


def test_format_report_lists_other_failures_in_time_order_with_first_message_lines() -> None:
    cause = failure(0, 1.0)
    later = failure(1, 3.0, message="second\nmore detail")
    middle = failure(2, 2.0, message="")
    report = format_report("t", [later, cause, middle])
    assert "Other failures (2):" in report
    tail = report.split("Other failures (2):\n", 1)[1].splitlines()
    assert tail == ["  rank 2 (local 0) on node 1: ", "  rank 1 (local 1) on node 0: second"]
    assert "more detail" not in report


def test_format_report_with_one_failure_has_no_other_failures_section() -> None:
    report = format_report("t", [failure(0, 1.0, exit_code=4)])
    assert "Other failures" not in report
    assert "  exit code:  4 (pid 1000)" in report
    assert "traceback" not in report
    assert "error file" not in report


def test_the_ledger_records_each_failure_once_and_every_agent_reads_them_in_order() -> None:
    backend = MemoryBackend()
    here, there = FailureLedger(backend, "job"), FailureLedger(backend, "job")  # two agents, one store
    first, second = failure(1, 10.0, pid=11), failure(2, 11.0, pid=12)
    assert here.record(3, [first]) == [first]
    assert here.record(3, [first, second]) == [second]  # the restart path describes rank 1 again
    assert there.count(3) == 2 and there.read(3) == [first, second]
    assert there.count(4) == 0 and there.read(4) == []  # per round
    assert there.record(3, [first]) == [first]  # each agent dedups what it recorded itself
