"""Which tracked tensors DDP keeps equal on every rank: its parameters and their optimizer state.

Why: only those may be deduplicated across a node's ranks (snapshot/dedup.py). Buffers are not
among them (DDP broadcasts them before a forward that then updates them per rank), nor is the
state of an optimizer outside ``torch.optim`` (ZeRO and friends shard it). A tensor counts by its
storage, so a model tracked as the DDP wrapper, or as the module inside it, is found either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from resilrun.worker import _ddp_sync

_Key = tuple[int, int, torch.dtype, torch.device]


def replicated_names(tracked: Iterable[Any], tensors: Mapping[str, torch.Tensor], world_size: int) -> frozenset[str]:
    """Names in ``tensors`` that are equal on all ``world_size`` ranks after every step."""
    objects = list(tracked)
    ddps = {id(d): d for d in [*_ddp_sync.built(), *(o for o in objects if isinstance(o, DistributedDataParallel))]}
    keys: set[_Key] = set()
    for ddp in ddps.values():
        if _group_size(ddp) != world_size:
            continue  # data parallel over a subgroup: equal within it only, not across this node
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        keys.update(_key(p) for name, p in ddp.module.named_parameters() if name not in ignored)
    if not keys:
        return frozenset()
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer) and type(obj).__module__.startswith("torch.optim."):
            for group in obj.param_groups:
                for param in group["params"]:
                    if _key(param) in keys:
                        keys.update(_key(v) for v in obj.state.get(param, {}).values() if isinstance(v, torch.Tensor))
    return frozenset(name for name, tensor in tensors.items() if tensor.numel() and _key(tensor) in keys)


def _key(tensor: torch.Tensor) -> _Key:
    return (tensor.data_ptr(), tensor.numel(), tensor.dtype, tensor.device)


def _group_size(ddp: DistributedDataParallel) -> int:
    try:
        return dist.get_world_size(ddp.process_group)
    except (RuntimeError, ValueError):  # a group of an earlier generation, destroyed since
        return -1
