"""Every framework internal the integrations touch is probed first (integrations/_framework_compat.py):
a framework that lacks one is left exactly as it is, with one warning naming its version and what it
lacks, and the script runs as under torchrun; with every internal there, the integration is installed.

The probes run on fakes (tests/unit/fake_frameworks.py) that lack one piece at a time, and once on
the frameworks installed here, the versions docs/integrations.md names.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from resilrun.integrations import _framework_compat as compat
from resilrun.integrations import _support as support
from resilrun.integrations import accelerate as acc
from resilrun.integrations import lightning as lit
from resilrun.integrations import transformers as hf
from resilrun.worker import membership
from tests.unit import fake_frameworks as fake

_ADAPTED = "__resilrun_adapted__"


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adapting registers re-entry hooks and claims trainings process-wide: keep both to one test."""
    monkeypatch.setattr(membership, "_REENTRY_HOOKS", [])
    generation = support.Generation()
    for module in (support, hf, lit, acc):
        monkeypatch.setattr(module, "GENERATION", generation)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("resilrun") and r.levelno == logging.WARNING]


def _replace(module: str, owner: str, name: str, value: Any) -> Callable[[pytest.MonkeyPatch], None]:
    """A breakage: ``sys.modules[module].<owner>.<name>`` set to ``value`` (None: deleted)."""

    def breaks(monkeypatch: pytest.MonkeyPatch) -> None:
        target = getattr(sys.modules[module], owner) if owner else sys.modules[module]
        if value is None:
            monkeypatch.delattr(target, name)
        else:
            monkeypatch.setattr(target, name, value)

    return breaks


# -- Accelerate ----------------------------------------------------------------------------------------
def test_an_accelerate_with_every_probed_internal_is_adapted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    module = fake.accelerate(monkeypatch)
    state, loaders = sys.modules["accelerate.state"], sys.modules["accelerate.data_loader"]
    before = (module.Accelerator.prepare, state.PartialState.__init__, loaders.DataLoaderShard.__iter__)
    with caplog.at_level(logging.WARNING):
        acc.adapt_accelerator(module)
    assert _warnings(caplog) == []
    assert getattr(module.Accelerator, _ADAPTED)
    after = (module.Accelerator.prepare, state.PartialState.__init__, loaders.DataLoaderShard.__iter__)
    assert all(new is not old for new, old in zip(after, before, strict=True))
    assert membership._REENTRY_HOOKS  # Accelerate's singletons are reset when the script runs again


@pytest.mark.parametrize(
    ("breaks", "named"),
    [
        (_replace("accelerate.state", "GradientState", "_reset_state", None), "GradientState._reset_state"),
        (
            _replace("accelerate.state", "AcceleratorState", "_reset_state", staticmethod(lambda: None)),
            "AcceleratorState._reset_state(reset_partial_state)",
        ),
        (
            _replace("accelerate.state", "PartialState", "__init__", lambda self, device=None: None),
            "PartialState.__init__(cpu, backend, timeout)",
        ),
        (
            _replace("accelerate.data_loader", "DataLoaderDispatcher", "set_epoch", None),
            "DataLoaderDispatcher.set_epoch",
        ),
        (_replace("accelerate.accelerator", "Accelerator", "load_state", None), "Accelerator.load_state"),
    ],
)
def test_an_accelerate_lacking_an_internal_is_left_alone_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    breaks: Callable[[pytest.MonkeyPatch], None],
    named: str,
) -> None:
    # Given an Accelerate in the tested range that lacks one internal resilrun uses
    module = fake.accelerate(monkeypatch)
    breaks(monkeypatch)
    prepare, init = module.Accelerator.prepare, sys.modules["accelerate.state"].PartialState.__init__
    # When the script imports it
    with caplog.at_level(logging.WARNING):
        acc.adapt_accelerator(module)
    # Then nothing of it is touched, and one line says which version lacks what
    assert module.Accelerator.prepare is prepare
    assert sys.modules["accelerate.state"].PartialState.__init__ is init
    assert not getattr(module.Accelerator, _ADAPTED, False)
    assert _warnings(caplog) == [
        f"resilrun: accelerate 1.15.0 lacks {named} as resilrun uses it; a failure restarts the job "
        "(Accelerate is left as it is)"
    ]


def test_an_accelerator_without_its_prepared_lists_is_not_snapshotted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake.accelerate(monkeypatch)
    accelerator = type("Accelerator", (), {})()
    accelerator.distributed_type = type("DistributedType", (), {"name": "MULTI_CPU"})()
    for kind in ("models", "optimizers", "schedulers", "dataloaders"):
        setattr(accelerator, f"_{kind}", [])
    with caplog.at_level(logging.WARNING):
        assert acc._open_session(accelerator) is None
    assert _warnings(caplog) == [
        "resilrun: accelerate 1.15.0 lacks Accelerator._custom_objects as resilrun uses it; a failure restarts the job"
    ]
    assert support.GENERATION.claim("a later training")  # the failed probe claimed nothing


