"""torchtitan's own trainer under resilrun, unmodified (issue 46).

What runs is torchtitan's ``torchtitan.train`` with its registered debug configs: ``llama3_debugmodel``
and ``gpt_oss_debugmodel_flex`` (a mixture of experts; shrunk by the shim's environment to train in a
fraction of a second a step) with FSDP2 over 2 ranks, and ``llama3_debugmodel`` with tensor
parallelism inside FSDP2 over 4 ranks (2 x 2), with its torchdata loader over a local text dataset and
its own tokenizer format, through a CPU shim that changes only what gloo on a CPU cannot do
(tests/helpers/torchtitan_on_cpu). A rank SIGKILLed mid-run must be replaced by the hot spare
in-process, with no restart and no step redone, and the run must end bitwise equal to a failure-free
one: the same loss at every step and the same weights on every rank. Pipeline parallelism is not
recovered in-process: a failure restarts the job, as under torchrun.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import (
    ROOT,
    Launch,
    assert_nothing_left,
    made_once,
    recorded,
    replace_a_lost_node,
    resumed_from,
    wait_for,
)
from tests.torchtitan_assets import make, torchtitan_site

pytestmark = pytest.mark.integration

SHIM = ROOT / "tests" / "helpers" / "torchtitan_on_cpu"  # a sitecustomize: the run is -m torchtitan.train
# The debug models at a length and batch a CPU trains in a fraction of a second a step: float32
# parameters in FSDP's compute (a CPU multiplies bfloat16 matrices on a slow path, 7x slower here);
# a fixed seed, so that two runs draw the same initial weights.
COMMON = (
    "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
    "--debug.seed", "42", "--parallelism.spmd_backend", "partial_dtensor",
)  # fmt: skip
LLAMA3 = ("--module", "llama3", "--config", "llama3_debugmodel")
# gpt_oss's default attention ("varlen") has no CPU kernel; its flex variant is the same model.
GPT_OSS = ("--module", "gpt_oss", "--config", "gpt_oss_debugmodel_flex")
SMALL_EXPERTS = {"TORCHTITAN_TEST_MOE_HIDDEN": "128", "TORCHTITAN_TEST_MOE_LAYERS": "2"}


@dataclass(frozen=True)
class Layout:
    """A model and its parallelism; rank 1 is killed as resilrun's step ``kill_at`` starts (torchtitan's
    ``kill_at + 1``)."""

    ranks: int
    model: tuple[str, ...]
    steps: int
    kill_at: int
    env: dict[str, str] = field(default_factory=dict)


LAYOUTS = {
    "llama3-fsdp2": Layout(2, LLAMA3, steps=12, kill_at=6),
    "gpt_oss-moe-fsdp2": Layout(2, GPT_OSS, steps=10, kill_at=5, env=SMALL_EXPERTS),
    "llama3-tp2-fsdp2-4-ranks": Layout(4, (*LLAMA3, "--parallelism.tensor_parallel_degree", "2"), steps=8, kill_at=4),
}
LOSS = re.compile(r"step:\s+(\d+)\s+\S*loss:\s+([0-9.]+)")


def _make_assets(root: Path) -> None:
    make(root)


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
    # The tokenizer and dataset, made once per session: the failure-free references other tests made
    # (``_clean``) trained on these very files.
    assets = made_once(tmp_path, ["torchtitan-assets"], _make_assets)
    shutil.copytree(assets / "tests", tmp_path / "work" / "tests")
    return {
        "PYTHONPATH": f"{site}{os.pathsep}{SHIM}",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


def _start(  # noqa: PLR0913
    launcher,  # noqa: ANN001 - the fixture
    tmp_path: Path,
    env: dict[str, str],
    out: Path,
    layout: Layout,
    *flags: str,
    faults: str = "",
) -> Launch:
    """``out``: where each rank writes its weights' digest at the end."""
    out.mkdir(exist_ok=True)
    return launcher(
        "resilrun", "--standalone", "--nproc-per-node", str(layout.ranks), *flags, "-m", "torchtitan.train",
        *layout.model, *COMMON, "--training.steps", str(layout.steps),
        env={**env, **layout.env, "TORCHTITAN_TEST_DIGESTS": str(out), "RESILRUN_FAULTS": faults},
        cwd=tmp_path / "work",
    )  # fmt: skip


def _train(  # noqa: PLR0913
    launcher,  # noqa: ANN001 - the fixture
    tmp_path: Path,
    env: dict[str, str],
    out: Path,
    layout: Layout,
    *flags: str,
    faults: str = "",
) -> Launch:
    run = _start(launcher, tmp_path, env, out, layout, *flags, faults=faults)
    assert run.wait(300) == 0, run.stderr()[-4000:]
    assert_nothing_left(run)
    return run


def _losses(run: Launch) -> list[tuple[int, str]]:
    """Each logged step and its loss (every rank logs the global loss of each step it trains)."""
    return sorted((int(step), loss) for step, loss in LOSS.findall(run.stdout() + run.stderr()))


def _digests(folder: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(folder.glob("digest_rank*"))}


