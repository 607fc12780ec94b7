"""Linux's prctl through libc, for the process controls the agent and the worker template use
(die with the parent, adopt orphans). Looked up before any fork: dlopen/dlsym take the loader
lock, which another thread may hold at fork time, and in the child no thread would release it."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

Prctl = Callable[[int, int], int]

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


@cache
def resolve_prctl() -> Prctl | None:
    """libc's prctl (None where there is none: not Linux); cached, so a fork only calls a resolved
    function."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = (ctypes.c_int, ctypes.c_ulong)
    prctl.restype = ctypes.c_int
    return prctl  # type: ignore[no-any-return]
