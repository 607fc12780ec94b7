"""examples/train_snapshot_torchrun.py started beside a thread of the script's own that is not a
daemon (a prefetcher, as a ``ThreadPoolExecutor`` starts), stopped when the script ends. Re-running
the script in this process would leave that thread running, so ``--rerun-in-process`` must refuse
and the job restart. Everything else is the unmodified script."""

from __future__ import annotations

import runpy
import threading
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_snapshot_torchrun.py"

stop = threading.Event()
threading.Thread(target=stop.wait, name="prefetcher", daemon=False).start()
try:
    runpy.run_path(str(EXAMPLE), run_name="__main__")
finally:
    stop.set()
