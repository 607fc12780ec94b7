"""Stopping one worker at a step boundary: right after a commit, before it starts the next step.

Why at a commit: a straggler swapped for a hot spare must leave nothing half done. Its commit has
been recorded in node memory (and gone through the gates: replicas and persistence as for any
step) by the time the fence closes, so the spare restores exactly that step and the job redoes
nothing of it. The worker is stopped (SIGSTOP) while it waits for the answer to that commit: the
signal is sent before the answer is written, and a process stopped in its read cannot run another
line, however soon the answer arrives (a stop is taken on the way back to user space). Every
thread of the process stops with it; its heartbeat with them.

The fence only stops; the supervisor decides what follows (the swap, then the process released;
or, when the swap cannot happen, ``release`` continues it as if nothing had been asked).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def _continue(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


class StepFence:
    """Thread-safe: the supervisor asks and reads, the channel's commit path closes the fence."""

    def __init__(self, stop: Callable[[int], None] = _stop, resume: Callable[[int], None] = _continue) -> None:
        """``stop``/``resume``: how a process is stopped and continued (signals; fakes in tests)."""
        self._stop = stop
        self._resume = resume
        self._lock = threading.Lock()
        self._asked: set[int] = set()
        self._closed: dict[int, int] = {}  # pid -> the step it committed last

    def ask(self, pid: int) -> None:
        """Stop ``pid`` after its next commit."""
        with self._lock:
            if pid not in self._closed:
                self._asked.add(pid)

    def at_commit(self, pid: int, step: int) -> bool:
        """Called once ``pid``'s commit of ``step`` went through every stage, before the answer:
        stops the worker if it was asked to (and says so)."""
        with self._lock:
            if pid not in self._asked:
                return False
            self._asked.discard(pid)
            self._closed[pid] = step
        try:
            self._stop(pid)
        except ProcessLookupError:
            return False
        return True

    def stop_now(self, pid: int, step: int) -> None:
        """Stop ``pid`` where it is, ``step`` being its newest commit (it waits in the next step's
        collectives for a rank stopped after ``step``: it would never commit again)."""
        with self._lock:
            if pid in self._closed:
                return
            self._asked.discard(pid)
            self._closed[pid] = step
        with contextlib.suppress(ProcessLookupError):
            self._stop(pid)

    def closed(self, pid: int) -> int | None:
        """The step ``pid`` was stopped after, or None while it runs."""
        with self._lock:
            return self._closed.get(pid)

    def release(self, pid: int, *, resume: bool) -> None:
        """Forget ``pid``; with ``resume``, continue it (the swap did not happen)."""
        with self._lock:
            self._asked.discard(pid)
            was_closed = self._closed.pop(pid, None) is not None
        if resume and was_closed:
            with contextlib.suppress(ProcessLookupError):
                self._resume(pid)
