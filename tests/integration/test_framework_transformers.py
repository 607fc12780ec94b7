"""An unmodified Hugging Face Trainer script recovers in-process (issue 18, transformers).

The script (examples/train_hf_trainer.py) knows nothing of resilrun: a tiny GPT-2 from its config,
synthetic tokens, dropout, warmup + cosine, ``trainer.save_model``. Under ``--spares 1
--max-restarts 0`` a SIGKILLed worker must cost no restart and no redone step, and the saved
weights must be bitwise the failure-free run's.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.conftest import (
    assert_nothing_left,
    events,
    require_modules,
    resumed,
    train_unmodified,
    wait_for,
    weights,
)

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_hf_trainer.py"


@pytest.fixture(scope="module", autouse=True)
def transformers_installed() -> None:
    require_modules("accelerate", "transformers")


def _train(launcher, out: Path, faults: str, *extra: str, env: dict[str, str] | None = None) -> str:  # noqa: ANN001
    return train_unmodified(launcher, SCRIPT, out, faults, *extra, env=env)


def test_a_trainer_script_recovers_in_process_bitwise_equal(launcher, tmp_path: Path) -> None:
    # Given the Trainer script, 2 workers and a hot spare, rank 1 SIGKILLed when optimizer step 8 starts
    err = _train(launcher, tmp_path / "faulty", "kill:rank=1,step=8", "--steps", "16")
    # Then the spare took rank 1 and every rank resumed at step 7's end: no restart, no step redone
    assert "hot spare takes over" in err
    assert "restarting the job" not in err
    assert "rank 0 resumed from step 7 (node memory)" in err
    assert "rank 1 resumed from step 7 (node memory)" in err
    # and the saved weights are bitwise the failure-free run's
    _train(launcher, tmp_path / "clean", "", "--steps", "16")
    assert weights(tmp_path / "faulty") == weights(tmp_path / "clean")


def test_gradient_accumulation_and_dataloader_workers_resume_at_the_same_batch(launcher, tmp_path: Path) -> None:
    # Given 2 micro-batches per optimizer step, 2 DataLoader worker processes, and rank 0 killed at step 6
    extra = ("--steps", "12", "--grad-accum", "2", "--workers", "2")
    err = _train(launcher, tmp_path / "faulty", "kill:rank=0,step=6", *extra)
    assert "rank 1 resumed from step 5 (node memory)" in err
    assert "restarting the job" not in err
    # Then the resumed run fed the same batches: the weights are bitwise the failure-free run's
    _train(launcher, tmp_path / "clean", "", *extra)
    assert weights(tmp_path / "faulty") == weights(tmp_path / "clean")


@pytest.mark.timeout(400)
def test_a_lost_node_is_replaced_by_a_spare_node_and_the_trainer_resumes_bitwise_equal(
    launcher, tmp_path: Path
) -> None:
    # Given 2 nodes x 1 worker replicating to each other and a third agent standing by as a spare node
    # (one OpenMP thread each, as the 2-worker reference run gets from the launcher: thread count
    # changes the order of float sums, so it must match for bitwise equality)
    port = free_port()
    env = {"OMP_NUM_THREADS": "1"}
    out = tmp_path / "faulty"
    flags = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hf",
        "--replicas", "1", "--heartbeat-timeout", "3", "--max-restarts", "0",
        str(SCRIPT), "--out", str(out), "--steps", "400",
    ]  # fmt: skip
    nodes = [launcher("resilrun", *flags, env=env) for _ in range(2)]
    wait_for(lambda: any("round 0 formed" in n.stderr() for n in nodes), 150, "the round to form")
    spare = launcher("resilrun", *flags, env=env)
    wait_for(lambda: "standing by as a spare node" in spare.stderr(), 150, "the spare node")
    wait_for(lambda: any("'loss'" in n.stdout() for n in nodes), 150, "training to log its first loss")
    # When the node that does not host the store loses its agent and its worker (SIGKILL: node loss)
    doomed = next(n for n in nodes if "hosting store" not in n.stderr())
    survivor = next(n for n in nodes if n is not doomed)
    os.killpg(doomed.pid, signal.SIGKILL)
    # Then the spare node takes its node rank in-process, the lost rank restoring from its replica,
    for node in (survivor, spare):
        assert node.wait(300) == 0, node.stderr()[-4000:]
        assert_nothing_left(node)
    assert "spare node takes node rank" in spare.stderr()
    assert events(survivor, spare, kind="restart") == []
    lost = int(re.search(r"this node rank \d+ runs ranks? (\d+)", doomed.stderr()).group(1))
    steps = resumed(survivor, spare)
    step = steps[lost][0]
    assert steps == {lost: (step, "peer"), 1 - lost: (step, "memory")}, steps
    # and the saved weights are bitwise those of a failure-free run of 2 ranks
    _train(launcher, tmp_path / "clean", "", "--steps", "400")
    assert weights(out) == weights(tmp_path / "clean")
