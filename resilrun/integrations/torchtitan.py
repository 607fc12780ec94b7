"""torchtitan's ``Trainer`` under resilrun: ``-m torchtitan.train`` recovers in-process, unmodified.

What changes under resilrun (nothing changes elsewhere):
- The process group torchtitan asks for in ``init_distributed`` (its backend, its timeout, after its
  own environment settings) is made by ``resilrun.init()``: guarded while it forms, aborted when a
  peer fails. The device mesh and every group torchtitan derives from it are built on it.
- ``Trainer.train`` agrees with every rank on the newest step they all hold and restores it into
  the live objects before the loop starts: each model part (FSDP2/DTensor shards as they are), each
  optimizer and LR scheduler, where the data loader stands (the torchdata loader's own state, not
  torchtitan's pickle of it) and the train state (step, tokens seen). torchtitan's own checkpoint
  load is then skipped: the snapshot is newer than any checkpoint it wrote. On a fresh start it
  loads as it would (an initial checkpoint, or its folder after a whole-job restart).
- Each ``train_step`` is bracketed: the step begins (injected faults fire) and, once the optimizer
  stepped, is committed (snapshotted as ``--snapshot-every`` says) before torchtitan's own
  checkpoint save, which keeps working as it is.
- A recovered generation runs the script again from its first line (survivors in-process, the
  spare fresh): torchtitan builds its Trainer and meshes on the new group, and ``train`` resumes.

Not integrated (a failure then restarts the job, as under torchrun, with a one-line warning):
pipeline parallelism (its schedule's stages are not restored in place, so torchtitan keeps its own
process group and torchtitan's own checkpoints resume it), a CPU-offload backend pair, torchcomms or
fake communication modes, and torchtitan versions outside ``SUPPORTED``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import ModuleType
from typing import Any

from resilrun.integrations import _framework_compat as compat
from resilrun.integrations._support import GENERATION, forget_on_reentry, outside

logger = logging.getLogger(__name__)

# The versions this integration is tested with (docs/integrations.md).
SUPPORTED = ((0, 3), (0, 4))
_ADAPTED = "__resilrun_adapted__"
_JOINED = "_resilrun_joined"  # set on a Trainer whose process group resilrun made


def adapt_trainer(module: ModuleType) -> None:
    """Make torchtitan's ``Trainer`` join the job, resume from resilrun's snapshots and snapshot each step."""
    trainer_class = module.Trainer
    if getattr(trainer_class, _ADAPTED, False):
        return
    import torchtitan
    import torchtitan.distributed.utils as dist_utils

    reason = outside("torchtitan", getattr(torchtitan, "__version__", ""), SUPPORTED)
    if reason is None:
        reason = compat.lacks("torchtitan", compat.torchtitan_lacks(trainer_class, dist_utils))
    if reason is not None:
        logger.warning("resilrun: %s; a failure restarts the job (torchtitan is left as it is)", reason)
        return
    own_init, own_train = trainer_class.init_distributed, trainer_class.train

    @functools.wraps(own_init)
    def init_distributed(self: Any) -> Any:
        if _joins() and _group_is_ours(self.config):
            setattr(self, _JOINED, True)
            with _group_made_by_resilrun():
                return own_init(self)
        return own_init(self)

    @functools.wraps(own_train)
    def train(self: Any) -> Any:
        reason = _not_integrated(self)
        if reason is not None:
            if _joins():
                logger.warning("resilrun: %s; a failure restarts the job", reason)
            return own_train(self)
        if not GENERATION.claim("torchtitan Trainer.train()"):
            return own_train(self)
        return _Session(self).train(functools.partial(own_train, self))

    trainer_class.init_distributed = init_distributed
    trainer_class.train = train
    setattr(trainer_class, _ADAPTED, True)
    forget_on_reentry()


def install() -> bool:
    """Adapt torchtitan now (a script's explicit opt-in; under resilrun the bootstrap does it)."""
    import torchtitan.trainer

    adapt_trainer(torchtitan.trainer)
    return bool(getattr(torchtitan.trainer.Trainer, _ADAPTED, False))


def _joins() -> bool:
    from resilrun.integrations import enabled

    return enabled()


def _group_is_ours(config: Any) -> bool:
    """Whether resilrun makes the group this configuration asks for: one backend, real processes, and
    no pipeline stages. Why not under pipeline parallelism: a group made by resilrun follows its
    generations, so the survivors of a failure would re-run torchtitan in-process with nothing
    restored into their stages; with torchtitan's own group a failure restarts the job, as under
    torchrun, and torchtitan's checkpoints resume it."""
    comm = getattr(config, "comm", None)
    training = getattr(config, "training", None)
    return (
        getattr(comm, "mode", "default") == "default"
        and not getattr(training, "enable_cpu_offload", False)
        and not _pipelined(config)
    )


def _pipelined(config: Any) -> bool:
    return int(getattr(getattr(config, "parallelism", None), "pipeline_parallel_degree", 1) or 1) > 1


def _not_integrated(trainer: Any) -> str | None:
    """Why this training runs as under torchrun (None: it is snapshotted)."""
    if not _joins():
        return "integrations are off"
    if _pipelined(getattr(trainer, "config", None)) or getattr(
        getattr(trainer, "parallel_dims", None), "pp_enabled", False
    ):
        return "pipeline parallelism is not recovered in-process (torchtitan's own checkpoints resume it)"
    if not getattr(trainer, _JOINED, False):
        return (
            "torchtitan made its own process group (CPU offload, torchcomms, a fake communication mode, or a "
            "Trainer whose init_distributed does not call torchtitan's)"
        )
    return compat.lacks("torchtitan", compat.torchtitan_instance_lacks(trainer))


@contextmanager
def _group_made_by_resilrun() -> Iterator[None]:
    """While torchtitan sets up distributed, its ``init_process_group`` call joins resilrun's job."""
    import torch.distributed as dist

    from resilrun.worker import membership

    own = dist.init_process_group

    def init_process_group(backend: str | None = None, timeout: timedelta | None = None, **_: Any) -> None:
        dist.init_process_group = own  # resilrun's join makes the group with torch's own function
        membership.init(backend=backend, timeout=timeout)

    dist.init_process_group = init_process_group
    try:
        yield
    finally:
        dist.init_process_group = own


class _LoaderPosition:
    """Where a torchdata ``StatefulDataLoader`` stands, read and set through the base class: its
    subclass in torchtitan pickles that state, which a snapshot never holds. With it, the number of
    data-parallel ranks it was sharded for: a position in a dataset sharded otherwise means nothing
    (samples skipped or seen twice), so a restore across a resize is refused, as torchtitan refuses
    it for its own checkpoints ("dataloader resharding is not supported")."""

    def __init__(self, loader: Any, base: type) -> None:
        self._loader = loader
        self._base = base

    def state_dict(self) -> Any:
        return {
            "dp_world_size": getattr(self._loader, "dp_world_size", None),
            "loader": self._base.state_dict(self._loader),
        }

    def load_state_dict(self, state: Any) -> None:
        now = getattr(self._loader, "dp_world_size", None)
        if state.get("dp_world_size") != now:
            raise RuntimeError(
                f"resilrun cannot restore torchtitan's data loader across a resize ({state.get('dp_world_size')} "
                f"data-parallel ranks when snapshotted, {now} now): its position is per shard of the dataset, "
                "and torchtitan does not reshard it either; resume at the snapshot's world size"
            )
        self._base.load_state_dict(self._loader, state["loader"])


class _Session:
    """One ``Trainer.train`` call under resilrun. torchtitan counts steps from 1 (``trainer.step`` is
    the step running); resilrun's from 0, so torchtitan's step N is resilrun's N - 1."""

    def __init__(self, trainer: Any) -> None:
        from resilrun.worker import membership

        self.trainer = trainer
        self.job = membership.init()  # joined already, when torchtitan set up distributed

    def objects(self) -> dict[str, Any]:
        trainer = self.trainer
        tracked: dict[str, Any] = {f"model_{i}": part for i, part in enumerate(trainer.model_parts)}
        tracked |= {f"optimizer_{i}": opt for i, opt in enumerate(trainer.optimizers.optimizers)}
        tracked |= {f"lr_scheduler_{i}": s for i, s in enumerate(trainer.lr_schedulers.schedulers)}
        base = compat.stateful_loader_class(trainer.dataloader)
        assert base is not None  # probed in _not_integrated
        tracked["dataloader"] = _LoaderPosition(trainer.dataloader, base)
        tracked["train_state"] = trainer  # torchtitan's own Stateful: step and tokens seen
        return tracked

    def train(self, original: Callable[[], Any]) -> Any:
        trainer, job = self.trainer, self.job
        job.track(**self.objects())
        resumed = job.resume()
        own_step = trainer.train_step
        if resumed >= 0:
            logger.info("resilrun resumes torchtitan at step %d from its snapshot", trainer.step + 1)

            def load(*args: Any, **kwargs: Any) -> bool:
                # Every rank resumed from the same snapshot; a checkpoint of torchtitan's would put
                # them elsewhere (docs/integrations.md: when one of its is newer, it is not used).
                return False

            trainer.checkpointer.load = load

        def train_step(*args: Any, **kwargs: Any) -> Any:
            job.begin(trainer.step - 1)
            result = own_step(*args, **kwargs)
            job.commit(trainer.step - 1)
            return result

        trainer.train_step = train_step
        try:
            result = original()
        finally:  # the class's own methods again
            del trainer.train_step
            if resumed >= 0:
                del trainer.checkpointer.load
        job.finish()
        return result
