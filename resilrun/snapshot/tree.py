"""Flatten tracked objects into (named tensors, a JSON tree) and back, without pickle.

Why a tagged JSON tree: state dicts hold int keys (optimizer state), tuples (betas), None and
floats next to tensors. JSON alone would turn int keys into strings and tuples into lists, and a
restored optimizer would then differ from the saved one; the tags keep every type exact.

Sharded tensors (DTensors) are stored as their local shard under the leaf's name, with a JSON
description of where that shard sits (snapshot/sharding.py); the caller supplies the hooks that
split a live DTensor and rebuild one, so this module stays free of torch.distributed.

Invariants: every tensor leaf gets a unique '/'-joined name; non-tensor leaves must be JSON
scalars, lists, tuples or dicts with str/int keys (anything else is a TypeError at track time, not
a silent loss at restore time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

_TENSOR, _DICT, _TUPLE, _FLOAT, _SHARDED = "__tensor__", "__dict__", "__tuple__", "__float__", "__dtensor__"

# Splits a tensor that is sharded into (its local shard, a JSON description); None: a plain tensor.
Splitter = Callable[[torch.Tensor], "tuple[torch.Tensor, dict[str, Any]] | None"]
# Rebuilds what a sharded leaf stands for from its local shard and that description.
Joiner = Callable[[torch.Tensor, Any], Any]


def flatten(obj: Any, prefix: str, split: Splitter | None = None) -> tuple[dict[str, torch.Tensor], Any]:
    """Split ``obj`` into named tensors and a JSON-able tree that refers to them by name.

    Args:
        split: asked about every tensor; a sharded one is stored as its local shard.
    """
    tensors: dict[str, torch.Tensor] = {}
    tree = _flatten(obj, prefix, tensors, split)
    return tensors, tree


def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor], split: Splitter | None = None) -> Any:
    if isinstance(obj, torch.Tensor):
        if path in tensors:
            raise TypeError(f"cannot snapshot: two tensors would both be named '{path}'")
        parts = split(obj) if split is not None and type(obj) is not torch.Tensor else None
        if parts is not None:
            tensors[path] = parts[0]
            return {_SHARDED: path, "spec": parts[1]}
        tensors[path] = obj
        return {_TENSOR: path}
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {_FLOAT: repr(obj)}
    if isinstance(obj, dict):
        items = []
        for key, value in obj.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"cannot snapshot '{path}': dict key {key!r} is not a str or int")
            items.append([key, _flatten(value, f"{path}/{key}", tensors, split)])
        return {_DICT: items}
    if isinstance(obj, tuple):
        return {_TUPLE: [_flatten(v, f"{path}/{i}", tensors, split) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, f"{path}/{i}", tensors, split) for i, v in enumerate(obj)]
    try:
        import numpy as np

        if isinstance(obj, np.ndarray):
            tensors[path] = torch.from_numpy(np.ascontiguousarray(obj))
            return {_TENSOR: path, "numpy": True}
        if isinstance(obj, np.generic):
            return _flatten(obj.item(), path, tensors)
    except ImportError:
        pass
    raise TypeError(
        f"cannot snapshot '{path}': {type(obj).__name__} is not a tensor or JSON value; "
        "track an object with state_dict()/load_state_dict() instead"
    )


def unflatten(tree: Any, tensors: dict[str, torch.Tensor], join: Joiner | None = None) -> Any:
    """Rebuild the object ``flatten`` split, taking tensors by name from ``tensors``.

    Args:
        join: rebuilds each sharded leaf from its local shard and description.

    Raises:
        ValueError: a sharded leaf and no ``join``, or a node of unknown shape.
    """
    if isinstance(tree, list):
        return [unflatten(v, tensors, join) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if _TENSOR in tree:
        tensor = tensors[tree[_TENSOR]]
        # A NumPy array lives on the host, whatever device the restore copied tensors to (a CUDA
        # job's private copies are made on its GPU: numpy's RNG state came back there).
        return tensor.cpu().numpy() if tree.get("numpy") else tensor
    if _SHARDED in tree:
        if join is None:
            raise ValueError(f"'{tree[_SHARDED]}' is a shard of a sharded tensor; nothing given to rebuild it")
        return join(tensors[tree[_SHARDED]], tree.get("spec"))
    if _DICT in tree:
        return {key: unflatten(value, tensors, join) for key, value in tree[_DICT]}
    if _TUPLE in tree:
        return tuple(unflatten(v, tensors, join) for v in tree[_TUPLE])
    if _FLOAT in tree:
        return float(tree[_FLOAT])
    raise ValueError(f"unknown snapshot tree node {sorted(tree)}")
