"""Fake Accelerate, transformers and Lightning modules with exactly the internals the integrations
probe for (resilrun/integrations/_framework_compat.py), put into ``sys.modules`` for one test.

Why fakes: the real frameworks take seconds to import and cannot be made to lack one internal; a
test here takes one piece away (``del``, or another signature) and sees its probe fail.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest


def _module(monkeypatch: pytest.MonkeyPatch, name: str, **attributes: Any) -> ModuleType:
    module = ModuleType(name)
    module.__path__ = []  # a package: its submodules are the fakes in sys.modules
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:  # ``import a.b`` then ``a.b`` reads the attribute, as after a real import
        monkeypatch.setattr(sys.modules[parent], child, module, raising=False)
    return module


# -- Accelerate --------------------------------------------------------------------------------------
def accelerate(monkeypatch: pytest.MonkeyPatch, version: str = "1.15.0") -> ModuleType:
    """``accelerate.accelerator`` (with its state and data-loader modules) as resilrun knows them."""

    class PartialState:
        def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
            self.cpu = cpu

    class AcceleratorState:
        @staticmethod
        def _reset_state(reset_partial_state: bool = False) -> None: ...

    class GradientState:
        @staticmethod
        def _reset_state() -> None: ...

    def loader(name: str) -> type:
        return type(name, (), {"__iter__": lambda self: iter(()), "set_epoch": lambda self, epoch: None})

    class Accelerator:
        def prepare(self, *objects: Any) -> Any:
            return objects

        def load_state(self, input_dir: str | None = None) -> None: ...

    _module(monkeypatch, "accelerate", __version__=version)
    _module(
        monkeypatch,
        "accelerate.state",
        PartialState=PartialState,
        AcceleratorState=AcceleratorState,
        GradientState=GradientState,
    )
    _module(
        monkeypatch,
        "accelerate.data_loader",
        DataLoaderShard=loader("DataLoaderShard"),
        DataLoaderDispatcher=loader("DataLoaderDispatcher"),
    )
    return _module(monkeypatch, "accelerate.accelerator", Accelerator=Accelerator)


# -- transformers ------------------------------------------------------------------------------------
class Trainer:
    """A Trainer class with the methods resilrun wraps or redirects."""

    def train(self, resume_from_checkpoint: object = None) -> str:
        return "the framework's own train"

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: object = None) -> None: ...
    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None: ...
    def _load_scaler(self, checkpoint: str | None) -> None: ...
    def _load_rng_state(self, checkpoint: str | None) -> None: ...


def trainer_instance(trainer_class: type) -> Any:
    """A Trainer with what the real one sets in its constructor and resilrun reads."""
    trainer = trainer_class()
    trainer.args = object()
    trainer.is_deepspeed_enabled = trainer.is_fsdp_enabled = False
    trainer.accelerator = trainer.callback_handler = trainer.control = trainer.model_wrapped = object()
    return trainer


def transformers(monkeypatch: pytest.MonkeyPatch, version: str = "5.23.0", trainer: type | None = None) -> ModuleType:
    """``transformers.trainer`` (with ``trainer_callback``, ``training_args`` and the Accelerate
    state it resets) as resilrun knows them; ``trainer`` is its Trainer class."""

    class TrainerCallback:
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None: ...
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None: ...
        def on_step_end(self, *args: Any, **kwargs: Any) -> None: ...
        def on_train_end(self, *args: Any, **kwargs: Any) -> None: ...

    class ExportableState:
        def state(self) -> dict[str, Any]:
            return {}

    @dataclasses.dataclass
    class TrainerState:
        global_step: int = 0
        stateful_callbacks: dict[str, Any] = dataclasses.field(default_factory=dict)

    @dataclasses.dataclass
    class TrainingArguments:
        ddp_backend: str | None = None
        use_cpu: bool = False
        ddp_timeout: int = 1800

        @functools.cached_property
        def _setup_devices(self) -> str:
            return "cpu"

    accelerate(monkeypatch)
    _module(monkeypatch, "transformers", __version__=version)
    _module(
        monkeypatch,
        "transformers.trainer_callback",
        TrainerCallback=TrainerCallback,
        ExportableState=ExportableState,
        TrainerState=TrainerState,
    )
    _module(monkeypatch, "transformers.training_args", TrainingArguments=TrainingArguments)
    trainer_class = trainer if trainer is not None else type("Trainer", (Trainer,), {})
    return _module(monkeypatch, "transformers.trainer", Trainer=trainer_class, TRAINER_STATE_NAME="trainer_state.json")


# -- Lightning -----------------------------------------------------------------------------------------
class LightningTrainer:
    """A Lightning Trainer class with the ``fit`` resilrun wraps."""

    def fit(self, model: object, train_dataloaders: object = None, ckpt_path: object = None) -> str:
        return "the framework's own fit"


def lightning(monkeypatch: pytest.MonkeyPatch, version: str = "2.6.0", trainer: type | None = None) -> ModuleType:
    """``lightning.pytorch.trainer.trainer`` (with its combined loader, callbacks and strategies) as
    resilrun knows them; ``trainer`` is its Trainer class."""

    class CombinedLoader:
        def __iter__(self) -> Any:
            return self

        def __next__(self) -> Any:
            raise StopIteration

    class Callback:
        def on_train_start(self, trainer: Any, pl_module: Any) -> None: ...
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None: ...
        def on_train_end(self, trainer: Any, pl_module: Any) -> None: ...

    class Strategy:
        def load_checkpoint(self, checkpoint_path: str, weights_only: bool | None = None) -> dict[str, Any]:
            return {}

    _module(monkeypatch, "lightning", __version__=version)
    for package in ("lightning.pytorch", "lightning.pytorch.utilities", "lightning.pytorch.trainer"):
        _module(monkeypatch, package)
    _module(monkeypatch, "lightning.pytorch.utilities.combined_loader", CombinedLoader=CombinedLoader)
    _module(monkeypatch, "lightning.pytorch.callbacks", Callback=Callback)
    _module(monkeypatch, "lightning.pytorch.strategies", Strategy=Strategy)
    trainer_class = trainer if trainer is not None else type("Trainer", (LightningTrainer,), {})
    return _module(monkeypatch, "lightning.pytorch.trainer.trainer", Trainer=trainer_class)


def lightning_instance(trainer_class: type, strategy: str = "DDPStrategy", bases: tuple[type, ...] = ()) -> Any:
    """A Lightning Trainer with what the real one builds in its constructor and resilrun uses."""

    class Connector:
        def dump_checkpoint(self, weights_only: bool | None = None) -> dict[str, Any]:
            return {}

    class EpochLoop:
        batch_progress = type("Progress", (), {"current": type("Counts", (), {"completed": 0})()})()

        def on_advance_end(self) -> None: ...

    def load_checkpoint(self: Any, checkpoint_path: str) -> dict[str, Any]:
        return {}

    trainer = trainer_class()
    trainer.strategy = type(strategy, bases, {"load_checkpoint": load_checkpoint, "_timeout": timedelta(minutes=3)})()
    trainer.fit_loop = type("FitLoop", (), {"_combined_loader": None, "epoch_loop": EpochLoop()})()
    trainer._checkpoint_connector = Connector()
    return trainer
