"""Hugging Face ``transformers.Trainer`` under resilrun: an unmodified Trainer script recovers in-process.

What changes under resilrun (nothing changes elsewhere):
- ``TrainingArguments`` joins the job through ``resilrun.init()`` when it sets up its devices, just
  before Accelerate would create the process group itself, so the group is resilrun's: guarded
  while it forms, aborted when a peer fails. Accelerate finds it initialised and uses it.
- ``Trainer.train`` agrees with every rank on the newest step they all hold; a callback snapshots
  the model, optimizer, LR scheduler, grad scaler, random generators and ``TrainerState`` after
  every optimizer step into resilrun's tiers.
- A recovered generation resumes through the Trainer's own ``resume_from_checkpoint`` path, so
  the epoch, the batches to skip, the callbacks' state and the order of random draws follow the
  Trainer's rules; where it would read its checkpoint files, it is handed the restored state.
  A checkpoint the script asks to resume from is still honoured on a fresh start.

Not integrated (the job then restarts on failure, as under torchrun, with a warning): the Trainer
with DeepSpeed or FSDP, and transformers versions outside ``SUPPORTED``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import ModuleType
from typing import Any

from resilrun.integrations import _framework_compat as compat
from resilrun.integrations._support import GENERATION, forget_on_reentry, outside

logger = logging.getLogger(__name__)

# The versions this integration is tested with (docs: docs/integrations.md; the optional extra pins them).
SUPPORTED = ((5, 0), (6, 0))
_ADAPTED = "__resilrun_adapted__"


def adapt_training_arguments(module: ModuleType) -> None:
    """Make ``TrainingArguments`` join resilrun's job before Accelerate sets up the process group."""
    arguments = module.TrainingArguments
    if getattr(arguments, _ADAPTED, False) or _unsupported(module) is not None:
        return
    reason = compat.lacks("transformers", compat.training_arguments_lack(arguments))
    if reason is not None:
        logger.warning(
            "resilrun: %s; Accelerate creates the process group (recovery still works, a stuck setup is not guarded)",
            reason,
        )
        return

    def joining_first(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def _setup_devices(self: Any) -> Any:
            if _joins(self):
                from resilrun.worker import membership

                backend = self.ddp_backend or ("gloo" if self.use_cpu else None)
                membership.init(backend=backend, timeout=timedelta(seconds=self.ddp_timeout))
            return original(self)

        return _setup_devices

    compat.wrap_setup_devices(arguments, joining_first)
    setattr(arguments, _ADAPTED, True)


def adapt_trainer(module: ModuleType) -> None:
    """Make ``Trainer.train`` resume from resilrun's snapshots and snapshot every optimizer step."""
    trainer_class = module.Trainer
    if getattr(trainer_class, _ADAPTED, False):
        return
    reason = _unsupported(module)
    if reason is not None:
        logger.warning("resilrun: %s; a failure restarts the job (the Trainer is left as it is)", reason)
        return
    original = trainer_class.train

    @functools.wraps(original)
    def train(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if not _joins(self.args):
            return original(self, resume_from_checkpoint, *args, **kwargs)
        reason = compat.lacks("transformers", compat.trainer_instance_lacks(self))
        if reason is not None:
            logger.warning("resilrun: %s; a failure restarts the job", reason)
            return original(self, resume_from_checkpoint, *args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return original(self, resume_from_checkpoint, *args, **kwargs)
        if not GENERATION.claim("Trainer.train()"):
            return original(self, resume_from_checkpoint, *args, **kwargs)
        return _Session(self).train(functools.partial(original, self), resume_from_checkpoint, args, kwargs)

    trainer_class.train = train
    setattr(trainer_class, _ADAPTED, True)
    _forget_accelerate_state_on_reentry()


def install() -> bool:
    """Adapt transformers now (a script's explicit opt-in; under resilrun the bootstrap does it)."""
    import transformers.trainer
    import transformers.training_args

    adapt_training_arguments(transformers.training_args)
    adapt_trainer(transformers.trainer)
    return bool(getattr(transformers.trainer.Trainer, _ADAPTED, False))


def _unsupported(module: ModuleType) -> str | None:
    """Why this transformers cannot be integrated, or None."""
    import transformers

    reason = outside("transformers", getattr(transformers, "__version__", ""), SUPPORTED)
    if reason is not None or not hasattr(module, "Trainer"):
        return reason
    return compat.lacks("transformers", compat.trainer_lacks(module))


def _joins(args: Any) -> bool:
    """Whether these arguments' process joins resilrun's job (a resilrun worker, not DeepSpeed/FSDP)."""
    from resilrun.integrations import enabled

    return enabled() and not getattr(args, "deepspeed", None) and not getattr(args, "fsdp", None)


def _forget_accelerate_state_on_reentry() -> None:
    """The next run of the script builds new TrainingArguments (which reset Accelerate's process
    state themselves) but inherits ``GradientState``, which still points at the old data loaders."""
    from resilrun.worker import membership

    membership.on_reentry(compat.reset_gradient_state)
    forget_on_reentry()


class _Session:
    """One ``Trainer.train`` call under resilrun."""

    def __init__(self, trainer: Any) -> None:
        from resilrun.integrations._held import HeldRestore
        from resilrun.worker import membership

        self.trainer = trainer
        self.job = membership.init()  # joined already when the arguments set up their devices
        self.names = ["model", "optimizer", "lr_scheduler"]
        if getattr(trainer.accelerator, "scaler", None) is not None:
            self.names.append("scaler")
        self.held = HeldRestore(self.job, self.names)

    def train(
        self, original: Callable[..., Any], checkpoint: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        step = self.held.resume()
        callback = _callback_class()(self)
        self.trainer.add_callback(callback)
        try:
            if step < 0:
                return original(checkpoint, *args, **kwargs)
            if checkpoint not in (None, False):
                logger.warning(
                    "resilrun resumes from its snapshot of step %d, not from the checkpoint passed to train()", step
                )
            with self._resumed_at(step) as directory:
                return original(directory, *args, **kwargs)
        finally:
            self.trainer.remove_callback(callback)

    @contextmanager
    def _resumed_at(self, step: int) -> Iterator[str]:
        """A checkpoint directory holding only the Trainer's state, and the loaders that stand in
        for the files it lacks: the Trainer resumes at ``step`` through its own resume path."""
        try:
            state = self.job["trainer_state"]
        except KeyError:
            raise RuntimeError(
                f"resilrun's snapshot of step {step} holds no Trainer state (written by another kind of script?)"
            ) from None
        directory = tempfile.mkdtemp(prefix="resilrun-trainer-")
        trainer = self.trainer
        try:
            with open(os.path.join(directory, compat.trainer_state_file()), "w", encoding="utf-8") as handle:
                handle.write(state)
            compat.redirect_trainer_loaders(
                trainer,
                directory,
                {
                    "model": self._load_model,
                    "optimizer": self._load_optimizer,
                    "scaler": self._load_scaler,
                    "rng": self.held.restore_rng,
                },
            )
            yield directory
        finally:
            compat.restore_trainer_loaders(trainer)
            shutil.rmtree(directory, ignore_errors=True)

    def _load_model(self) -> None:
        self.held.load_into("model", self.trainer.model)

    def _load_optimizer(self) -> None:
        self.held.load_into("optimizer", self.trainer.optimizer)
        self.held.load_into("lr_scheduler", self.trainer.lr_scheduler)

    def _load_scaler(self) -> None:
        if self.held.has("scaler"):
            self.held.load_into("scaler", self.trainer.accelerator.scaler)

    # -- what the callback does ------------------------------------------------------------------
    def track_live_objects(self) -> None:
        """The loop starts: from now on the real objects are snapshotted under the held names."""
        trainer = self.trainer
        objects = {"model": trainer.model, "optimizer": trainer.optimizer, "lr_scheduler": trainer.lr_scheduler}
        if "scaler" in self.names:
            objects["scaler"] = trainer.accelerator.scaler
        self.job.track(**objects)
        from resilrun.worker.job import fix_bucket_layouts

        fix_bucket_layouts([trainer.model_wrapped])

    def commit(self, state: Any) -> None:
        """An optimizer step is done: snapshot it with the Trainer's state as its own checkpoint has it."""
        state.stateful_callbacks.update(compat.exported_callback_states(self.trainer))
        # What TrainerState.save_to_json writes (its own format, read back by load_from_json).
        self.job["trainer_state"] = json.dumps(dataclasses.asdict(state), sort_keys=True)
        self.job.commit(state.global_step - 1)


@functools.cache
def _callback_class() -> type:
    """Built on first use: ``TrainerCallback`` comes from transformers, imported by then."""

    class ResilrunCallback(compat.trainer_callback_base()):  # type: ignore[misc]  # a class known at run time
        """Snapshots after every optimizer step; the step numbers are the Trainer's (0-based)."""

        def __init__(self, session: _Session) -> None:
            self._session = session

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._session.track_live_objects()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._session.job.begin(state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._session.commit(state)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._session.job.finish()

    return ResilrunCallback
