"""The loop of a hand-written Accelerate script, as resilrun snapshots and resumes it.

``resilrun.integrations.accelerate`` adapts Accelerate's classes and hands this module the passes
over the prepared data loaders and the optimizer steps; here is what is snapshotted (the prepared
objects, ``accelerator.step``, where the training loader stands) and how a recovered run's replay
of its loop is brought back to the resumed step (see that module's docstring for the contract).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from resilrun.integrations._framework_compat import prepared
from resilrun.integrations._held import LiveState

logger = logging.getLogger(__name__)


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


class Loop:
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
        return next((i for i, known in enumerate(prepared(self.accelerator, "dataloaders")) if known is loader), None)

    def hook_optimizers(self) -> None:
        """Count the steps of every prepared optimizer (the hook fires only on a real step: not on
        an accumulating micro-batch, not when the grad scaler skips an overflowing one)."""
        for wrapped in prepared(self.accelerator, "optimizers"):
            optimizer = _inner(wrapped)
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
            logger.warning("resilrun: %s; this run is not snapshotted, and a failure resumes it as under torchrun", why)

    # -- what is snapshotted --------------------------------------------------------------------------
    def objects(self) -> dict[str, Any]:
        accelerator = self.accelerator
        named: dict[str, Any] = {}
        for kind, items in (
            ("model", prepared(accelerator, "models")),
            ("optimizer", [_inner(o) for o in prepared(accelerator, "optimizers")]),
            ("scheduler", prepared(accelerator, "schedulers")),
            ("custom", prepared(accelerator, "custom_objects")),
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
            "iterations": [int(getattr(d, "iteration", 0)) for d in prepared(self.accelerator, "dataloaders")],
        }

    def track_live(self) -> None:
        """From now on the live objects are snapshotted under the names the restore used."""
        from resilrun.worker.job import fix_bucket_layouts

        self.job.track(
            **self.objects(),
            loop=LiveState(self.loop_state, "Accelerate's loop state is restored as the resumed pass starts"),
        )
        fix_bucket_layouts(prepared(self.accelerator, "models"))

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
        from resilrun.worker.rng import RngState

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
        for other, iteration in zip(prepared(self.accelerator, "dataloaders"), position.iterations, strict=False):
            if other is not loader and hasattr(other, "iteration"):
                other.iteration = iteration
        loader.iteration = position.iteration
        self.track_live()


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
