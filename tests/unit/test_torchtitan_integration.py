"""The torchtitan integration (resilrun/integrations/torchtitan.py) on a fake torchtitan shaped as 0.3's:
what it snapshots, where it brackets a step, when it stands aside with one warning, and that the group
torchtitan asks for is resilrun's. tests/integration/test_framework_torchtitan.py runs the real one.
"""

from __future__ import annotations

import logging
import sys
import types
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from resilrun.integrations import _framework_compat as compat
from resilrun.integrations import _support as support
from resilrun.integrations import torchtitan as titan
from resilrun.worker import membership


class _Loader(StatefulDataLoader):
    """As torchtitan's ParallelAwareDataloader: its own state_dict pickles the base's."""

    def state_dict(self) -> dict[str, Any]:
        import pickle

        return {"dp_rank_0": pickle.dumps(super().state_dict()), "world_size": 1}


class _Checkpointer:
    def __init__(self) -> None:
        self.loads = 0

    def load(self, step: int = -1) -> bool:
        self.loads += 1
        return False


class _Trainer:
    """torchtitan's Trainer as the integration sees it: objects built, a loop counting steps from 1."""

    def __init__(self, steps: int = 3, pp: bool = False) -> None:
        self.config = types.SimpleNamespace(
            comm=types.SimpleNamespace(mode="default"),
            training=types.SimpleNamespace(enable_cpu_offload=False),
            parallelism=types.SimpleNamespace(pipeline_parallel_degree=2 if pp else 1),
        )
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.model_parts = [model]
        self.optimizers = types.SimpleNamespace(optimizers=[optimizer])
        self.lr_schedulers = types.SimpleNamespace(
            schedulers=[torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)]
        )
        self.dataloader = _Loader(list(range(8)), batch_size=2)
        self.checkpointer = _Checkpointer()
        self.parallel_dims = types.SimpleNamespace(pp_enabled=pp)
        self.steps, self.step, self.ntokens_seen = steps, 0, 0
        self.trained: list[int] = []

    def init_distributed(self) -> None:
        dist.init_process_group(backend="gloo", timeout=timedelta(seconds=123))

    def train_step(self, data: Any) -> None:
        self.trained.append(self.step)

    def train(self) -> None:
        self.checkpointer.load(step=-1)
        while self.step < self.steps:
            self.step += 1
            self.train_step(None)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


class _Job:
    def __init__(self, resume_at: int) -> None:
        self.resume_at = resume_at
        self.calls: list[tuple[str, int]] = []
        self.tracked: dict[str, Any] = {}

    def track(self, **objects: Any) -> None:
        self.tracked |= objects

    def resume(self) -> int:
        if self.resume_at >= 0:
            self.tracked["train_state"].load_state_dict({"step": self.resume_at + 1, "ntokens_seen": 7})
        return self.resume_at

    def begin(self, step: int) -> None:
        self.calls.append(("begin", step))

    def commit(self, step: int) -> None:
        self.calls.append(("commit", step))

    def finish(self) -> None:
        self.calls.append(("finish", -1))


