"""Runs a training script once a gate file exists: ``gated.py GATE SCRIPT ARGS...``.

Tests that must act at a given point of training (drop hosts two steps after a persisted step)
open the gate once everything around the job is ready (spare hosts standing by), so training
cannot race ahead of the set-up on a loaded machine. The script itself runs unmodified."""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

gate, script = Path(sys.argv[1]), sys.argv[2]
while not gate.exists():
    time.sleep(0.05)
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
