"""Mechanism for worker processes: spawn, poll, signal, escalate, and route their output.

Invariants: every worker is the leader of its own process group (so signals reach its children,
e.g. data-loader workers) and dies with the agent (PR_SET_PDEATHSIG), so a SIGKILLed agent leaves
no orphans. The agent's handled signals are blocked while forking so a Ctrl-C cannot land between
fork and bookkeeping; children start with them unblocked.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from resilrun.config import Std

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How to start one worker and where its output goes."""

    local_rank: int
    global_rank: int
    argv: tuple[str, ...]
    env: dict[str, str]
    log_dir: Path
    to_file: Std  # streams written to files
    to_console: Std  # streams shown on the console (teed when also in files)

    @property
    def error_file(self) -> Path:
        return self.log_dir / "error.json"


def _child_setup(agent_pid: int) -> None:
    """Runs in the child between fork and exec (async-signal-safe calls only)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED_SIGNALS)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != agent_pid:  # the agent died before prctl took effect
        os._exit(1)


class _Tee(threading.Thread):
    """Copies a worker's pipe to its log file and, prefixed, to the agent's console."""

    _console_lock = threading.Lock()

    def __init__(self, pipe: IO[bytes], file: IO[bytes] | None, console: IO[bytes] | None, prefix: bytes) -> None:
        super().__init__(daemon=True)
        self.pipe, self.file, self.console, self.prefix = pipe, file, console, prefix

    def run(self) -> None:
        for line in iter(self.pipe.readline, b""):
            if self.file is not None:
                self.file.write(line)
                self.file.flush()
            if self.console is not None:
                with self._console_lock:
                    self.console.write(self.prefix + line)
                    self.console.flush()
        self.pipe.close()
        if self.file is not None:
            self.file.close()


class WorkerProcess:
    """One running worker and the threads that carry its output."""

    def __init__(self, spec: WorkerSpec, popen: subprocess.Popen[bytes], tees: list[_Tee], files: list[IO[bytes]]):
        self.spec = spec
        self.popen = popen
        self.tees = tees
        self._files = files
        self.exit_observed_at: float | None = None
        # Wall clock, like exit_observed_at: a spare started after a failure was seen is not a warm one.
        self.started_at = time.time()
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):  # pidfds need Linux >= 5.3
            self._pidfd = os.pidfd_open(popen.pid)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        code = self.popen.poll()
        if code is not None and self.exit_observed_at is None:
            self.exit_observed_at = time.time()
        if code is not None and self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None
        return code

    def exit_fd(self) -> int | None:
        """A descriptor that becomes readable when the worker exits (None: poll instead)."""
        return self._pidfd

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signum)

    def finish_output(self, timeout: float = 2.0) -> None:
        for tee in self.tees:
            tee.join(timeout)
        for handle in self._files:
            with contextlib.suppress(OSError):
                handle.close()
        self.poll()  # closes the pidfd once the worker is gone


def _open_stream(spec: WorkerSpec, bit: Std, name: str) -> tuple[int | IO[bytes] | None, IO[bytes] | None, bool]:
    """(Popen argument, file handle, needs a tee thread) for one stream of one worker."""
    in_file = bool(spec.to_file & bit)
    on_console = bool(spec.to_console & bit)
    if not in_file:
        return (None if on_console else subprocess.DEVNULL), None, False
    handle = open(spec.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed by WorkerProcess
    if on_console:
        return subprocess.PIPE, handle, True
    return handle, handle, False


def spawn(spec: WorkerSpec) -> WorkerProcess:
    """Start one worker in its own session; signals handled by the agent are blocked meanwhile."""
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        spec.error_file.unlink()
    out_arg, out_file, out_tee = _open_stream(spec, Std.OUT, "stdout")
    err_arg, err_file, err_tee = _open_stream(spec, Std.ERR, "stderr")
    agent_pid = os.getpid()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
    try:
        popen = subprocess.Popen(
            list(spec.argv),
            env=spec.env,
            stdin=subprocess.DEVNULL,
            stdout=out_arg,
            stderr=err_arg,
            start_new_session=True,
            preexec_fn=lambda: _child_setup(agent_pid),  # noqa: PLW1509 - single-threaded at fork time is not required here
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    prefix = f"[rank {spec.global_rank}]: ".encode()
    tees: list[_Tee] = []
    files = [f for f in (out_file, err_file) if f is not None]
    if out_tee and popen.stdout is not None:
        tees.append(_Tee(popen.stdout, out_file, sys.stdout.buffer, prefix))
    if err_tee and popen.stderr is not None:
        tees.append(_Tee(popen.stderr, err_file, sys.stderr.buffer, prefix))
    for tee in tees:
        tee.start()
    return WorkerProcess(spec, popen, tees, [f for f in files if not any(t.file is f for t in tees)])


def wait_any_exit(workers: Iterable[WorkerProcess], timeout_s: float) -> None:
    """Sleep up to ``timeout_s``, waking as soon as one of ``workers`` exits.

    Why: a fixed poll interval adds up to one interval to every failure's detection; waking on the
    exit itself takes that out of the recovery time. Falls back to a plain sleep without pidfds.
    """
    fds = [fd for fd in (w.exit_fd() for w in workers if w.popen.returncode is None) if fd is not None]
    if not fds:
        time.sleep(timeout_s)
        return
    try:
        select.select(fds, [], [], timeout_s)
    except (OSError, ValueError):  # a descriptor closed meanwhile: the next poll sees the exit
        time.sleep(min(timeout_s, 0.01))


def stop(workers: Iterable[WorkerProcess], signum: int, grace_s: float) -> None:
    """Signal every worker's process group, wait up to ``grace_s``, then SIGKILL what is left."""
    workers = list(workers)
    for worker in workers:
        worker.signal_group(signum)
    deadline = time.monotonic() + grace_s
    for worker in workers:
        remaining = max(0.0, deadline - time.monotonic())
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.popen.wait(remaining)
    for worker in workers:
        # The group may hold grandchildren even when the worker itself has exited.
        worker.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.popen.wait(5.0)
        worker.poll()
        worker.finish_output()
