"""A hot spare runs the script's set-up before any rank fails (issue 47, part 1).

The script (tests/helpers/setup_ahead.py) spends ``--setup`` seconds in a ``@resilrun.once`` set-up
between ``resilrun.init()`` and its DDP, and writes "PID TIME" each time the set-up runs. With the
head start the spare runs it while the job trains, and a survivor's re-run of the script reuses its
first result: after a rank is killed, no process of the new generation runs the set-up again, and
the result is the failure-free run's, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import assert_nothing_left, events

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "setup_ahead.py"
ARGS = ["--setup", "1.5", "--steps", "30"]


def _train(  # noqa: ANN001
    launcher, tmp_path: Path, name: str, *flags: str, faults: str = "", script: tuple[str, ...] = ()
) -> tuple[object, Path, str]:
    trace, target = tmp_path / f"{name}.trace", tmp_path / f"{name}.sha"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", *flags,
        str(SCRIPT), *ARGS, *script, "--trace", str(trace), "--checksum-file", str(target),
        env={"RESILRUN_FAULTS": faults} if faults else {},
    )  # fmt: skip
    assert run.wait(150) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)
    return run, trace, target.read_text()


def _set_ups(trace: Path) -> dict[int, list[float]]:
    runs: dict[int, list[float]] = {}
    for line in trace.read_text().splitlines():
        pid, at = line.split()
        runs.setdefault(int(pid), []).append(float(at))
    return runs


@pytest.mark.parametrize(
    "script",
    [(), ("--compile", "aot_eager", "--workers", "2")],
    ids=["plain", "compiled-with-dataloader-workers"],
)
def test_the_spare_ran_the_set_up_before_the_failure_and_no_one_runs_it_again(
    launcher,
    tmp_path: Path,
    script: tuple[str, ...],  # noqa: ANN001
) -> None:
    # Given a failure-free run's result (the model compiled in the set-up, batches from DataLoader workers)
    _, _, clean = _train(launcher, tmp_path, "clean", "--spares", "0", script=script)
    # When rank 1 is SIGKILLed at step 15 of a job with a hot spare (head start: the default)
    run, trace, faulty = _train(
        launcher, tmp_path, "faulty", "--spares", "1", faults="kill:rank=1,step=15", script=script
    )
    # Then the spare took rank 1 in-process, nobody restarted
    (promoted,) = events(run, kind="spare_promoted")
    (failed,) = events(run, kind="failure_detected")
    assert events(run, kind="restart") == []
    # and every process of the new generation had run the set-up once, before the failure
    (entered,) = events(run, kind="generation_entered", round=1)
    set_ups = _set_ups(trace)
    assert promoted["spare_pid"] in entered["pids"]
    for pid in entered["pids"]:
        assert len(set_ups[pid]) == 1 and set_ups[pid][0] < failed["failed_at"], (pid, set_ups, failed)
    # and the result is the failure-free run's
    assert faulty == clean


def test_without_the_head_start_the_spare_runs_the_set_up_after_it_is_given_the_rank(
    launcher,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    # Given --no-spare-head-start, when rank 1 is killed
    run, trace, _ = _train(
        launcher, tmp_path, "after", "--spares", "1", "--no-spare-head-start", faults="kill:rank=1,step=15"
    )
    # Then the spare's set-up ran only once it had the rank, after the failure
    (promoted,) = events(run, kind="spare_promoted")
    (failed,) = events(run, kind="failure_detected")
    assert [at > failed["failed_at"] for at in _set_ups(trace)[promoted["spare_pid"]]] == [True]
