"""Runs a training script with one rank slowed down: ``slow_rank.py SCRIPT ARGS...`` with
``SLOW_RANK`` (the rank) and ``SLOW_S`` (seconds added to each ``nn.Linear`` forward of that rank)
in the environment: a throttled device or a noisy neighbour, as straggler tests need it. The script
itself runs unmodified; every other rank runs at its own pace."""

from __future__ import annotations

import os
import runpy
import sys
import time

import torch

if os.environ.get("RANK") == os.environ["SLOW_RANK"]:
    _forward = torch.nn.Linear.forward
    _delay = float(os.environ["SLOW_S"])

    def _slow_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        time.sleep(_delay)
        return _forward(self, x)

    torch.nn.Linear.forward = _slow_forward  # type: ignore[method-assign]

script = sys.argv[1]
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
