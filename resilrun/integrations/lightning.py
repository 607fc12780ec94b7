"""PyTorch Lightning under resilrun: an unmodified ``Trainer.fit`` script recovers in-process.

What changes under resilrun (nothing changes elsewhere):
- ``Trainer.fit`` joins the job through ``resilrun.init()`` before the strategy would create the
  process group (Lightning finds it initialised and uses it), and agrees with every rank on the
  newest step they all hold.
- After every batch that stepped the optimizers, once Lightning has finished that batch (LR
  schedulers stepped, validation run, counters advanced), the state Lightning itself would write
  to a checkpoint is snapshotted into resilrun's tiers, with the random generators.
- A recovered generation resumes through Lightning's own ``ckpt_path`` path, handed the restored
  state where it would read the file: model, optimizers, schedulers, precision plugin, callbacks
  and loop counters follow Lightning's rules. A checkpoint the script passes is honoured on a
  fresh start.
- Data position: Lightning restarts a plain ``DataLoader`` at the start of the epoch. Here the
  resumed epoch's iterator is rebuilt exactly as the failure-free run built it (same sampler
  epoch, same random state when it was made, so the same shuffle and worker seeds), the batches
  already trained on are drawn and dropped (so workers' random streams are where they were), and
  the step's random state is set again before the next batch. A loader that keeps its own
  position (torchdata's ``StatefulDataLoader``) is restored by Lightning from the snapshot instead.

Not integrated (the job then restarts on failure, as under torchrun, with a warning): strategies
other than DDP and single-device (FSDP, DeepSpeed), a second ``fit`` in one run, and Lightning
versions outside ``SUPPORTED``. Known limit: a dataset that draws from torch's generator in the
training process itself (``num_workers=0`` with random transforms) draws the batch after the
resumed step from another point of the stream.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

from resilrun.integrations import _framework_compat as compat
from resilrun.integrations._support import GENERATION, forget_on_reentry, outside

logger = logging.getLogger(__name__)

# The versions this integration is tested with (docs: docs/integrations.md; the optional extra pins them).
SUPPORTED = ((2, 5), (3, 0))
# Lightning is handed this as ``ckpt_path`` on a resume; its checkpoint loader returns the restored state.
HELD_PATH = "resilrun-snapshot"
# Checkpoint entries a resume does not read (hyperparameters are for load_from_checkpoint), and
# which may hold objects a snapshot cannot: left out of every snapshot.
_OMITTED = (
    "hyper_parameters",
    "hparams_name",
    "hparams_type",
    "datamodule_hyper_parameters",
    "datamodule_hparams_name",
)
_STRATEGIES = frozenset({"DDPStrategy", "SingleDeviceStrategy"})
_ADAPTED = "__resilrun_adapted__"
_EPOCH_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


def adapt_trainer(module: ModuleType) -> None:
    """Make ``Trainer.fit`` resume from resilrun's snapshots and snapshot every optimizer step."""
    trainer_class = module.Trainer
    if getattr(trainer_class, _ADAPTED, False):
        return
    package = module.__name__.rsplit(".trainer.trainer", 1)[0]  # lightning.pytorch or pytorch_lightning
    reason = _unsupported(package) or compat.lacks(package, compat.lightning_lacks(package, trainer_class))
    if reason is not None:
        logger.warning("resilrun: %s; a failure restarts the job (the Trainer is left as it is)", reason)
        return
    _adapt_combined_loader(compat.combined_loader_class(package))
    original = trainer_class.fit
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        reason = _not_integrated(self, package)
        if reason is not None or not GENERATION.claim("Trainer.fit()"):
            if reason:
                logger.warning("resilrun: %s; a failure restarts the job", reason)
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        return _Session(self, package).fit(original, bound)

    trainer_class.fit = fit
    setattr(trainer_class, _ADAPTED, True)
    forget_on_reentry()


def install() -> bool:
    """Adapt Lightning now (a script's explicit opt-in; under resilrun the bootstrap does it)."""
    adapted = False
    for name in ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        adapt_trainer(module)
        adapted |= bool(getattr(module.Trainer, _ADAPTED, False))
    return adapted