def _clean(
    launcher,  # noqa: ANN001 - the fixture
    tmp_path: Path,
    env: dict[str, str],
    layout: Layout,
) -> tuple[list[tuple[int, str]], dict[str, str]]:
    """Every step's loss and every rank's weights in a failure-free ``--standalone`` run of
    ``layout``: run once per session and shared by the tests that compare with it (``made_once``);
    where the kill lands is no part of it."""

    def run_it(folder: Path) -> None:
        run = _train(launcher, tmp_path, env, folder, layout)
        (folder / "losses.json").write_text(json.dumps(_losses(run)))

    key = [layout.ranks, layout.model, layout.steps, sorted(layout.env.items()), COMMON]
    folder = made_once(tmp_path, key, run_it)
    losses = [(step, loss) for step, loss in json.loads((folder / "losses.json").read_text())]
    return losses, _digests(folder)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_killed_rank_is_replaced_by_the_spare_in_process_and_training_ends_bitwise_equal(
    launcher, tmp_path: Path, titan: dict[str, str], layout: Layout
) -> None:
    # Given torchtitan training on its ranks with a hot spare, rank 1 SIGKILLed as a step starts
    faulty = _train(
        launcher, tmp_path, titan, tmp_path / "faulty", layout, "--spares", "1", "--max-restarts", "0",
        faults=f"kill:rank=1,step={layout.kill_at}",
    )  # fmt: skip
    # Then the spare took rank 1 and every rank resumed from node memory at the step before, with no restart
    err = faulty.stderr()
    assert recorded(err, "spare_promoted"), err[-3000:]
    assert recorded(err, "restart") == []
    assert resumed_from(err) == dict.fromkeys(range(layout.ranks), (layout.kill_at - 1, "memory"))
    # and no step was trained twice: each step logged once by each rank
    losses = _losses(faulty)
    assert [step for step, _ in losses] == [step for step in range(1, layout.steps + 1) for _ in range(layout.ranks)]
    # and the run equals a failure-free one bitwise: every loss, and every rank's weights
    clean_losses, clean_digests = _clean(launcher, tmp_path, titan, layout)
    assert losses == clean_losses
    assert _digests(tmp_path / "faulty") == clean_digests
    assert len(clean_digests) == layout.ranks


LOST_NODE = {name: LAYOUTS[name] for name in ("llama3-fsdp2", "gpt_oss-moe-fsdp2")}  # the same references


@pytest.mark.parametrize("layout", LOST_NODE.values(), ids=LOST_NODE.keys())
def test_a_lost_node_is_replaced_by_a_spare_node_in_process_and_training_ends_bitwise_equal(
    launcher, tmp_path: Path, titan: dict[str, str], layout: Layout
) -> None:
    # Given torchtitan (FSDP2) on 2 nodes x 1 rank replicating to each other, a third agent standing
    # by as a spare node; when the node that does not host the store loses its agent and its worker
    # once torchtitan's step kill_at - 1 is logged
    out = tmp_path / "faulty"
    out.mkdir()
    command = ["-m", "torchtitan.train", *layout.model, *COMMON, "--training.steps", str(layout.steps)]
    env = {**titan, **layout.env, "TORCHTITAN_TEST_DIGESTS": str(out)}
    trigger = re.compile(rf"step:\s+{layout.kill_at - 1}\s")

    def training(text: str) -> bool:
        return trigger.search(text) is not None

    loss = replace_a_lost_node(launcher, command, "titan", training, env, cwd=tmp_path / "work")
    # Then the spare node took its node rank in-process, with no restart: the lost rank restored from
    # its peer replica, the survivor from node memory, at the same step (replace_a_lost_node)
    survivor, step = loss.survivor, loss.step
    # and the survivor trained again only the steps after that one that it had done before the loss
    # (the lost node's replica of them had not landed), each with the same loss; every loss and every
    # rank's weights are a failure-free run's
    losses = _losses(survivor)
    logged = [s for s, _ in losses]
    assert sorted(set(logged)) == list(range(1, layout.steps + 1)), losses
    assert all(s > step + 1 for s in logged if logged.count(s) > 1), (step, losses)  # torchtitan's = ours + 1
    clean_losses, clean_digests = _clean(launcher, tmp_path, titan, layout)
    assert sorted(set(losses)) == sorted(set(clean_losses))
    assert _digests(out) == clean_digests
    assert len(_digests(out)) == 2


def test_pipeline_parallel_training_is_refused_in_process_and_a_failure_restarts_the_job(
    launcher, tmp_path: Path, titan: dict[str, str]
) -> None:
    # Given torchtitan with two pipeline stages on 2 ranks and a hot spare standing by
    layout = Layout(2, (*LLAMA3, "--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs"), 6, 3)
    run = _start(launcher, tmp_path, titan, tmp_path / "pipelined", layout, "--spares", "1", "--max-restarts", "1")
    # When rank 1 dies once training started (torchtitan 0.3's schedules may fail on their own first:
    # a failure either way)
    refusal = "pipeline parallelism is not recovered in-process"
    wait_for(lambda: refusal in run.stdout() + run.stderr() or run.popen.poll() is not None, 240, "the refusal")
    for proc in psutil.Process(run.pid).children():
        try:
            if proc.environ().get("RANK") == "1" and proc.environ().get("RESILRUN_SPARE") == "0":
                proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass  # gone already: it failed on its own
    run.wait(300)
    # Then each rank said why, and the failure restarted the job (torchtitan's own group, as
    # under torchrun) instead of re-running the survivors in-process with their stages not restored
    output = run.stdout() + run.stderr()
    assert output.count(refusal) >= 2, output[-3000:]  # once per rank in each round
    err = run.stderr()
    assert recorded(err, "spare_promoted") == [], err[-3000:]
    assert "hot spare takes over" not in err
    assert "restarting the job: restart 1 of 1" in err, err[-3000:]
    assert_nothing_left(run)
