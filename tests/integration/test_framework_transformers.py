"""An unmodified Hugging Face Trainer script recovers in-process (issue 18, transformers).

The script (examples/train_hf_trainer.py) knows nothing of resilrun: a tiny GPT-2 from its config,
synthetic tokens, dropout, warmup + cosine, ``trainer.save_model``. Under ``--spares 1
--max-restarts 0`` a SIGKILLed worker must cost no restart and no redone step, and the saved
weights must be bitwise the failure-free run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import (
    assert_a_spare_node_replaces_a_lost_one,
    assert_nothing_left,
    recorded,
    require_modules,
    resumed_from,
    train_unmodified,
    weights,
)

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_hf_trainer.py"
SLOW_RANK = Path(__file__).resolve().parents[1] / "helpers" / "slow_rank.py"


@pytest.fixture(scope="module", autouse=True)
def transformers_installed() -> None:
    require_modules("accelerate", "transformers")


def _train(launcher, out: Path, faults: str, *extra: str, env: dict[str, str] | None = None) -> str:  # noqa: ANN001
    return train_unmodified(launcher, SCRIPT, out, faults, *extra, env=env)


def test_a_trainer_script_recovers_in_process_bitwise_equal(launcher, tmp_path: Path) -> None:
    # Given the Trainer script, 2 workers and a hot spare, rank 1 SIGKILLed when optimizer step 8 starts
    err = _train(launcher, tmp_path / "faulty", "kill:rank=1,step=8", "--steps", "16")
    # Then the spare took rank 1 and every rank resumed at step 7's end: no restart, no step redone
    assert recorded(err, "spare_promoted")
    assert recorded(err, "restart") == []
    assert resumed_from(err)[0] == (7, "memory")
    assert resumed_from(err)[1] == (7, "memory")
    # and the saved weights are bitwise the failure-free run's
    _train(launcher, tmp_path / "clean", "", "--steps", "16")
    assert weights(tmp_path / "faulty") == weights(tmp_path / "clean")


def test_gradient_accumulation_and_dataloader_workers_resume_at_the_same_batch(launcher, tmp_path: Path) -> None:
    # Given 2 micro-batches per optimizer step, 2 DataLoader worker processes, and rank 0 killed at step 6
    extra = ("--steps", "12", "--grad-accum", "2", "--workers", "2")
    err = _train(launcher, tmp_path / "faulty", "kill:rank=0,step=6", *extra)
    assert resumed_from(err)[1] == (5, "memory")
    assert recorded(err, "restart") == []
    # Then the resumed run fed the same batches: the weights are bitwise the failure-free run's
    _train(launcher, tmp_path / "clean", "", *extra)
    assert weights(tmp_path / "faulty") == weights(tmp_path / "clean")


@pytest.mark.timeout(400)
def test_a_lost_node_is_replaced_by_a_spare_node_and_the_trainer_resumes_bitwise_equal(
    launcher, tmp_path: Path
) -> None:
    # Given 2 nodes x 1 worker replicating to each other and a third agent standing by as a spare node,
    # When the node that does not host the store is lost mid-run, Then (see the helper) the spare node
    # takes its rank in-process, no restart, and the weights are bitwise a failure-free run's
    assert_a_spare_node_replaces_a_lost_one(launcher, tmp_path, SCRIPT, ("--steps", "400"), "'loss'", "hf")


def test_a_straggling_rank_is_swapped_for_the_hot_spare_and_the_trainer_ends_bitwise_equal(
    launcher, tmp_path: Path
) -> None:
    # Given the unmodified Trainer script whose rank 1 process is slow (50 ms more per forward), a
    # hot spare and --stragglers swap
    slow = {"SLOW_RANK": "1", "SLOW_S": "0.05", "SLOW_ONCE": str(tmp_path / "slow.once")}
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "0",
        "--stragglers", "swap", "--heartbeat-interval", "0.5", str(SLOW_RANK), str(SCRIPT),
        "--out", str(tmp_path / "swapped"), "--steps", "160", env=slow,
    )  # fmt: skip
    assert run.wait(240) == 0, run.stderr()[-4000:]
    assert_nothing_left(run)
    err = run.stderr()
    # Then rank 1 was named and swapped once, at a step boundary, without a failure or a restart
    (swapped,) = recorded(err, "straggler_swapped")
    assert swapped["rank"] == 1
    assert recorded(err, "failure_detected") == recorded(err, "restart") == []
    assert resumed_from(err) == {0: (swapped["step"], "memory"), 1: (swapped["step"], "memory")}
    # and the saved weights are bitwise the failure-free run's
    _train(launcher, tmp_path / "clean", "", "--steps", "160")
    assert weights(tmp_path / "swapped") == weights(tmp_path / "clean")
