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

The patch is scoped to the job: ``resilrun.init()`` installs it only in a worker resilrun launched
(a script under plain ``python`` or torchrun keeps torch's DDP), and ``uninstall()`` puts torch's
``__init__`` back when the process leaves its generation (``reset_for_reentry``); the next
generation's ``init()`` installs it again. The private torch helpers it leans on are probed in
``_torch_compat``; when they are missing, DDP is left exactly as torch has it.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from resilrun.worker import _torch_compat

logger = logging.getLogger(__name__)

_ORIGINAL_INIT = DistributedDataParallel.__init__
# The __init__ install() put on DDP while the patch is in place; None when it is not.
_PATCHED_INIT: Any = None
_PENDING: weakref.WeakKeyDictionary[DistributedDataParallel, tuple[bool, Any]] = weakref.WeakKeyDictionary()
# Every DDP built since install(): snapshots need to know which parameters DDP keeps equal on all ranks.
_BUILT: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()


def install() -> bool:
    """Make DDPs built from now on defer their start-up sync (idempotent); False if unsupported."""
    global _PATCHED_INIT
    if _PATCHED_INIT is not None:
        return True
    if not _torch_compat.can_defer_ddp_sync():
        return False
    signature = inspect.signature(_ORIGINAL_INIT)

    def __init__(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - the patched name
        if _PATCHED_INIT is None:  # uninstalled, but something patched DDP on top of this: pass through
            _ORIGINAL_INIT(self, *args, **kwargs)
            return
        bound = signature.bind(self, *args, **kwargs)
        if "init_sync" in bound.arguments:  # the user chose: respect it
            _ORIGINAL_INIT(self, *args, **kwargs)
            _BUILT.add(self)
            return
        _ORIGINAL_INIT(self, *args, init_sync=False, **kwargs)
        _PENDING[self] = (_buffers_synced_at_init(bound.arguments), self.register_forward_pre_hook(_sync_on_forward))
        _BUILT.add(self)

    _PATCHED_INIT = __init__
    DistributedDataParallel.__init__ = __init__  # type: ignore[method-assign]
    logger.debug("torch private interfaces: %s", _torch_compat.report())
    return True


def uninstall() -> None:
    """Give DDP back torch's own ``__init__`` and forget every DDP built under the patch (idempotent).

    Why: the patch serves one generation of a resilrun job; whatever the process builds after it
    left the job (or after a test) must behave as torch documents.
    """
    global _PATCHED_INIT
    forget_all()
    if _PATCHED_INIT is None:
        return
    if DistributedDataParallel.__init__ is _PATCHED_INIT:
        DistributedDataParallel.__init__ = _ORIGINAL_INIT  # type: ignore[method-assign]
    else:  # patched again on top of ours: leave theirs in place; ours now passes straight through
        logger.debug("DistributedDataParallel.__init__ was patched after resilrun's; left in place")
    _PATCHED_INIT = None


def installed() -> bool:
    """Whether DDPs built now defer their start-up sync."""
    return _PATCHED_INIT is not None


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
    for ddp in list(_BUILT):
        try:
            _torch_compat.detach_ddp(ddp)
        except Exception as exc:  # noqa: BLE001 - a reducer already torn down has no hooks left
            logger.debug("detaching a failed generation's DDP: %s", exc)
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
    _torch_compat.sync_ddp_start(ddp, broadcast_buffers=buffers)


def _sync_on_forward(ddp: DistributedDataParallel, _inputs: Any) -> None:
    if ddp in _PENDING:
        _sync(ddp)
