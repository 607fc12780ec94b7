"""How long this rank computes in a step, without the time it waits for the others (issue 48).

In a synchronous job every rank takes the same wall time per step: each waits in the step's
collectives for the slowest. What differs between ranks is the part before that wait: from the
step's start to the moment the rank's own backward pass is done, its last gradient accumulated
(data loading, forward, backward; DDP's all-reduces overlap the backward and are waited for only
after it). A rank whose share stays longer than its peers' is the one they wait for: a straggler.

One hook, not one per parameter: on the first step every parameter's post-accumulate-grad hook
notes when it fired; the parameter whose gradient came last keeps its hook and the others are
removed (a hook per parameter costs a Python call each, thousands per step on a large model); that
first step is a warm-up and not counted. With gradient accumulation the kept hook fires once per
micro-batch and the last firing in the step counts. A step in which it did not fire (a parameter
unused that step) reports nothing.

The times are CUDA events on the current stream when the parameter lives on a GPU (the CPU runs
ahead of the GPU, so its clock says when work was queued, not done), read once both events have
completed, at the latest a few steps later; on the CPU they are ``perf_counter`` readings. The hooks
are public torch API (``Tensor.register_post_accumulate_grad_hook``) and run outside compiled
graphs, so ``torch.compile`` models are measured without a graph break. Under FSDP the measure
includes the reduce-scatter its sharded gradients wait for, so there it tells less.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

# Pairs of CUDA events whose steps ended but whose work may not be done: kept this many at most
# (a GPU that far behind its CPU drops the oldest rather than growing without bound).
_PENDING_MAX = 64


class _Mark:
    """A point in time on the device that owns the measured parameter."""

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        self.at = 0.0

    def record(self) -> None:
        if self._event is not None:
            self._event.record()
        else:
            self.at = time.perf_counter()

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def seconds_since(self, start: _Mark) -> float:
        if self._event is not None and start._event is not None:
            return start._event.elapsed_time(self._event) / 1000.0
        return self.at - start.at


class ComputeProbe:
    """Per-step compute time of one rank, from its step's start to its last gradient (see the module)."""

    def __init__(self) -> None:
        self._params: list[torch.Tensor] = []
        self._handles: list[Any] = []
        self._fired: dict[int, float] = {}  # calibration: parameter index -> when its hook fired
        self._calibrated = False
        self._device: torch.device | None = None
        self._start: _Mark | None = None
        self._end: _Mark | None = None
        self._pending: deque[tuple[_Mark, _Mark]] = deque(maxlen=_PENDING_MAX)
        self._total = 0.0
        self._count = 0

    def watch(self, objects: Iterable[Any]) -> None:
        """Measure the modules among ``objects`` (the tracked ones), once: later calls are ignored."""
        if self._params:
            return
        seen: set[int] = set()
        for obj in objects:
            if not isinstance(obj, torch.nn.Module):
                continue
            for param in obj.parameters():
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    self._params.append(param)
        if not self._params or not hasattr(self._params[0], "register_post_accumulate_grad_hook"):
            self._params = []
            return
        self._device = self._params[0].device
        for index, param in enumerate(self._params):
            self._handles.append(param.register_post_accumulate_grad_hook(self._calibrating(index)))

    def started(self) -> None:
        """A step starts."""
        if self._device is None:
            return
        self._start = _Mark(self._device)
        self._start.record()
        self._end = None

    def ended(self) -> None:
        """The step is done (its optimizer step too): its measure joins the ones ``take`` averages."""
        if self._start is None:
            return
        if not self._calibrated and self._fired:
            # The first step is a warm-up (lazy initialisation, DDP's bucket rebuild, compilation,
            # the allocator's first requests): it picks the hook and is not counted.
            self._keep_only(max(self._fired, key=self._fired.__getitem__))
        elif self._end is not None:
            self._pending.append((self._start, self._end))
        self._start = None
        while self._pending and self._pending[0][1].ready():
            start, end = self._pending.popleft()
            self._total += end.seconds_since(start)
            self._count += 1

    def take(self) -> float | None:
        """Mean compute seconds of the steps measured since the last call (None: none measured)."""
        if not self._count:
            return None
        mean = self._total / self._count
        self._total, self._count = 0.0, 0
        return mean

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- hooks -------------------------------------------------------------------------------------
    def _calibrating(self, index: int):  # noqa: ANN202 - a hook for torch
        def hook(_param: torch.Tensor) -> None:
            if self._start is not None:
                self._fired[index] = time.perf_counter()
                self._mark_end()

        return hook

    def _measuring(self, _param: torch.Tensor) -> None:
        if self._start is not None:
            self._mark_end()

    def _mark_end(self) -> None:
        if self._end is None:
            assert self._device is not None
            self._end = _Mark(self._device)
        self._end.record()

    def _keep_only(self, index: int) -> None:
        """The first measured step is over: only the parameter whose gradient came last keeps a hook."""
        self.close()
        self._handles = [self._params[index].register_post_accumulate_grad_hook(self._measuring)]
        self._params = [self._params[index]]
        self._fired = {}
        self._calibrated = True