@pytest.fixture
def fake_titan(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """``torchtitan`` 0.3.0, its ``distributed.utils`` and its ``trainer`` module, fakes; integrations on."""
    package = types.ModuleType("torchtitan")
    package.__version__ = "0.3.0"  # type: ignore[attr-defined]
    utils = types.ModuleType("torchtitan.distributed.utils")
    utils.init_distributed = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    trainer_module = types.ModuleType("torchtitan.trainer")
    trainer_module.Trainer = type("Trainer", (_Trainer,), {})  # type: ignore[attr-defined]
    distributed = types.ModuleType("torchtitan.distributed")
    distributed.utils = utils  # type: ignore[attr-defined]
    package.distributed = distributed  # type: ignore[attr-defined]
    for name, module in (
        ("torchtitan", package),
        ("torchtitan.distributed", distributed),
        ("torchtitan.distributed.utils", utils),
        ("torchtitan.trainer", trainer_module),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(membership, "_REENTRY_HOOKS", [])
    monkeypatch.setattr(titan, "GENERATION", support.Generation())
    monkeypatch.setattr(titan, "_joins", lambda: True)
    return trainer_module


def _session(monkeypatch: pytest.MonkeyPatch, job: _Job) -> None:
    monkeypatch.setattr(membership, "init", lambda backend=None, timeout=None: job)


def test_the_group_torchtitan_asks_for_is_made_by_resilrun_with_its_backend_and_timeout(
    fake_titan: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[str | None, timedelta | None]] = []
    monkeypatch.setattr(membership, "init", lambda backend=None, timeout=None: asked.append((backend, timeout)))
    own = dist.init_process_group
    titan.adapt_trainer(fake_titan)
    trainer = fake_titan.Trainer()
    trainer.init_distributed()
    assert asked == [("gloo", timedelta(seconds=123))]
    assert dist.init_process_group is own  # only while torchtitan sets up distributed
    assert getattr(trainer, "_resilrun_joined", False)


def test_a_pipeline_parallel_training_keeps_torchtitans_own_group_and_a_failure_restarts_the_job(
    fake_titan: types.ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a training with pipeline stages, which resilrun does not restore in place
    asked: list[object] = []
    monkeypatch.setattr(membership, "init", lambda backend=None, timeout=None: asked.append(backend))
    made: list[str | None] = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend=None, timeout=None, **_: made.append(backend))
    titan.adapt_trainer(fake_titan)
    trainer = fake_titan.Trainer(steps=2, pp=True)
    # When torchtitan sets up distributed and trains
    trainer.init_distributed()
    with caplog.at_level(logging.WARNING, logger="resilrun"):
        trainer.train()
    # Then the group is torchtitan's own, as under torchrun: a failure cannot be recovered in-process
    # by re-running the survivors (their pipeline schedule is not restored), so it restarts the job
    assert asked == [] and made == ["gloo"]
    assert not getattr(trainer, "_resilrun_joined", False)
    assert trainer.trained == [1, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pipeline parallelism is not recovered in-process" in warnings[0], warnings


def test_each_step_is_bracketed_with_resilruns_count_and_the_run_finishes(
    fake_titan: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _Job(resume_at=-1)
    _session(monkeypatch, job)
    titan.adapt_trainer(fake_titan)
    trainer = fake_titan.Trainer(steps=3)
    trainer._resilrun_joined = True
    trainer.train()
    # torchtitan's steps 1-3 are resilrun's 0-2; torchtitan's own load runs on a fresh start
    assert job.calls == [
        ("begin", 0),
        ("commit", 0),
        ("begin", 1),
        ("commit", 1),
        ("begin", 2),
        ("commit", 2),
        ("finish", -1),
    ]
    assert trainer.checkpointer.loads == 1
    assert "train_step" not in vars(trainer)  # the class's own method again
    assert sorted(job.tracked) == ["dataloader", "lr_scheduler_0", "model_0", "optimizer_0", "train_state"]


def test_a_resumed_run_starts_after_the_snapshot_and_skips_torchtitans_own_load(
    fake_titan: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _Job(resume_at=4)  # resilrun's step 4: torchtitan's step 5 is done
    _session(monkeypatch, job)
    titan.adapt_trainer(fake_titan)
    trainer = fake_titan.Trainer(steps=7)
    trainer._resilrun_joined = True
    trainer.train()
    assert trainer.trained == [6, 7]
    assert trainer.checkpointer.loads == 0  # the snapshot is newer than any checkpoint of its own
    assert "load" not in vars(trainer.checkpointer)
    assert job.calls[:2] == [("begin", 5), ("commit", 5)]


def test_the_loaders_position_is_the_torchdata_state_not_torchtitans_pickle(fake_titan: types.ModuleType) -> None:
    trainer = fake_titan.Trainer()
    position = titan._LoaderPosition(trainer.dataloader, compat.stateful_loader_class(trainer.dataloader))
    iterator = iter(trainer.dataloader)
    first = next(iterator)
    state = position.state_dict()
    assert not any(isinstance(value, bytes) for value in state["loader"].values())
    second = next(iterator)
    restored = fake_titan.Trainer()
    titan._LoaderPosition(restored.dataloader, StatefulDataLoader).load_state_dict(state)
    assert torch.equal(next(iter(restored.dataloader)), second)
    assert not torch.equal(first, second)


@pytest.mark.parametrize(
    ("breaks", "reason"),
    [
        (lambda t: setattr(t.parallel_dims, "pp_enabled", True), "pipeline parallelism is not recovered in-process"),
        (lambda t: delattr(t, "_resilrun_joined"), "torchtitan made its own process group"),
        (lambda t: setattr(t, "dataloader", list(range(4))), "a StatefulDataLoader as Trainer.dataloader"),
        (lambda t: setattr(t, "lr_schedulers", object()), "Trainer.lr_schedulers.schedulers"),
    ],
    ids=["pipeline", "own-group", "plain-loader", "no-schedulers"],
)
def test_a_training_it_cannot_recover_runs_as_under_torchrun_with_one_warning(
    fake_titan: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    breaks: Any,
    reason: str,
) -> None:
    job = _Job(resume_at=-1)
    _session(monkeypatch, job)
    titan.adapt_trainer(fake_titan)
    trainer = fake_titan.Trainer(steps=2)
    trainer._resilrun_joined = True
    breaks(trainer)
    with caplog.at_level(logging.WARNING, logger="resilrun"):
        trainer.train()
    assert trainer.trained == [1, 2]
    assert job.calls == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0] and "a failure restarts the job" in warnings[0], warnings


def test_a_version_outside_the_tested_range_is_left_as_it_is(
    fake_titan: types.ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys.modules["torchtitan"], "__version__", "0.4.0")
    own = fake_titan.Trainer.train
    with caplog.at_level(logging.WARNING, logger="resilrun"):
        titan.adapt_trainer(fake_titan)
    assert fake_titan.Trainer.train is own
    assert any("torchtitan 0.4.0 is outside the versions resilrun integrates" in r.getMessage() for r in caplog.records)


def test_a_trainer_lacking_what_it_wraps_is_left_as_it_is(
    fake_titan: types.ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(sys.modules["torchtitan.distributed.utils"], "init_distributed")
    own = fake_titan.Trainer.train
    with caplog.at_level(logging.WARNING, logger="resilrun"):
        titan.adapt_trainer(fake_titan)
    assert fake_titan.Trainer.train is own
    assert any("torchtitan.distributed.utils.init_distributed" in r.getMessage() for r in caplog.records)


def test_a_loader_position_from_another_data_parallel_size_is_refused(fake_titan: types.ModuleType) -> None:
    # A position in a dataset sharded for 2 ranks restored into a loader sharded for 4 would skip
    # or repeat samples silently: refused, as torchtitan refuses it for its own checkpoints
    before, after = fake_titan.Trainer(), fake_titan.Trainer()
    before.dataloader.dp_world_size, after.dataloader.dp_world_size = 2, 4
    state = titan._LoaderPosition(before.dataloader, StatefulDataLoader).state_dict()
    with pytest.raises(RuntimeError, match="across a resize"):
        titan._LoaderPosition(after.dataloader, StatefulDataLoader).load_state_dict(state)
