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

import dataclasses
import functools
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

from resilrun.integrations._support import GENERATION, forget_on_reentry, outside

logger = logging.getLogger(__name__)

# The versions this integration is tested with (docs: docs/integrations.md; the optional extra pins them).
SUPPORTED = ((1, 0), (2, 0))
_DISTRIBUTED_TYPES = frozenset({"NO", "MULTI_CPU", "MULTI_GPU"})
_NOT_INTEGRATED_ENV = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM")
# Modules whose code creates an Accelerator for a loop it owns (and integrates itself, or not at all).
_FRAMEWORKS = ("transformers.", "trl.", "lightning.", "pytorch_lightning.")
_ACCELERATOR_LISTS = ("_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects")
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
        import accelerate.data_loader
        import accelerate.state

        reason = _lacks(accelerate.data_loader)
    if reason is not None:
        logger.warning("resilrun: %s; a failure restarts the job (Accelerate is left as it is)", reason)
        return
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


def _lacks(data_loader: ModuleType) -> str | None:
    missing = [
        f"{name}.{attribute}"
        for name in ("DataLoaderShard", "DataLoaderDispatcher")
        for attribute in ("__iter__", "set_epoch")
        if not callable(getattr(getattr(data_loader, name, None), attribute, None))
    ]
    return f"this Accelerate lacks {', '.join(missing)}" if missing else None


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

    if not enabled() or any(os.environ.get(name, "").lower() == "true" for name in _NOT_INTEGRATED_ENV):
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

    session: _Session | None = None
    foreign: weakref.WeakSet[Any] = weakref.WeakSet()


def _forget_generation() -> None:
    """The script runs again: the next generation's accelerator builds its process state anew
    (Accelerate keeps it in class-level singletons, which still describe the torn-down group)."""
    from accelerate.state import AcceleratorState, GradientState

    _Active.session = None
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


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


def _open_session(accelerator: Any) -> _Session | None:
    """The loop of this accelerator is the generation's snapshotted one, if it can be."""
    kind = getattr(getattr(accelerator, "distributed_type", None), "name", "?")
    missing = [name for name in _ACCELERATOR_LISTS if not isinstance(getattr(accelerator, name, None), list)]
    reason = (
        f"Accelerate's {kind} is not integrated (single-process and DDP are)"
        if kind not in _DISTRIBUTED_TYPES
        else f"this Accelerator lacks {', '.join(missing)} as resilrun knows them"
        if missing
        else None
    )
    if reason is not None:
        logger.warning("resilrun: %s; a failure restarts the job", reason)
        _Active.foreign.add(accelerator)
        return None
    if not GENERATION.claim("Accelerate loop"):
        _Active.foreign.add(accelerator)
        return None
    _Active.session = _Session(accelerator)
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


# -- the snapshotted loop -----------------------------------------------------------------------------
@dataclasses.dataclass
class _Iteration:
    """One pass over a prepared loader: the random state it started from, and the batches it gave."""

    loader: Any
    index: int
    rng: dict[str, Any]
    generators: list[Any]
    batches: int = 0


@dataclasses.dataclass
class _Position:
    """Where the snapshot's step left the loop (``_LoopState.state_dict``, read back)."""

    steps: int
    accelerator_step: int
    loader: int
    iteration: int
    batches: int
    rng: dict[str, Any]
    generators: list[Any]
    iterations: list[int]


