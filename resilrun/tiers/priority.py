"""Background work of the agent (replication, uploads) yields the CPU to training.

Why: on a host whose cores are all busy training (this 2-core CI machine; a CPU-bound input
pipeline on a GPU node), a push's checksums and copies compete with the workers and make steps
slower, while the promise is that replicas lag, not that steps slow down. Linux schedules threads
individually, so lowering one thread's priority (nice 10: about a tenth of a normal thread's share
when both want a core) costs nothing when a core is idle. Threads it starts inherit the value.
Restores are not lowered: fetching a replica is on the recovery's critical path.
"""

from __future__ import annotations

import contextlib
import os
import threading

BACKGROUND_NICE = 10


def yield_to_training() -> None:
    """Lower the calling thread's CPU priority to ``BACKGROUND_NICE`` (never raises it)."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < BACKGROUND_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