# -- transformers ----------------------------------------------------------------------------------------
def test_a_transformers_with_every_probed_internal_is_adapted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    module = fake.transformers(monkeypatch)
    arguments = sys.modules["transformers.training_args"].TrainingArguments
    train = module.Trainer.train
    with caplog.at_level(logging.WARNING):
        hf.adapt_training_arguments(sys.modules["transformers.training_args"])
        hf.adapt_trainer(module)
    assert _warnings(caplog) == []
    assert module.Trainer.train is not train
    setup = arguments.__dict__["_setup_devices"]
    assert isinstance(setup, functools.cached_property) and setup.attrname == "_setup_devices"
    monkeypatch.delenv("RESILRUN_AGENT_SOCKET", raising=False)
    assert arguments()._setup_devices == "cpu"  # outside a resilrun worker: the framework's own set-up
    assert list(membership._REENTRY_HOOKS) == [compat.reset_gradient_state, support.GENERATION.forget]


def _trainer_state_without_callbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    state = type("TrainerState", (), {"__dataclass_fields__": {}})
    monkeypatch.setattr(sys.modules["transformers.trainer_callback"], "TrainerState", state)


@pytest.mark.parametrize(
    ("breaks", "named"),
    [
        (_replace("transformers.trainer", "", "TRAINER_STATE_NAME", None), "transformers.trainer.TRAINER_STATE_NAME"),
        (_replace("transformers.trainer_callback", "", "ExportableState", None), "ExportableState"),
        (
            _replace("transformers.trainer_callback", "TrainerCallback", "on_step_end", None),
            "TrainerCallback.on_step_end",
        ),
        (
            _replace("transformers.trainer", "Trainer", "train", lambda self, checkpoint=None: None),
            "Trainer.train(resume_from_checkpoint)",
        ),
        (_replace("transformers.trainer", "Trainer", "_load_rng_state", lambda self: None), "Trainer._load_rng_state"),
        (
            _replace("accelerate.state", "GradientState", "_reset_state", None),
            "accelerate's GradientState._reset_state",
        ),
        (_trainer_state_without_callbacks, "TrainerState.global_step, TrainerState.stateful_callbacks"),
    ],
)
def test_a_transformers_lacking_an_internal_is_left_alone_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    breaks: Callable[[pytest.MonkeyPatch], None],
    named: str,
) -> None:
    module = fake.transformers(monkeypatch, trainer=type("Trainer", (fake.Trainer,), {}))
    breaks(monkeypatch)
    train = module.Trainer.train
    with caplog.at_level(logging.WARNING):
        hf.adapt_trainer(module)
    assert module.Trainer.train is train
    assert _warnings(caplog) == [
        f"resilrun: transformers 5.23.0 lacks {named} as resilrun uses it; a failure restarts the job "
        "(the Trainer is left as it is)"
    ]
    assert list(membership._REENTRY_HOOKS) == []


