"""Hot spares run no line of the script before they have a rank (issue: spares and env-first scripts).

Scripts written for torchrun read ``RANK``/``LOCAL_RANK`` before anything else, and plain torchrun
scripts never call ``resilrun.init()``: a spare that ran such code without a rank crashed (and so
did its replacement), or ran the whole script as a job of its own and wrote rank 0's artifacts.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import assert_nothing_left, clean_checksum, recorded, resumed_from, wait_for
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
LONG = ["--steps", "60", "--hidden", "64"]


def test_a_script_that_reads_rank_first_is_recovered_by_a_spare(launcher, tmp_path: Path) -> None:
    # Given a script that branches on RANK at its first line, 2 workers, a hot spare, no restart allowed
    def run_job(name: str, faults: str) -> tuple[str, str]:
        target = tmp_path / f"{name}.sha"
        run = launcher(
            "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "0",
            str(HELPERS / "env_first.py"), "--checksum-file", str(target), env={"RESILRUN_FAULTS": faults},
        )  # fmt: skip
        assert run.wait(150) == 0, run.stderr()[-3000:]
        assert_nothing_left(run)
        return target.read_text(), run.stderr()

    # When rank 1 is SIGKILLed at step 8
    faulty, err = run_job("faulty", "kill:rank=1,step=8")
    # Then the spare took rank 1 with its environment and nobody restarted
    assert recorded(err, "spare_promoted")
    assert "not started as a distributed worker" not in err
    assert recorded(err, "restart") == []
    assert resumed_from(err)[1] == (7, "memory")
    # and the result is the failure-free run's
    clean, _ = run_job("clean", "")
    assert faulty == clean


def test_a_spare_never_runs_a_plain_torchrun_script_on_its_own(launcher, tmp_path: Path) -> None:
    # Given a plain torchrun script (no resilrun API) whose rank 0 writes the job's artifact, and a spare
    trace, out = tmp_path / "trace.txt", tmp_path / "out.txt"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "1",
        str(HELPERS / "plain_rank0_writer.py"), "--trace", str(trace), "--out", str(out), "--steps", "20",
    )  # fmt: skip
    assert run.wait(120) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)
    # Then only the two real ranks ran the script, each with its rank
    lines = trace.read_text().splitlines()
    assert sorted(line.split()[1] for line in lines) == ["RANK=0", "RANK=1"], lines
    assert all("WORLD_SIZE=2" in line for line in lines), lines
    # and the artifact is the real job's
    assert out.read_text() == "world=2 total=40\n"


def _spares_of(launch) -> list[psutil.Process]:  # noqa: ANN001 - a conftest Launch
    found = []
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(launch.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.environ().get("RESILRUN_SPARE") == "1":
                    found.append(child)
    return found


def test_a_spare_that_dies_while_waiting_is_reported_and_replaced(launcher, tmp_path: Path) -> None:
    # Given a job with one hot spare, whose rank 1 will fail late in the run
    target = tmp_path / "faulty.sha"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "0",
        "--log-dir", str(tmp_path / "logs"), str(EXAMPLE), *LONG, "--sleep", "0.25", "--checksum-file", str(target),
        env={"RESILRUN_FAULTS": "kill:rank=1,step=55"},
    )  # fmt: skip
    # When the spare is SIGKILLed while it waits (the OOM killer, say)
    wait_for(lambda: len(_spares_of(run)) == 1, 60, "the hot spare")
    first = _spares_of(run)[0]
    first.kill()
    # Then the agent says so, with the reason, and that the node has no spare left,
    wait_for(lambda: "no hot spare left on this node" in run.stderr(), 30, "the no-spare warning")
    err = run.stderr()
    assert f"hot spare (pid {first.pid}) exited while waiting for a rank: Signal 9 (SIGKILL)" in err
    # starts another one, which takes rank 1's place when it fails: no restart, the clean result
    wait_for(lambda: [p.pid for p in _spares_of(run)] not in ([], [first.pid]), 30, "a new spare")
    assert run.wait(180) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)
    err = run.stderr()
    assert recorded(err, "spare_promoted")
    assert "no warm spare" not in err
    assert target.read_text() == _clean_checksum_args(launcher, tmp_path, LONG)
    # and the exit is counted in the events file
    lines = [line for path in (tmp_path / "logs").rglob("events.jsonl") for line in path.read_text().splitlines()]
    events = [json.loads(line) for line in lines]
    exited = [e for e in events if e["event"] == "spare_exited"]
    assert [e["pid"] for e in exited] == [first.pid]


def _clean_checksum_args(launcher, tmp_path: Path, args: list[str]) -> str:  # noqa: ANN001
    return clean_checksum(launcher, tmp_path, 2, *args)


def test_a_ranks_own_communication_error_is_the_failure_not_a_peers(launcher, tmp_path: Path) -> None:
    # Given rank 1 failing with its own NCCL-style error at step 6 while rank 0 waits for it in the
    # all-reduce (nothing else failed: text that names NCCL must not make it wait as a survivor)
    def run_job(name: str, fail: list[str]) -> tuple[str, str, float]:
        target = tmp_path / f"{name}.sha"
        run = launcher(
            "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "0",
            str(HELPERS / "own_dist_error.py"), *fail, "--checksum-file", str(target),
        )  # fmt: skip
        started = time.monotonic()
        assert run.wait(150) == 0, run.stderr()[-3000:]
        assert_nothing_left(run)
        return target.read_text(), run.stderr(), time.monotonic() - started

    faulty, err, seconds = run_job("faulty", ["--fail-rank", "1", "--fail-step", "6"])
    clean, _, clean_seconds = run_job("clean", [])
    # Then the agent decides it is rank 1's own failure at once, a spare takes rank 1, rank 0
    # recovers in its process, and the job ends as a failure-free run does, in about its time
    assert "rank 1 raised with no failure before it anywhere in the job" in err
    assert recorded(err, "spare_promoted")
    assert "rank 0 recovering in-process" in err
    assert faulty == clean
    assert seconds < clean_seconds + 15, (seconds, clean_seconds)