class _Session:
    """The snapshotted loop of one accelerator in this generation."""

    def __init__(self, accelerator: Any) -> None:
        from resilrun.worker import membership

        self.accelerator = accelerator
        self.job = membership.init()  # joined already when Accelerate set up its process state
        self.started = False
        self.held: Any = None  # resilrun.integrations._held.HeldRestore while a restore waits
        self.position: _Position | None = None  # where the resumed loop's data must start
        self.steps = 0  # optimizer steps done: the number of the next one
        self.begun = -1
        self.stepped_in: _Iteration | None = None  # the pass in which an unsnapshotted step ran
        self.passes: list[_Iteration] = []  # the passes under way, innermost last
        self.last: _Iteration | None = None  # the training loader's pass of the newest snapshot
        self.told_of_skipped_save = False
        self.active = True  # False once abandoned: the script resumed itself, or trains elsewhere
        self.trained_outside = False  # an optimizer step outside any pass over a prepared loader
        self._hooked: weakref.WeakSet[Any] = weakref.WeakSet()

    def index_of(self, loader: Any) -> int | None:
        return next((i for i, known in enumerate(self.accelerator._dataloaders) if known is loader), None)

    def hook_optimizers(self) -> None:
        """Count the steps of every prepared optimizer (the hook fires only on a real step: not on
        an accumulating micro-batch, not when the grad scaler skips an overflowing one)."""
        for prepared in self.accelerator._optimizers:
            optimizer = _inner(prepared)
            if optimizer not in self._hooked:
                self._hooked.add(optimizer)
                optimizer.register_step_post_hook(self._after_optimizer_step)

    def _after_optimizer_step(self, *_: Any) -> None:
        if self.passes:
            self.stepped_in = self.passes[-1]
        elif not self.started or self.position is not None:
            self.trained_outside = True

    def abandon(self, why: str) -> None:
        """Stop snapshotting this generation's loop, and restore nothing into it: its progress is
        no longer what resilrun's steps describe. A failure then resumes as the script does itself."""
        if self.active:
            self.active = False
            self.position = self.held = None
            logger.warning(
                "resilrun: %s; this run is not snapshotted, and a failure resumes it as under torchrun", why
            )

    # -- what is snapshotted --------------------------------------------------------------------------
    def objects(self) -> dict[str, Any]:
        accelerator = self.accelerator
        named: dict[str, Any] = {}
        for kind, items in (
            ("model", accelerator._models),
            ("optimizer", [_inner(o) for o in accelerator._optimizers]),
            ("scheduler", accelerator._schedulers),
            ("custom", accelerator._custom_objects),
        ):
            for i, obj in enumerate(items):
                named[kind if i == 0 else f"{kind}_{i}"] = obj
        if getattr(accelerator, "scaler", None) is not None:
            named["scaler"] = accelerator.scaler
        return named

    def loop_state(self) -> dict[str, Any]:
        current = self.last
        if current is None:
            raise RuntimeError("resilrun: an Accelerate step was snapshotted outside a pass over its loader")
        return {
            "steps": self.steps,
            "accelerator_step": int(self.accelerator.step),
            "loader": current.index,
            "iteration": int(current.loader.iteration),
            "batches": current.batches,
            "rng": current.rng,
            "generators": current.generators,
            "iterations": [int(getattr(d, "iteration", 0)) for d in self.accelerator._dataloaders],
        }

    def track_live(self) -> None:
        """From now on the live objects are snapshotted under the names the restore used."""
        from resilrun.worker.job import fix_bucket_layouts

        self.job.track(**self.objects(), loop=_LoopState(self))
        fix_bucket_layouts(self.accelerator._models)

    # -- the passes over prepared loaders -------------------------------------------------------------
    def start(self) -> None:
        """The loop's first pass: agree with every rank on the step to resume, and hold its state."""
        from resilrun.integrations._held import HeldRestore

        self.started = True
        if self.trained_outside:
            self.abandon("the script stepped its optimizer before its first pass over a prepared data loader")
            return
        self.held = HeldRestore(self.job, [*self.objects(), "loop"])
        step = self.held.resume()
        if step < 0:
            self.held = None
            self.track_live()
            return
        loop = self.held.take("loop")
        self.position = _Position(**{field.name: loop[field.name] for field in dataclasses.fields(_Position)})
        self.steps = self.position.steps

    def iterate(self, loader: Any, make: Callable[[Any], Iterator[Any]]) -> Iterator[Any]:
        if not self.started:
            self.start()
        if not self.active:
            yield from make(loader)
            return
        index = self.index_of(loader)
        assert index is not None  # only prepared loaders come here
        position = self.position
        if position is not None and index == position.loader:
            if loader.iteration < position.iteration:
                loader.iteration += 1  # as a finished pass leaves it
                _drop_premade_iterator(loader)
                return  # a pass the failure-free run finished before the resumed step: nothing left in it
            self.position = None
            if loader.iteration != position.iteration:
                logger.warning(
                    "resilrun: the loader was set to epoch %d, its snapshot was taken in epoch %d; resuming there",
                    loader.iteration,
                    position.iteration,
                )
            yield from self._pass(loader, index, make, position)
            return
        yield from self._pass(loader, index, make, None)

    def _pass(
        self, loader: Any, index: int, make: Callable[[Any], Iterator[Any]], position: _Position | None
    ) -> Iterator[Any]:
        from resilrun.worker.job import RngState

        if position is not None:
            self._load(loader, position)
            RngState().load_state_dict(position.rng)
            _set_generator_states(loader, position.generators)
        current = _Iteration(loader, index, RngState().state_dict(), _generator_states(loader))
        batches = make(loader)
        self.passes.append(current)
        try:
            if position is not None:
                for _ in range(position.batches):  # drawn and dropped: the workers' streams move on as they did
                    next(batches, None)
                current.batches = position.batches
                self.last = current
                self.held.restore_rng()
                self.held = None
            for batch in batches:
                if self.begun != self.steps:
                    self.begun = self.steps
                    self.job.begin(self.steps)
                current.batches += 1
                yield batch
                self._after_batch(current)
        finally:
            self.passes.remove(current)

    def _after_batch(self, current: _Iteration) -> None:
        """The script asks for the next batch: a step that ran on the last one is complete."""
        if self.stepped_in is current:
            self.stepped_in = None
            self.last = current
            self.steps += 1
            self.job.commit(self.steps - 1)

    def _load(self, loader: Any, position: _Position) -> None:
        """Put the snapshot's state into the live objects, as the resumed pass starts."""
        live = self.objects()
        for name, obj in live.items():
            if self.held.has(name):
                self.held.load_into(name, obj)
        self.accelerator.step = position.accelerator_step
        for other, iteration in zip(self.accelerator._dataloaders, position.iterations, strict=False):
            if other is not loader and hasattr(other, "iteration"):
                other.iteration = iteration
        loader.iteration = position.iteration
        self.track_live()


