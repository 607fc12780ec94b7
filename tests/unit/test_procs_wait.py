"""The agent's monitor wakes on a worker's exit itself, not on its next poll, and keeps no pidfd open
for a worker it has seen exit (an agent runs for weeks and replaces many workers)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from resilrun.agent.workers import procs
from resilrun.option_values import Std
from tests.conftest import wait_until


def _spawn(tmp_path: Path, code: str, rank: int = 0) -> procs.WorkerProcess:
    spec = procs.WorkerSpec(
        local_rank=rank,
        global_rank=rank,
        argv=(sys.executable, "-c", code),
        env=dict(os.environ),
        log_dir=tmp_path / f"rank{rank}",
        to_file=Std.NONE,
        to_console=Std.NONE,
    )
    return procs.spawn(spec)


def _open_pidfds() -> set[int]:
    """Only pidfds: other fds of this test process (left by earlier tests) may be closed by the garbage
    collector while this test runs, so a plain fd count is not this test's to assert on."""
    held = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[pidfd]":
                held.add(int(name))
        except OSError:
            continue  # closed between the listing and the readlink
    return held


def test_an_exit_wakes_the_wait_at_once_and_its_pidfd_is_closed(tmp_path: Path) -> None:
    pidfds_before = _open_pidfds()
    quick = _spawn(tmp_path, "import time; time.sleep(0.3)", rank=0)
    slow = _spawn(tmp_path, "import time; time.sleep(30)", rank=1)
    try:
        started = time.monotonic()
        procs.wait_any_exit([quick, slow], timeout_s=20.0)
        woke_after = time.monotonic() - started
        assert woke_after < 5.0  # the quick one's exit, not the 20 s timeout
        wait_until(lambda: quick.poll() is not None)
        assert quick.poll() == 0 and slow.poll() is None
        assert quick.exit_fd() is None  # closed once the exit was seen
        # With only the sleeper left, the wait lasts its timeout (the exited one does not re-wake it).
        started = time.monotonic()
        procs.wait_any_exit([quick, slow], timeout_s=0.3)
        assert time.monotonic() - started >= 0.25
    finally:
        procs.stop([quick, slow], signal.SIGKILL, 0.0)
    assert slow.exit_fd() is None
    assert _open_pidfds() <= pidfds_before  # none of this test's left open