def test_training_arguments_without_their_cached_device_setup_leave_the_group_to_accelerate(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake.transformers(monkeypatch)
    module = sys.modules["transformers.training_args"]
    monkeypatch.setattr(module.TrainingArguments, "_setup_devices", property(lambda self: "cpu"))
    setup = module.TrainingArguments.__dict__["_setup_devices"]
    with caplog.at_level(logging.WARNING):
        hf.adapt_training_arguments(module)
    assert module.TrainingArguments.__dict__["_setup_devices"] is setup
    assert _warnings(caplog) == [
        "resilrun: transformers 5.23.0 lacks TrainingArguments._setup_devices (a cached_property) as resilrun "
        "uses it; Accelerate creates the process group (recovery still works, a stuck setup is not guarded)"
    ]


def test_a_trainer_built_without_what_resilrun_reads_trains_as_the_frameworks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an adapted Trainer in a resilrun worker, built by a transformers that sets no callback handler
    module = fake.transformers(monkeypatch, trainer=type("Trainer", (fake.Trainer,), {}))
    hf.adapt_trainer(module)
    monkeypatch.setenv("RESILRUN_AGENT_SOCKET", "/run/agent.sock")
    monkeypatch.delenv("RESILRUN_NO_INTEGRATIONS", raising=False)
    trainer = fake.trainer_instance(module.Trainer)
    del trainer.callback_handler
    # When the script trains, Then the framework's own train runs, and one line says why
    with caplog.at_level(logging.WARNING):
        assert trainer.train() == "the framework's own train"
    assert _warnings(caplog) == [
        "resilrun: transformers 5.23.0 lacks Trainer.callback_handler as resilrun uses it; a failure restarts the job"
    ]
    assert support.GENERATION.claim("a later training")


def test_a_redirected_trainer_is_handed_the_held_state_for_its_own_directory_only() -> None:
    read: list[str] = []

    class Trainer(fake.Trainer):
        def _load_scaler(self, checkpoint: str | None) -> None:
            read.append(f"file in {checkpoint}")

    trainer = Trainer()
    loads = {what: (lambda what=what: read.append(f"held {what}")) for what in ("model", "optimizer", "scaler", "rng")}
    compat.redirect_trainer_loaders(trainer, "/tmp/held", loads)  # type: ignore[arg-type]  # the four loads
    trainer._load_scaler("/tmp/held")
    trainer._load_scaler("/checkpoints/step-10")
    compat.restore_trainer_loaders(trainer)
    trainer._load_scaler("/tmp/held")
    assert read == ["held scaler", "file in /checkpoints/step-10", "file in /tmp/held"]
    assert "_load_scaler" not in vars(trainer)


# -- Lightning -----------------------------------------------------------------------------------------
def test_a_lightning_with_every_probed_internal_is_adapted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    module = fake.lightning(monkeypatch)
    combined = sys.modules["lightning.pytorch.utilities.combined_loader"].CombinedLoader
    fit, iterate = module.Trainer.fit, combined.__iter__
    with caplog.at_level(logging.WARNING):
        lit.adapt_trainer(module)
    assert _warnings(caplog) == []
    assert module.Trainer.fit is not fit and combined.__iter__ is not iterate


@pytest.mark.parametrize(
    ("breaks", "named"),
    [
        (
            _replace("lightning.pytorch.trainer.trainer", "Trainer", "fit", lambda self, model: None),
            "Trainer.fit(ckpt_path)",
        ),
        (
            _replace("lightning.pytorch.utilities.combined_loader", "CombinedLoader", "__next__", None),
            "CombinedLoader.__next__",
        ),
        (
            _replace("lightning.pytorch.callbacks", "Callback", "on_train_batch_start", None),
            "Callback.on_train_batch_start",
        ),
        (_replace("lightning.pytorch.callbacks", "", "Callback", None), "lightning.pytorch.callbacks.Callback"),
        (_replace("lightning.pytorch.strategies", "Strategy", "load_checkpoint", None), "Strategy.load_checkpoint"),
    ],
)
def test_a_lightning_lacking_an_internal_is_left_alone_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    breaks: Callable[[pytest.MonkeyPatch], None],
    named: str,
) -> None:
    module = fake.lightning(monkeypatch)
    breaks(monkeypatch)
    combined = sys.modules["lightning.pytorch.utilities.combined_loader"].CombinedLoader
    fit, iterate = module.Trainer.fit, combined.__iter__
    with caplog.at_level(logging.WARNING):
        lit.adapt_trainer(module)
    assert module.Trainer.fit is fit and combined.__iter__ is iterate
    assert _warnings(caplog) == [
        f"resilrun: lightning.pytorch 2.6.0 lacks {named} as resilrun uses it; a failure restarts the job "
        "(the Trainer is left as it is)"
    ]


def test_a_lightning_trainer_built_without_what_resilrun_uses_fits_as_lightnings(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an adapted Trainer in a resilrun worker, built by a Lightning without a checkpoint connector
    module = fake.lightning(monkeypatch)
    lit.adapt_trainer(module)
    monkeypatch.setenv("RESILRUN_AGENT_SOCKET", "/run/agent.sock")
    monkeypatch.delenv("RESILRUN_NO_INTEGRATIONS", raising=False)
    trainer = fake.lightning_instance(module.Trainer)
    del trainer._checkpoint_connector
    # When the script fits, Then Lightning's own fit runs, and one line says why
    with caplog.at_level(logging.WARNING):
        assert trainer.fit(object()) == "the framework's own fit"
    assert _warnings(caplog) == [
        "resilrun: lightning.pytorch 2.6.0 lacks Trainer._checkpoint_connector.dump_checkpoint(weights_only) as "
        "resilrun uses it; a failure restarts the job"
    ]
    assert support.GENERATION.claim("a later training")


def test_a_lightning_trainer_with_everything_resilrun_uses_is_integrated(monkeypatch: pytest.MonkeyPatch) -> None:
    fake.lightning(monkeypatch)
    monkeypatch.setenv("RESILRUN_AGENT_SOCKET", "/run/agent.sock")
    monkeypatch.delenv("RESILRUN_NO_INTEGRATIONS", raising=False)
    trainer = fake.lightning_instance(fake.LightningTrainer)
    assert lit._not_integrated(trainer, "lightning.pytorch") is None
    assert compat.strategy_timeout(trainer.strategy) == timedelta(minutes=3)
    assert compat.fit_data(trainer) is None  # not built before fit


# -- the frameworks installed here ---------------------------------------------------------------------
@pytest.mark.parametrize("framework", ["accelerate", "transformers", "lightning"])
def test_every_probe_holds_on_the_installed_framework(framework: str) -> None:
    pytest.importorskip(framework)
    if framework == "accelerate":
        assert compat.accelerate_lacks(importlib.import_module("accelerate.accelerator").Accelerator) == []
    elif framework == "transformers":
        assert compat.trainer_lacks(importlib.import_module("transformers.trainer")) == []
        arguments = importlib.import_module("transformers.training_args").TrainingArguments
        assert compat.training_arguments_lack(arguments) == []
    else:
        trainer_class = importlib.import_module("lightning.pytorch.trainer.trainer").Trainer
        assert compat.lightning_lacks("lightning.pytorch", trainer_class) == []
        trainer = trainer_class(
            accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, max_steps=1
        )
        assert compat.lightning_instance_lacks(trainer) == []
