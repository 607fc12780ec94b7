"""examples/train_snapshot_torchrun.py, with one save torn by its writer's death: on the first run
(no ``TORN_SAVE_DONE`` marker in the working folder), the save of epoch ``TORN_SAVE_EPOCH`` writes
half its bytes over the previous snapshot and the worker SIGKILLs itself, as an OOM kill or a
preemption in the middle of ``torch.save`` does. Everything else is the unmodified script."""

from __future__ import annotations

import io
import os
import runpy
import signal
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_snapshot_torchrun.py"
_save = torch.save


def _torn_save(obj: object, f: object, *args: object, **kwargs: object) -> None:
    epoch = obj.get("EPOCHS_RUN") if isinstance(obj, dict) else None
    marker = Path("TORN_SAVE_DONE")
    if epoch == int(os.environ["TORN_SAVE_EPOCH"]) and isinstance(f, str) and not marker.exists():
        marker.write_text("torn once\n")
        buffer = io.BytesIO()
        _save(obj, buffer)
        with open(f, "wb") as out:
            out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            out.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    _save(obj, f, *args, **kwargs)


torch.save = _torn_save
sys.argv = [str(EXAMPLE), *sys.argv[1:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
