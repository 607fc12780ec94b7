"""``@resilrun.once``: a set-up function whose result a survivor's re-run of the script reuses.

Why: in-process recovery runs the script again from its first line in every surviving process
(docs/recovery.md), so whatever the script builds before ``job.steps()`` is built again on the
critical path of the recovery. Building a model, loading weights, a tokenizer or an indexed dataset
needs no rank and is the same every time; wrapped in ``@resilrun.once`` it runs once per process,
and a re-run gets the very objects the first run built. A hot spare runs it ahead of the failure
(``worker/pending.py``), so with both no one pays the set-up when a rank fails.

What may be returned: objects that training either does not change (a tokenizer, a dataset) or
that ``job.track`` restores (a model, an optimizer): the failed generation left its partial step in
them, and the restore overwrites it. Never an object bound to a generation's process group (a DDP
or FSDP module, a DeviceMesh): those belong after the call, and returning one is an error.

Calls are told apart by the function (its file, line and name: a re-run defines it anew) and the
``repr`` of the arguments; an argument whose ``repr`` would not tell values apart (a tensor, an
array, an object shown by its address) makes the call run again, never return a stale result.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_RESULTS: dict[tuple[str, int, str, str], Any] = {}
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# Types from torch.distributed whose objects hold a generation's process group.
_BOUND = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel"),
    ("torch.distributed.fsdp", "FSDPModule"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"),
    ("torch.distributed.device_mesh", "DeviceMesh"),
)


def once(fn: F) -> F:
    """Run ``fn`` once per process for each set of arguments; later calls (a survivor's re-run of
    the script included) return the first call's result."""
    code = getattr(fn, "__code__", None)
    where = (code.co_filename, code.co_firstlineno) if code is not None else ("", id(fn))
    name = getattr(fn, "__qualname__", repr(fn))

    @functools.wraps(fn)
    def cached(*args: Any, **kwargs: Any) -> Any:
        arguments = _arguments_key(args, kwargs)
        key = (where[0], int(where[1]), name, arguments) if arguments is not None else None
        if key is not None and key in _RESULTS:
            return _RESULTS[key]
        result = fn(*args, **kwargs)
        _refuse_bound(result, name)
        if key is not None:
            _RESULTS[key] = result
        return result

    return cached  # type: ignore[return-value]


def forget() -> None:
    """Drop every kept result (tests; a script has no reason to)."""
    _RESULTS.clear()


def _arguments_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The arguments as text that tells their values apart, or None where it would not."""
    values = [*args, *kwargs.values()]
    if any(_shown_in_part(v) for v in values):
        return None
    text = repr((args, sorted(kwargs.items())))
    return None if _ADDRESS.search(text) else text


def _shown_in_part(value: Any) -> bool:
    """Tensors and arrays: their repr elides values, so two different ones can look the same."""
    kind = type(value)
    return kind.__module__.partition(".")[0] in ("torch", "numpy") and hasattr(value, "shape")


def _refuse_bound(result: Any, name: str) -> None:
    parts = (
        result
        if isinstance(result, (tuple, list))
        else (list(result.values()) if isinstance(result, dict) else [result])
    )
    for module, attr in _BOUND:
        kind = getattr(sys.modules.get(module), attr, None)
        if isinstance(kind, type) and any(isinstance(p, kind) for p in parts):
            raise TypeError(
                f"@resilrun.once function {name} returned a {attr}, which is bound to this generation's "
                f"process group; return the plain module and wrap it after the call"
            )