class _LoopState:
    """Tracked as "loop": where the loop stands, read when a snapshot is taken."""

    def __init__(self, session: _Session) -> None:
        self._session = session

    def state_dict(self) -> dict[str, Any]:
        return self._session.loop_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise RuntimeError("resilrun: Accelerate's loop state is restored as the resumed pass starts, not in place")


def _inner(optimizer: Any) -> Any:
    """The torch optimizer an ``AcceleratedOptimizer`` wraps (its state is the wrapped one's)."""
    return getattr(optimizer, "optimizer", optimizer)


def _drop_premade_iterator(loader: Any) -> None:
    """A stateful loader (torchdata's ``StatefulDataLoader``) makes its first pass's iterator when
    Accelerate first reads its state, at ``prepare``: drawn from the random state of that moment,
    the same in every run. A failure-free run used it up in its first pass; a pass skipped here
    must drop it too (an empty state is a fresh start), or the resumed pass would be handed it."""
    base = getattr(loader, "base_dataloader", None)
    if callable(getattr(base, "state_dict", None)) and callable(getattr(base, "load_state_dict", None)):
        base.load_state_dict({})


def _generators(loader: Any) -> list[Any]:
    """The loader's own random generators, in a fixed order: Accelerate keeps the sampler's going
    from pass to pass (each pass's shuffle continues its stream), so a pass is rebuilt only with them."""
    import torch

    batch_sampler = getattr(loader, "batch_sampler", None)
    holders = [
        loader,  # the loader itself (a prepared one reads its wrapped loader's)
        getattr(loader, "sampler", None),
        getattr(batch_sampler, "sampler", None),
        getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None),  # under a BatchSamplerShard
        getattr(loader, "dataset", None),
    ]
    candidates = [getattr(loader, "synchronized_generator", None), *(getattr(h, "generator", None) for h in holders)]
    found: list[Any] = []
    for candidate in candidates:
        if isinstance(candidate, torch.Generator) and all(candidate is not known for known in found):
            found.append(candidate)
    return found


def _generator_states(loader: Any) -> list[Any]:
    return [generator.get_state() for generator in _generators(loader)]


def _set_generator_states(loader: Any, states: list[Any]) -> None:
    generators = _generators(loader)
    if len(generators) != len(states):
        logger.warning("resilrun: the loader's random generators differ from its snapshot's; its shuffle may differ")
        return
    for generator, state in zip(generators, states, strict=True):
        generator.set_state(state)
