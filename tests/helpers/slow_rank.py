"""Runs a training script with one rank slowed down: ``slow_rank.py SCRIPT ARGS...`` with
``SLOW_RANK`` (the rank) and ``SLOW_S`` (seconds added to each ``nn.Linear`` forward of that rank)
in the environment: a throttled device or a noisy neighbour, as straggler tests need it. With
``SLOW_AFTER_S`` the slow-down starts that many seconds after the script does, and its first
slowed forward writes the time (``time.time()``) to ``SLOW_MARK`` if given. The script itself runs
unmodified; every other rank runs at its own pace. With ``SLOW_ONCE`` (a path), only the first
process to run as that rank is slow (it creates the file): the slowness is then the process's, as a
throttled device's would be, and a hot spare that later takes the rank runs at full speed."""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

import torch


def _first_as_that_rank() -> bool:
    once = os.environ.get("SLOW_ONCE")
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


if os.environ.get("RANK") == os.environ["SLOW_RANK"] and _first_as_that_rank():
    _forward = torch.nn.Linear.forward
    _delay = float(os.environ["SLOW_S"])
    _from = time.monotonic() + float(os.environ.get("SLOW_AFTER_S", "0"))
    _mark = os.environ.get("SLOW_MARK", "")

    def _slow_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        global _mark
        if time.monotonic() >= _from:
            if _mark:
                Path(_mark).write_text(f"{time.time()}\n")
                _mark = ""
            time.sleep(_delay)
        return _forward(self, x)

    torch.nn.Linear.forward = _slow_forward  # type: ignore[method-assign]

script = sys.argv[1]
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
