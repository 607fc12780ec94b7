"""Hugging Face Accelerate under resilrun: a hand-written ``accelerator.prepare`` loop recovers in-process.

What changes under resilrun (nothing changes elsewhere):
- Accelerate's process state joins the job through ``resilrun.init()`` before Accelerate would
  create the process group itself, so the group is resilrun's: guarded while it forms, aborted
  when a peer fails. Accelerate finds it initialised and uses it.
- The first time a prepared data loader is iterated, every rank agrees on the newest step they
  all hold (a point every rank reaches together).
- The optimizer steps are counted (a post-step hook on each prepared optimizer). A step is
  complete when the training loader is asked for its next batch after it (the script has
  stepped its scheduler, zeroed its gradients, logged): it is snapshotted then, with every
  prepared model, optimizer and scheduler, the grad scaler, the objects registered with
  ``register_for_checkpointing``, ``accelerator.step``, the random generators and where the
  training loader stands.
- A recovered generation runs the script again from its first line (survivors in-process, the
  spare fresh). The epochs the training loader had finished yield no batches; the resumed one is
  rebuilt as the failure-free run built it (the global random state and the loader's own
  generators as they were at its start: same shuffle, same worker seeds), its trained batches are
  drawn and dropped, and the snapshot is loaded into the live objects just before, so what the
  script did in the empty epochs (an epoch-based scheduler step, an evaluation) is overwritten.
  Their saves through Accelerate (``save_state``, ``save_model``, ``save``) are skipped: the
  failure-free run made them, and the objects do not hold the resumed state yet.

Known limits (docs/integrations.md): what the script does once per epoch outside the training
loader (an evaluation) runs again for each finished epoch as the loop is replayed, on the objects
as the script built them; counters the script keeps itself restart at zero, so a loop bounded by
epochs resumes exactly, while one that stops at its own step count trains that many steps again
from the resumed step; a dataset drawing random numbers in the training process itself
(``num_workers=0`` with random transforms) draws differently after the resumed step; the last
step of a loop left with ``break`` is snapshotted only by the next batch request, so a failure
after it redoes it; a run whose script loads its own checkpoint (``load_state``) resumes from it,
as under torchrun, and is not snapshotted. Not integrated (the job then restarts on failure, as
under torchrun, with a warning): FSDP, DeepSpeed and Megatron-LM, accelerators a framework creates
(the Transformers Trainer has its own integration), and Accelerate versions outside ``SUPPORTED``.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from collections.abc import Callable
from datetime import timedelta
from types import ModuleType
from typing import Any

from resilrun.env import any_set_true
from resilrun.integrations import _framework_compat as compat
from resilrun.integrations._accelerate_loop import Loop
from resilrun.integrations._support import GENERATION, forget_on_reentry, outside

logger = logging.getLogger(__name__)

# The versions this integration is tested with (docs: docs/integrations.md; the optional extra pins them).
SUPPORTED = ((1, 0), (2, 0))
_DISTRIBUTED_TYPES = frozenset({"NO", "MULTI_CPU", "MULTI_GPU"})
_NOT_INTEGRATED_ENV = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM")
# Modules whose code creates an Accelerator for a loop it owns (and integrates itself, or not at all).
_FRAMEWORKS = ("transformers.", "trl.", "lightning.", "pytorch_lightning.")
_ADAPTED = "__resilrun_adapted__"
# What the script saves through Accelerate: not saved again while finished epochs are replayed.
_SAVES = ("save_state", "save_model", "save")


def adapt_accelerator(module: ModuleType) -> None:
    """Make ``accelerate``'s process state join the job, and prepared loops snapshot every step."""
    accelerator_class = module.Accelerator
    if getattr(accelerator_class, _ADAPTED, False):
        return
    import accelerate

    reason = outside("accelerate", getattr(accelerate, "__version__", ""), SUPPORTED)
    if reason is None:
        reason = compat.lacks("accelerate", compat.accelerate_lacks(accelerator_class))
    if reason is not None:
        logger.warning("resilrun: %s; a failure restarts the job (Accelerate is left as it is)", reason)
        return
    import accelerate.data_loader
    import accelerate.state

    _adapt_partial_state(accelerate.state.PartialState)
    for loader_class in (accelerate.data_loader.DataLoaderShard, accelerate.data_loader.DataLoaderDispatcher):
        _adapt_loader(loader_class)
    _adapt_prepare(accelerator_class)
    setattr(accelerator_class, _ADAPTED, True)
    from resilrun.worker import membership

    membership.on_reentry(_forget_generation)
    forget_on_reentry()


def install() -> bool:
    """Adapt Accelerate now (a script's explicit opt-in; under resilrun the bootstrap does it)."""
    import accelerate.accelerator

    adapt_accelerator(accelerate.accelerator)
    return bool(getattr(accelerate.accelerator.Accelerator, _ADAPTED, False))


# -- joining the job ------------------------------------------------------------------------------
def _adapt_partial_state(partial_state: type) -> None:
    original = partial_state.__init__

    @functools.wraps(original)
    def __init__(self: Any, cpu: bool = False, **kwargs: Any) -> None:  # noqa: N807 - the method it wraps
        import torch.distributed as dist

        if not dist.is_initialized() and _joins():
            from resilrun.worker import membership

            timeout = kwargs.get("timeout")
            membership.init(
                backend=kwargs.get("backend") or ("gloo" if cpu else None),
                timeout=timeout if isinstance(timeout, timedelta) else None,
            )
        original(self, cpu, **kwargs)

    partial_state.__init__ = __init__