def _unsupported(package: str) -> str | None:
    """Why this Lightning cannot be integrated, or None."""
    top = package.split(".")[0]
    return outside(top, getattr(importlib.import_module(top), "__version__", ""), SUPPORTED)


def _not_integrated(trainer: Any, package: str) -> str | None:
    """Why this ``fit`` runs as Lightning has it: None to integrate, "" to say nothing."""
    from resilrun.integrations import enabled

    if not enabled():
        return ""
    classes = {cls.__name__ for cls in type(trainer.strategy).__mro__}
    if "DeepSpeedStrategy" in classes or not classes & _STRATEGIES:
        return f"the {type(trainer.strategy).__name__} is not integrated (DDP and single-device are)"
    return compat.lacks(package, compat.lightning_instance_lacks(trainer))


@dataclasses.dataclass
class _Position:
    """Where the resumed epoch's data stood: its sampler epoch, the random state its iterator was
    made with, and how many of its batches were trained on."""

    epoch: int
    rng: dict[str, Any]
    batches: int


class _Active:
    """The ``fit`` under way in this process, for the data iterator hook."""

    session: _Session | None = None


def _adapt_combined_loader(combined_loader: type) -> None:
    if getattr(combined_loader, _ADAPTED, False):
        return
    original = combined_loader.__iter__

    @functools.wraps(original)
    def __iter__(self: Any) -> Any:  # noqa: N807 - the method it wraps
        session = _Active.session
        if session is None or self is not compat.fit_data(session.trainer):
            return original(self)
        return session.iterate(self, original)

    combined_loader.__iter__ = __iter__
    setattr(combined_loader, _ADAPTED, True)


