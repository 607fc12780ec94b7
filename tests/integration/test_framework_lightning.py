"""An unmodified PyTorch Lightning script recovers in-process (issue 18, Lightning).

The script (examples/train_lightning.py) knows nothing of resilrun: a small transformer LM as a
LightningModule, synthetic tokens, dropout, a per-step warmup schedule, a shuffling DataLoader
that Lightning shards, ``Trainer(strategy="ddp")``. Under ``--spares 1 --max-restarts 0`` a
SIGKILLed worker must cost no restart and no redone step, and the saved weights must be bitwise
the failure-free run's, also mid-epoch, with gradient accumulation and DataLoader workers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import (
    assert_a_spare_node_replaces_a_lost_one,
    recorded,
    require_modules,
    resumed_from,
    train_unmodified,
    weights,
)

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_lightning.py"


@pytest.fixture(scope="module", autouse=True)
def lightning_installed() -> None:
    require_modules("lightning")


def _train(launcher, out: Path, faults: str, *extra: str) -> str:  # noqa: ANN001
    return train_unmodified(launcher, SCRIPT, out, faults, *extra)


def test_a_lightning_script_recovers_in_process_bitwise_equal_in_its_second_epoch(launcher, tmp_path: Path) -> None:
    # Given 64 samples in batches of 4 over 2 ranks (8 batches an epoch), rank 1 SIGKILLed as optimizer
    # step 11 starts (epoch 1, its 4th batch: the epoch's shuffle matters), and a hot spare
    extra = ("--steps", "20", "--samples", "64")
    err = _train(launcher, tmp_path / "faulty", "kill:rank=1,step=11", *extra)
    # Then the spare took rank 1 and every rank resumed at step 10's end: no restart, no step redone
    assert recorded(err, "spare_promoted")
    assert recorded(err, "restart") == []
    assert resumed_from(err)[0] == (10, "memory")
    assert resumed_from(err)[1] == (10, "memory")
    # and the saved weights are bitwise the failure-free run's (same shuffle, dropout and schedule)
    _train(launcher, tmp_path / "clean", "", *extra)
    assert weights(tmp_path / "faulty") == weights(tmp_path / "clean")


def test_a_rank_killed_as_the_next_epoch_starts_resumes_bitwise(launcher, tmp_path: Path) -> None:
    # Given 8 batches an epoch and rank 1 killed as step 8 starts: the snapshot is the first epoch's
    # last batch, so the resumed epoch is replayed to its end and the next one made afresh
    extra = ("--steps", "16", "--samples", "64")
    err = _train(launcher, tmp_path / "faulty", "kill:rank=1,step=8", *extra)
    assert resumed_from(err)[0] == (7, "memory")
    assert recorded(err, "restart") == []
    # Then the second epoch's iterator saw the random state step 7 left (its shuffle, its dropout)
    _train(launcher, tmp_path / "clean", "", *extra)
    assert weights(tmp_path / "faulty") == weights(tmp_path / "clean")


def test_gradient_accumulation_and_dataloader_workers_resume_at_the_same_batch(launcher, tmp_path: Path) -> None:
    # Given 2 micro-batches per optimizer step, 2 DataLoader worker processes, and rank 0 killed at step 6
    extra = ("--steps", "12", "--samples", "64", "--grad-accum", "2", "--workers", "2")
    err = _train(launcher, tmp_path / "faulty", "kill:rank=0,step=6", *extra)
    assert resumed_from(err)[1] == (5, "memory")
    assert recorded(err, "restart") == []
    # Then the resumed run fed the same batches: the weights are bitwise the failure-free run's
    _train(launcher, tmp_path / "clean", "", *extra)
    assert weights(tmp_path / "faulty") == weights(tmp_path / "clean")


def test_a_stateful_dataloader_with_workers_resumes_where_it_stood(launcher, tmp_path: Path) -> None:
    require_modules("torchdata.stateful_dataloader")
    # Given torchdata's StatefulDataLoader (it keeps its own position; Lightning restores it) with
    # 2 worker processes, and rank 1 killed mid-way through the second epoch
    extra = ("--steps", "16", "--samples", "64", "--stateful", "--workers", "2")
    err = _train(launcher, tmp_path / "faulty", "kill:rank=1,step=11", *extra)
    assert resumed_from(err)[0] == (10, "memory")
    assert recorded(err, "restart") == []
    # Then the loader's own state put it at the same batch (not skipped twice): bitwise equal
    _train(launcher, tmp_path / "clean", "", *extra)
    assert weights(tmp_path / "faulty") == weights(tmp_path / "clean")


@pytest.mark.timeout(400)
def test_a_lost_node_is_replaced_by_a_spare_node_and_fit_resumes_bitwise_equal(launcher, tmp_path: Path) -> None:
    # Given 2 nodes x 1 worker (Trainer(num_nodes=2) from WORLD_SIZE) replicating to each other and a
    # third agent standing by as a spare node, When the node that does not host the store is lost
    # mid-run, Then (see the helper) the spare node takes its rank in-process, no restart, and the
    # weights are bitwise a failure-free run's
    assert_a_spare_node_replaces_a_lost_one(
        launcher, tmp_path, SCRIPT, ("--steps", "300", "--samples", "64"), "step 17 loss", "lit"
    )
