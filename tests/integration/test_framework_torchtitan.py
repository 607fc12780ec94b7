"""torchtitan's own trainer under resilrun, unmodified (issue 46).

What runs is torchtitan's ``torchtitan.train`` with its registered ``llama3_debugmodel`` config, FSDP2
over 2 ranks, its torchdata loader over a local text dataset and its own tokenizer format, through
a CPU shim that changes only what gloo on a CPU cannot do (tests/helpers/torchtitan_on_cpu). A
rank SIGKILLed mid-run must be replaced by the hot spare in-process, with no restart and no step
redone, and the run must end bitwise equal to a failure-free one: the same loss at every step and
the same weights on every rank.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, Launch, assert_nothing_left, recorded, resumed_from
from tests.torchtitan_assets import make, torchtitan_site

pytestmark = pytest.mark.integration

SHIM = ROOT / "tests" / "helpers" / "torchtitan_on_cpu"  # a sitecustomize: the run is -m torchtitan.train
# The debug model at a length and batch a CPU trains in a third of a second a step: float32
# parameters in FSDP's compute (a CPU multiplies bfloat16 matrices on a slow path, 7x slower here);
# a fixed seed, so that two runs draw the same initial weights.
ARGS = (
    "--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "64",
    "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32", "--debug.seed", "42",
    "--parallelism.spmd_backend", "partial_dtensor",
)  # fmt: skip
LOSS = re.compile(r"step:\s+(\d+)\s+\S*loss:\s+([0-9.]+)")


@pytest.fixture
def titan(tmp_path: Path) -> dict[str, str]:
    """The environment torchtitan runs in: its own site folder, offline, one thread per rank; the
    working folder (``tmp_path / "work"``) holds the assets it reads from ``./tests/assets``."""
    site = torchtitan_site()
    if site is None:
        message = "torchtitan is not installed in build/torchtitan-site (make test-torchtitan installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    make(tmp_path / "work")
    return {
        "PYTHONPATH": f"{site}{os.pathsep}{SHIM}",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


def _train(
    launcher, tmp_path: Path, env: dict[str, str], name: str, *flags: str, steps: int, faults: str = ""
) -> Launch:  # noqa: ANN001, PLR0913
    out = tmp_path / name
    out.mkdir()
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", *flags, "-m", "torchtitan.train", *ARGS,
        "--training.steps", str(steps),
        env={**env, "TORCHTITAN_TEST_DIGESTS": str(out), "RESILRUN_FAULTS": faults}, cwd=tmp_path / "work",
    )  # fmt: skip
    assert run.wait(300) == 0, run.stderr()[-4000:]
    assert_nothing_left(run)
    return run


def _losses(run: Launch) -> list[tuple[int, str]]:
    """Each logged step and its loss (every rank logs the global loss of each step it trains)."""
    return sorted((int(step), loss) for step, loss in LOSS.findall(run.stdout() + run.stderr()))


def _digests(folder: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(folder.glob("digest_rank*"))}


def test_a_killed_rank_is_replaced_by_the_spare_in_process_and_training_ends_bitwise_equal(
    launcher, tmp_path: Path, titan: dict[str, str]
) -> None:
    # Given torchtitan training 12 steps on 2 ranks with a hot spare, rank 1 SIGKILLed as step 7 starts
    faulty = _train(
        launcher,
        tmp_path,
        titan,
        "faulty",
        "--spares",
        "1",
        "--max-restarts",
        "0",
        steps=12,
        faults="kill:rank=1,step=6",
    )
    # Then the spare took rank 1 and both ranks resumed from node memory at step 6's end (resilrun's
    # step 5: it counts from 0), with no restart
    err = faulty.stderr()
    assert recorded(err, "spare_promoted"), err[-3000:]
    assert recorded(err, "restart") == []
    assert resumed_from(err) == {0: (5, "memory"), 1: (5, "memory")}
    # and no step was trained twice: steps 1-12 logged once by each rank
    losses = _losses(faulty)
    assert [step for step, _ in losses] == [step for step in range(1, 13) for _ in range(2)], losses
    # and the run equals a failure-free one bitwise: every loss, and every rank's weights
    clean = _train(launcher, tmp_path, titan, "clean", steps=12)
    assert losses == _losses(clean)
    assert _digests(tmp_path / "faulty") == _digests(tmp_path / "clean")
    assert len(_digests(tmp_path / "clean")) == 2