def _joins() -> bool:
    """Whether this process state is resilrun's to set up: a resilrun worker, not a sharded engine
    that sets up its own, not a framework's (the Trainer joins through its own integration)."""
    from resilrun.integrations import enabled

    if not enabled() or any_set_true(*_NOT_INTEGRATED_ENV):
        return False
    return not _created_by_framework()


def _created_by_framework() -> bool:
    frame = sys._getframe(2)  # noqa: SLF001 - who called the wrapped constructor
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).startswith(_FRAMEWORKS):
            return True
        frame = frame.f_back
    return False


# -- which accelerator's loop is snapshotted --------------------------------------------------------
class _Active:
    """The loop this process snapshots in its generation, and the accelerators left alone."""

    session: Loop | None = None
    foreign: weakref.WeakSet[Any] = weakref.WeakSet()


def _forget_generation() -> None:
    """The script runs again: the next generation's accelerator builds its process state anew
    (Accelerate keeps it in class-level singletons, which still describe the torn-down group)."""
    _Active.session = None
    compat.reset_accelerate_state()


def _adapt_prepare(accelerator_class: type) -> None:
    original_init = accelerator_class.__init__
    original_prepare = accelerator_class.prepare

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - the method it wraps
        foreign = not _joins()  # decided before the state exists: FSDP/DeepSpeed set their variables first
        original_init(self, *args, **kwargs)
        if foreign:
            _Active.foreign.add(self)

    @functools.wraps(original_prepare)
    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_prepare(self, *args, **kwargs)
        session = _Active.session
        if session is None and self not in _Active.foreign:
            session = _open_session(self)
        if session is not None and session.accelerator is self:
            session.hook_optimizers()
        return result

    accelerator_class.__init__ = __init__
    accelerator_class.prepare = prepare
    for name in _SAVES:
        if callable(getattr(accelerator_class, name, None)):
            setattr(accelerator_class, name, _unless_replaying(getattr(accelerator_class, name)))
    load_state = accelerator_class.load_state

    @functools.wraps(load_state)
    def load_own_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        session = _Active.session
        if session is not None and session.accelerator is self:
            # Its own resume point and resilrun's snapshots cannot both hold: the script's epoch and
            # batch counters follow its checkpoint, so that one wins, now and after any failure.
            session.abandon("the script loads its own checkpoint (accelerator.load_state)")
        return load_state(self, *args, **kwargs)

    accelerator_class.load_state = load_own_checkpoint
    end_training = getattr(accelerator_class, "end_training", None)
    if callable(end_training):

        @functools.wraps(end_training)
        def end_of_training(self: Any, *args: Any, **kwargs: Any) -> Any:
            session = _Active.session
            if session is not None and session.accelerator is self and session.active and session.started:
                session.job.finish()  # the last step snapshotted (--snapshot-every) and acknowledged
            return end_training(self, *args, **kwargs)

        accelerator_class.end_training = end_of_training


def _unless_replaying(save: Callable[..., Any]) -> Callable[..., Any]:
    """While the script replays epochs finished before the failure, their saves are not made again:
    the failure-free run made them, and the objects do not hold the resumed state yet."""

    @functools.wraps(save)
    def unless_replaying(self: Any, *args: Any, **kwargs: Any) -> Any:
        session = _Active.session
        if session is not None and session.accelerator is self and session.position is not None:
            # Said once per recovery (then at debug level): a replay of many epochs makes many.
            log = logger.debug if session.told_of_skipped_save else logger.warning
            session.told_of_skipped_save = True
            log(
                "resilrun: accelerator.%s() skipped: the script is replaying an epoch finished before "
                "the failure (resuming at step %d)",
                save.__name__,
                session.position.steps,
            )
            return None
        return save(self, *args, **kwargs)

    return unless_replaying


def _open_session(accelerator: Any) -> Loop | None:
    """The loop of this accelerator is the generation's snapshotted one, if it can be."""
    kind = getattr(getattr(accelerator, "distributed_type", None), "name", "?")
    reason = (
        f"Accelerate's {kind} is not integrated (single-process and DDP are)"
        if kind not in _DISTRIBUTED_TYPES
        else compat.lacks("accelerate", compat.accelerator_instance_lacks(accelerator))
    )
    if reason is not None:
        logger.warning("resilrun: %s; a failure restarts the job", reason)
        _Active.foreign.add(accelerator)
        return None
    if not GENERATION.claim("Accelerate loop"):
        _Active.foreign.add(accelerator)
        return None
    _Active.session = Loop(accelerator)
    return _Active.session


def _adapt_loader(loader_class: type) -> None:
    if getattr(loader_class, _ADAPTED, False):
        return
    original = loader_class.__iter__

    @functools.wraps(original)
    def __iter__(self: Any) -> Any:  # noqa: N807 - the method it wraps
        session = _Active.session
        if session is None or not session.active or session.index_of(self) is None:
            return original(self)
        return session.iterate(self, original)

    loader_class.__iter__ = __iter__
    setattr(loader_class, _ADAPTED, True)
