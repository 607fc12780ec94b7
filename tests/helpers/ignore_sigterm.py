"""A worker that ignores SIGTERM (like one stuck in C++), so the agent must escalate to SIGKILL."""

import os
import signal
import sys
import time
from pathlib import Path

signal.signal(signal.SIGTERM, signal.SIG_IGN)
Path(sys.argv[1], f"ready_{os.environ['RANK']}").write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