class _Session:
    """One ``Trainer.fit`` call under resilrun."""

    def __init__(self, trainer: Any, package: str) -> None:
        from resilrun.integrations._held import HeldRestore
        from resilrun.worker import membership

        self.trainer = trainer
        self.package = package
        self.job = membership.init(timeout=compat.strategy_timeout(trainer.strategy))
        self.held = HeldRestore(self.job, ["lightning"])
        self.epoch_rng: dict[str, Any] | None = None  # when the running epoch's data iterator was made
        self.position: _Position | None = None  # where a resumed epoch's data must start
        self.rng_due = False  # the resumed step's random state is set again before the next batch
        self.begun = self.committed = -1

    def fit(self, original: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
        trainer = self.trainer
        step = self.held.resume()
        checkpoint = None
        if step >= 0:
            checkpoint = self.held.take("lightning")
            ours = checkpoint.pop("resilrun")
            self.position = _Position(int(ours["epoch"]), ours["epoch_rng"], int(ours["batches"]))
            self.committed = step
            if bound.arguments.get("ckpt_path") not in (None, HELD_PATH):
                logger.warning(
                    "resilrun resumes from its snapshot of step %d, not from the ckpt_path passed to fit()", step
                )
            bound.arguments["ckpt_path"] = HELD_PATH
        strategy, epoch_loop = trainer.strategy, trainer.fit_loop.epoch_loop
        strategy.load_checkpoint = self._loader(strategy.load_checkpoint, checkpoint)
        epoch_loop.on_advance_end = self._committing(epoch_loop.on_advance_end)
        callback = _callback_class(self.package)(self)
        trainer.callbacks.append(callback)
        _Active.session = self
        try:
            with warnings.catch_warnings():
                # Lightning warns that a plain DataLoader restarts its epoch; here it does not.
                warnings.filterwarnings("ignore", message=_EPOCH_WARNING)
                return original(*bound.args, **bound.kwargs)
        finally:
            _Active.session = None
            if callback in trainer.callbacks:
                trainer.callbacks.remove(callback)
            epoch_loop.__dict__.pop("on_advance_end", None)
            strategy.__dict__.pop("load_checkpoint", None)

    def _loader(self, load: Callable[..., Any], checkpoint: dict[str, Any] | None) -> Callable[..., Any]:
        def load_checkpoint(path: Any, *args: Any, **kwargs: Any) -> Any:
            if path == HELD_PATH and checkpoint is not None:
                return checkpoint
            return load(path, *args, **kwargs)

        return load_checkpoint

    def _committing(self, on_advance_end: Callable[..., Any]) -> Callable[..., Any]:
        def after_batch(*args: Any, **kwargs: Any) -> Any:
            result = on_advance_end(*args, **kwargs)
            step = self.trainer.global_step - 1
            if step > self.committed:  # this batch stepped the optimizers (not an accumulating one)
                self.committed = step
                self.job.commit(step)
            return result

        return after_batch

    # -- the data iterator of each epoch -----------------------------------------------------------
    def iterate(self, loader: Any, make: Callable[[Any], Any]) -> Any:
        """Make the training data iterator; on a resume, where the failure-free run's stood."""
        from resilrun.worker.rng import RngState

        position, self.position = self.position, None
        if position is not None:
            _set_sampler_epoch(loader, position.epoch)
            RngState().load_state_dict(position.rng)
        self.epoch_rng = RngState().state_dict()
        made = make(loader)
        if position is None:
            return made
        exhausted = position.batches >= _length(loader)
        if not _resumable(loader):
            # (a resumable loader, torchdata's StatefulDataLoader, had its own state loaded by
            # Lightning from the snapshot just before: it starts where it stood by itself)
            for _ in range(position.batches):
                try:
                    next(loader)
                except StopIteration:
                    exhausted = True
                    break
        if exhausted:
            # The snapshot was the epoch's last batch: the next thing that draws random numbers is
            # the next epoch's iterator, which must see the step's random state as it did then.
            self.held.restore_rng()
        else:
            self.rng_due = True
        return made

    # -- what the callback does --------------------------------------------------------------------
    def track_live(self) -> None:
        """Training starts, the restored state loaded: from now on the live state is snapshotted."""
        from resilrun.integrations._held import LiveState
        from resilrun.worker.job import fix_bucket_layouts

        self.job.track(lightning=LiveState(self.checkpoint, "Lightning's state is restored through fit(ckpt_path=...)"))
        fix_bucket_layouts([self.trainer.strategy.model])

    def before_batch(self) -> None:
        if self.rng_due:
            self.rng_due = False
            self.held.restore_rng()
        step = self.trainer.global_step
        if step != self.begun:
            self.begun = step
            self.job.begin(step)

    def checkpoint(self) -> dict[str, Any]:
        """What Lightning would write to a checkpoint now, and where the epoch's data stands."""
        trainer = self.trainer
        state = compat.lightning_checkpoint(trainer)
        for key in _OMITTED:
            state.pop(key, None)
        state["resilrun"] = {
            "epoch": trainer.current_epoch,
            "epoch_rng": self.epoch_rng,
            "batches": trainer.fit_loop.epoch_loop.batch_progress.current.completed,
        }
        return state


def _length(loader: Any) -> float:
    """Batches in the epoch of the iterator just made (Lightning's own count is not known yet
    then); infinite when the loader cannot tell (an iterable dataset)."""
    try:
        return len(loader)
    except (TypeError, RuntimeError, NotImplementedError):
        return float("inf")


def _resumable(loader: Any) -> bool:
    """Whether every data loader of the combined one keeps its own position, as Lightning checks
    before it saves and loads their state (``state_dict``/``load_state_dict``)."""
    return all(
        callable(getattr(data, "state_dict", None)) and callable(getattr(data, "load_state_dict", None))
        for data in getattr(loader, "flattened", [loader])
    )


def _set_sampler_epoch(loader: Any, epoch: int) -> None:
    """What Lightning does before each epoch's iterator, done before the resumed one's is made."""
    for data in getattr(loader, "flattened", [loader]):
        for sampler in (getattr(data, "sampler", None), getattr(getattr(data, "batch_sampler", None), "sampler", None)):
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)


@functools.cache
def _callback_class(package: str) -> type:
    """Built on first use: ``Callback`` comes from the Lightning the script imported."""

    class ResilrunCallback(compat.lightning_callback_base(package)):  # type: ignore[misc]  # known at run time
        """Starts each optimizer step for resilrun (the step numbers are Lightning's global_step)."""

        def __init__(self, session: _Session) -> None:
            self._session = session

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._session.track_live()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._session.before_batch()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._session.job.finish()

    return ResilrunCallback
