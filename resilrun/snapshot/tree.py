"""Flatten tracked objects into (named tensors, a JSON tree) and back, without pickle.

Why a tagged JSON tree: state dicts hold int keys (optimizer state), tuples (betas), None and
floats next to tensors. JSON alone would turn int keys into strings and tuples into lists, and a
restored optimizer would then differ from the saved one; the tags keep every type exact.

Invariants: every tensor leaf gets a unique '/'-joined name; non-tensor leaves must be JSON
scalars, lists, tuples or dicts with str/int keys (anything else is a TypeError at track time, not
a silent loss at restore time).
"""

from __future__ import annotations

import math
from typing import Any

import torch

_TENSOR, _DICT, _TUPLE, _FLOAT = "__tensor__", "__dict__", "__tuple__", "__float__"


def flatten(obj: Any, prefix: str) -> tuple[dict[str, torch.Tensor], Any]:
    """Split ``obj`` into named tensors and a JSON-able tree that refers to them by name."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _flatten(obj, prefix, tensors)
    return tensors, tree


def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        if path in tensors:
            raise TypeError(f"cannot snapshot: two tensors would both be named '{path}'")
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
            items.append([key, _flatten(value, f"{path}/{key}", tensors)])
        return {_DICT: items}
    if isinstance(obj, tuple):
        return {_TUPLE: [_flatten(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
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


def unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild the object ``flatten`` split, taking tensors by name from ``tensors``."""
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if _TENSOR in tree:
        tensor = tensors[tree[_TENSOR]]
        return tensor.numpy() if tree.get("numpy") else tensor
    if _DICT in tree:
        return {key: unflatten(value, tensors) for key, value in tree[_DICT]}
    if _TUPLE in tree:
        return tuple(unflatten(v, tensors) for v in tree[_TUPLE])
    if _FLOAT in tree:
        return float(tree[_FLOAT])
    raise ValueError(f"unknown snapshot tree node {sorted(tree)}")
