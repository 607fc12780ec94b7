"""An unmodified Hugging Face Accelerate loop recovers in-process (issue 18, Accelerate).

The script (examples/train_accelerate.py) knows nothing of resilrun: a small transformer LM, a
shuffling DataLoader that ``accelerator.prepare`` shards, ``accelerator.accumulate``, a warmup
schedule, an evaluation pass after every epoch, an epoch-bounded loop. Under ``--spares 1
--max-restarts 0`` a SIGKILLed worker must cost no restart and no redone step, and the saved
weights must be bitwise the failure-free run's: at an epoch's end, mid-epoch with gradient
accumulation and DataLoader workers, with torchdata's StatefulDataLoader, and with a node lost.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.conftest import (
    assert_a_spare_node_replaces_a_lost_one,
    launch_unmodified,
    recorded,
    require_modules,
    resumed_from,
    train_unmodified,
    weights,
)

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_accelerate.py"


@pytest.fixture(scope="module", autouse=True)
def accelerate_installed() -> None:
    require_modules("accelerate")


def _train(launcher, out: Path, faults: str, *extra: str, env: dict[str, str] | None = None) -> str:  # noqa: ANN001
    return train_unmodified(launcher, SCRIPT, out, faults, *extra, env=env)


def test_a_rank_killed_as_an_epoch_ends_resumes_bitwise_and_the_scripts_own_checkpoints_stand(
    launcher, tmp_path: Path
) -> None:
    # Given 64 samples in batches of 4 over 2 ranks (8 optimizer steps an epoch), the script saving
    # its own checkpoint after each epoch, and rank 0 SIGKILLed as step 16 (the third epoch's first) starts
    extra = ("--epochs", "3", "--save-state")
    err = _train(launcher, tmp_path / "faulty", "kill:rank=0,step=16", *extra)
    # Then the spare took rank 0 and both ranks resumed at step 15: no restart, no step redone
    assert recorded(err, "spare_promoted")
    assert recorded(err, "restart") == []
    assert resumed_from(err)[0] == (15, "memory")
    assert resumed_from(err)[1] == (15, "memory")
    # and the weights are bitwise the failure-free run's (same shuffle in the next epoch, same dropout)
    _train(launcher, tmp_path / "clean", "", *extra)
    assert weights(tmp_path / "faulty") == weights(tmp_path / "clean")
    # and the first epoch's checkpoint, written before the failure, was not overwritten as the
    # script replayed that (empty) epoch's end on its way to the resumed step
    faulty, clean = tmp_path / "faulty" / "epoch_0", tmp_path / "clean" / "epoch_0"
    assert weights(faulty) == weights(clean)
    for name in ("optimizer.bin", "scheduler.bin"):  # pickles: equal in content, not always in bytes
        assert _same(torch.load(faulty / name, weights_only=False), torch.load(clean / name, weights_only=False)), name
    assert "accelerator.save_state() skipped: the script is replaying an epoch finished before the failure" in err


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_a_script_that_resumes_from_its_own_checkpoints_keeps_doing_so(launcher, tmp_path: Path) -> None:
    # Given a script that saves its own checkpoint after every epoch and starts from the newest one
    # it finds (as scripts written for torchrun restarts do)
    extra = ("--epochs", "3", "--save-state", "--resume")
    # When a rank dies before the script has saved anything: resilrun's snapshot is all there is
    err = _train(launcher, tmp_path / "early", "kill:rank=1,step=3", *extra)
    assert resumed_from(err)[0] == (2, "memory")
    _train(launcher, tmp_path / "clean", "", *extra)
    assert weights(tmp_path / "early") == weights(tmp_path / "clean")
    # When a rank dies after the script saved its first epoch: the script resumes from its own
    # checkpoint (its epoch counter follows it), and resilrun restores nothing on top of it
    late = launch_unmodified(launcher, SCRIPT, tmp_path / "late", "kill:rank=1,step=11", *extra)
    err = late.stderr()
    assert recorded(err, "spare_promoted")
    assert recorded(err, "restart") == []
    assert "resumed from step" not in err
    assert "the script loads its own checkpoint (accelerator.load_state); this run is not snapshotted" in err
    assert "resumed from epoch_0" in late.stdout()


def test_gradient_accumulation_and_dataloader_workers_resume_at_the_same_batch(launcher, tmp_path: Path) -> None:
    # Given 2 micro-batches per optimizer step, 2 DataLoader worker processes, and rank 0 killed at
    # step 6 (the second epoch's third step: its shuffle and its workers' seeds matter)
    extra = ("--epochs", "3", "--grad-accum", "2", "--workers", "2")
    err = _train(launcher, tmp_path / "faulty", "kill:rank=0,step=6", *extra)
    assert resumed_from(err)[1] == (5, "memory")
    assert recorded(err, "restart") == []
    # Then the resumed run fed the same batches: the weights are bitwise the failure-free run's
    _train(launcher, tmp_path / "clean", "", *extra)
    assert weights(tmp_path / "faulty") == weights(tmp_path / "clean")


def test_with_a_snapshot_every_3_steps_the_loop_redoes_the_steps_since_the_newest_bitwise(
    launcher, tmp_path: Path
) -> None:
    # Given snapshots of steps 2, 5, 8, ... only (and of the last, at end_training), rank 1 killed at step 11
    flags = ("--snapshot-every", "3")
    err = train_unmodified(launcher, SCRIPT, tmp_path / "faulty", "kill:rank=1,step=11", "--epochs", "3", flags=flags)
    # Then both ranks resumed from step 8 (9 and 10 redone, mid-epoch: the replay skips 1 batch, not 3)
    assert resumed_from(err)[0] == (8, "memory")
    assert recorded(err, "restart") == []
    _train(launcher, tmp_path / "clean", "", "--epochs", "3")
    assert weights(tmp_path / "faulty") == weights(tmp_path / "clean")


def test_a_stateful_dataloader_with_workers_resumes_where_it_stood(launcher, tmp_path: Path) -> None:
    require_modules("torchdata.stateful_dataloader")
    # Given Accelerate's use_stateful_dataloader (torchdata's StatefulDataLoader, which makes its
    # first iterator at prepare) with 2 worker processes, and rank 1 killed in the second epoch
    extra = ("--epochs", "3", "--stateful", "--workers", "2")
    err = _train(launcher, tmp_path / "faulty", "kill:rank=1,step=11", *extra)
    assert resumed_from(err)[0] == (10, "memory")
    assert recorded(err, "restart") == []
    # Then the resumed epoch had its own shuffle (not the first epoch's, made at prepare): bitwise equal
    _train(launcher, tmp_path / "clean", "", *extra)
    assert weights(tmp_path / "faulty") == weights(tmp_path / "clean")


@pytest.mark.timeout(400)
def test_a_lost_node_is_replaced_by_a_spare_node_and_the_loop_resumes_bitwise_equal(launcher, tmp_path: Path) -> None:
    # Given 2 nodes x 1 worker replicating to each other and a third agent standing by as a spare node,
    # When the node that does not host the store is lost mid-run, Then (see the helper) the spare node
    # takes its rank in-process, no restart, and the weights are bitwise a failure-free run's
    assert_a_spare_node_replaces_a_lost_one(launcher, tmp_path, SCRIPT, ("--epochs", "40"), "eval loss", "acc")
