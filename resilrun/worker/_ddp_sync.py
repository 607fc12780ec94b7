"""DDP's start-up broadcast, deferred until it is known to be needed.

Why: ``DistributedDataParallel(model)`` broadcasts every parameter from rank 0 when it is built.
In a recovery the script runs again and builds its model anew, and then ``job.steps()`` restores
every tracked parameter from the snapshot, overwriting what the broadcast sent: the broadcast is
wasted time in the middle of the recovery (0.3 s for 85 MiB of parameters on 4 CPU ranks here).

So, under resilrun, a DDP built without an explicit ``init_sync`` skips its start-up collectives
and is remembered as pending. ``settle`` (called by ``job.steps()`` after its restore) then runs
the deferred verification and broadcast for every pending DDP whose parameters and buffers the
restore did not all overwrite, which always includes a fresh start. A pending DDP that reaches its
first forward without ``settle`` (a script that never calls ``job.steps()``) syncs right there, so
ranks never train from different weights. Every rank takes the same path (same script, same agreed
restore plan), which is what makes the deferred collectives line up.

It leans on two private torch helpers; when they are missing, DDP is left exactly as torch has it.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)

try:
    from torch.distributed.utils import _sync_module_states, _verify_param_shape_across_processes
except ImportError:  # pragma: no cover - a torch without them keeps DDP's own start-up sync
    _sync_module_states = _verify_param_shape_across_processes = None  # type: ignore[assignment]

_ORIGINAL_INIT = DistributedDataParallel.__init__
_PENDING: weakref.WeakKeyDictionary[DistributedDataParallel, tuple[bool, Any]] = weakref.WeakKeyDictionary()
# Every DDP built since install(): snapshots need to know which parameters DDP keeps equal on all ranks.
_BUILT: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()


def install() -> bool:
    """Make DDPs built from now on defer their start-up sync (idempotent); False if unsupported."""
    if _sync_module_states is None or "init_sync" not in inspect.signature(_ORIGINAL_INIT).parameters:
        return False
    if DistributedDataParallel.__init__ is not _ORIGINAL_INIT:
        return True
    signature = inspect.signature(_ORIGINAL_INIT)

    def __init__(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - the patched name
        bound = signature.bind(self, *args, **kwargs)
        if "init_sync" in bound.arguments:  # the user chose: respect it
            _ORIGINAL_INIT(self, *args, **kwargs)
            _BUILT.add(self)
            return
        _ORIGINAL_INIT(self, *args, init_sync=False, **kwargs)
        _PENDING[self] = (_buffers_synced_at_init(bound.arguments), self.register_forward_pre_hook(_sync_on_forward))
        _BUILT.add(self)

    DistributedDataParallel.__init__ = __init__  # type: ignore[method-assign]
    return True


def settle(restored: Iterable[Any]) -> None:
    """Run the deferred start-up sync of each pending DDP the restore did not fully overwrite.

    Args:
        restored: the objects whose state was just loaded from a snapshot (nothing on a fresh start).
    """
    if not _PENDING:  # the common case on every later steps() call: no walk over the model
        return
    covered = _tensor_ids(restored)
    for ddp in list(_PENDING):
        states = [*ddp.module.parameters(), *ddp.module.buffers()]
        if covered and all(id(t) in covered for t in states):
            _forget(ddp)
            logger.debug("DDP start-up broadcast skipped: the restore set all %d tensors", len(states))
        else:
            _sync(ddp)


def built() -> list[DistributedDataParallel]:
    """The live DDPs built since ``install()``."""
    return list(_BUILT)


def forget_all() -> None:
    """Drop what a failed generation left pending: its DDPs belong to a process group now gone."""
    for ddp in list(_PENDING):
        _forget(ddp)
    _BUILT.clear()


def _buffers_synced_at_init(arguments: dict[str, Any]) -> bool:
    """Whether torch's own init would have broadcast the buffers (mirrors DDP's argument rules)."""
    if arguments.get("forward_sync_buffers") is not None:
        return True
    broadcast = arguments.get("broadcast_buffers")
    return True if broadcast is None else bool(broadcast)


def _tensor_ids(objects: Iterable[Any]) -> set[int]:
    ids: set[int] = set()
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            ids.update(id(t) for t in (*obj.parameters(), *obj.buffers()))
        elif isinstance(obj, torch.Tensor):
            ids.add(id(obj))
    return ids


def _forget(ddp: DistributedDataParallel) -> None:
    entry = _PENDING.pop(ddp, None)
    if entry is not None:
        entry[1].remove()


def _sync(ddp: DistributedDataParallel) -> None:
    """What DDP's ``init_sync`` would have done at construction: same checks, same broadcast."""
    buffers = _PENDING[ddp][0]
    _forget(ddp)
    parameters, _ = ddp._build_params_for_reducer()
    _verify_param_shape_across_processes(ddp.process_group, parameters)
    _sync_module_states(
        module=ddp.module,
        process_group=ddp.process_group,
        broadcast_bucket_size=ddp.broadcast_bucket_size,
        src=0,
        params_and_buffers_to_ignore=ddp.parameters_to_ignore,
        broadcast_buffers=buffers,
    )


def _sync_on_forward(ddp: DistributedDataParallel, _inputs: Any) -> None:
    if ddp in _PENDING:
        _sync(ddp)
