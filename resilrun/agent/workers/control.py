"""Where the agent and its worker processes meet for in-process recovery.

Workers block here (through the agent channel) in two situations: a hot spare waits to be given a
rank, and a worker whose script raised waits to learn the job's next generation. The supervisor
publishes both. Every wait has a deadline, after which the worker gets "no" and fails the ordinary
way.

Whether a worker that raised is a survivor (a peer failed and broke its collective: it must wait for
the next generation) or the failure itself (its own error, an NCCL or CUDA error included: it must
exit at once, so that the job can replace it) is not guessed from the exception's text: the
supervisor decides from what the agents know (``raised_workers``, ``dismiss``): a failure already
seen anywhere in the job, or a node that stopped heartbeating, makes it a survivor; none of that
within a short grace makes it the failure.

Invariants: a published generation only moves forward; a spare is assigned at most once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class WorkerControl:
    """Thread-safe; the channel's per-connection threads wait, the supervisor publishes."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        """``monotonic``: the clock the ages and allowances (beats, steps, first step, a raised
        worker's wait) are read on; the waits themselves are bounded on the real one."""
        self._now = monotonic
        self._cond = threading.Condition()
        self._round = -1
        self._generation_env: dict[int, dict[str, str]] = {}  # pid -> env of the newest generation
        self._assignments: dict[int, dict[str, str]] = {}  # spare pid -> env
        self._waiting_spares: set[int] = set()
        self._api_pids: set[int] = set()
        self._rerun_pids: set[int] = set()  # plain scripts' workers that can re-run the script in-process
        self._progress: dict[int, tuple[int, float]] = {}  # pid -> (step, when it changed)
        self._beats: dict[int, float] = {}  # pid -> when its heartbeat thread last spoke
        self._finished: set[int] = set()
        self._started: dict[int, float] = {}  # pid -> when it was given its rank in this generation
        self._raised: dict[int, tuple[int, float]] = {}  # pid -> (its round, since when) while it waits
        self._dismissed: set[int] = set()
        self._rates: list[float] = []  # GFLOP/s of the node's processes whose device check passed (newest 64)

    # -- channel side -------------------------------------------------------------------------
    def register_api(self, pid: int) -> None:
        with self._cond:
            self._api_pids.add(pid)

    def register_rerun(self, pid: int, reason: str = "") -> None:
        """A plain script's worker can re-run the script in-process (``reason`` empty), or no longer
        can (``reason`` says what it holds that cannot be reset: a failure then restarts the job).
        Either way it is not on the API: a spare counted as one when given its rank (``assign``)
        must not be held to the first-step allowance of a script that never reports a step."""
        with self._cond:
            self._api_pids.discard(pid)
            if reason:
                self._rerun_pids.discard(pid)
            else:
                self._rerun_pids.add(pid)

    def await_assignment(self, pid: int, timeout_s: float) -> dict[str, str] | None:
        """A spare waits here until the supervisor gives it a rank (None on timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._waiting_spares.add(pid)
            self._cond.notify_all()  # a recovery may be waiting for this spare (wait_for_waiting_spares)
            try:
                while pid not in self._assignments:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    self._cond.wait(remaining)
                return self._assignments[pid]
            finally:
                self._waiting_spares.discard(pid)

    def await_generation(
        self, pid: int, after_round: int, timeout_s: float, raised: bool = False
    ) -> dict[str, Any] | None:
        """A worker waits for a generation newer than ``after_round`` that still includes it.

        ``raised``: its script raised something a broken collective could have caused; it waits as a
        survivor until the supervisor ``dismiss``es it (nothing says a peer failed: the error is its
        own, and it should exit now) or the generation comes.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if raised:
                self._raised[pid] = (after_round, self._now())
                self._cond.notify_all()
            try:
                while self._round <= after_round or pid not in self._generation_env:
                    remaining = deadline - time.monotonic()
                    # A dismissal is for the wait of the worker's script, not for its watchdog
                    # thread's wait on the same pid (which must neither take nor consume it).
                    if remaining <= 0 or (raised and pid in self._dismissed):
                        return None
                    self._cond.wait(remaining)
                return self._generation_env[pid]
            finally:
                if raised:
                    self._raised.pop(pid, None)
                    self._dismissed.discard(pid)

    def raised_workers(self) -> dict[int, tuple[int, float]]:
        """Workers waiting after their script raised: pid -> (their round, monotonic time since)."""
        with self._cond:
            return dict(self._raised)

    def dismiss(self, pid: int) -> None:
        """Tell a worker that raised that no peer failed: its error is the failure, it exits now."""
        with self._cond:
            if pid in self._raised:
                self._dismissed.add(pid)
                self._cond.notify_all()

    def beat(self, pid: int) -> None:
        with self._cond:
            self._beats[pid] = self._now()

    def finished(self, pid: int) -> None:
        """The worker's script returned: from here on it only tears down, which may take a while."""
        with self._cond:
            self._finished.add(pid)

    def silent_for(self, pid: int) -> float | None:
        """Seconds since the worker's heartbeat thread last spoke (None: it never did, e.g. still
        importing, or its script already finished)."""
        with self._cond:
            last = None if pid in self._finished else self._beats.get(pid)
        return None if last is None else self._now() - last

    def stalled_for(self, pid: int) -> float | None:
        """Seconds since the worker's committed step last changed (None before its first commit)."""
        with self._cond:
            seen = None if pid in self._finished else self._progress.get(pid)
        return None if seen is None else self._now() - seen[1]

    def first_step_pending_for(self, pid: int) -> float | None:
        """Seconds since the worker was given its rank in this generation, while it has committed no
        step in it yet (None otherwise, and for scripts that do not use the resilrun API)."""
        with self._cond:
            pending = pid in self._api_pids and pid not in self._progress and pid not in self._finished
            started = self._started.get(pid) if pending else None
        return None if started is None else self._now() - started

    def report_step(self, pid: int, step: int) -> None:
        with self._cond:
            previous = self._progress.get(pid)
            if previous is None or previous[0] != step:
                self._progress[pid] = (step, self._now())

    def device_checked(self, gflops: float | None, passed: bool) -> None:
        """A process's device check (worker/health.py): a passing one's rate joins the node's reference."""
        if passed and gflops:
            with self._cond:
                self._rates = [*self._rates[-63:], float(gflops)]

    # -- supervisor side ----------------------------------------------------------------------
    def expected_gflops(self) -> float | None:
        """The rate a spare's device is held to: the median of the node's passing checks."""
        with self._cond:
            rates = sorted(self._rates)
        return rates[len(rates) // 2] if rates else None

    def waiting_spares(self) -> list[int]:
        with self._cond:
            return sorted(self._waiting_spares)

    def wait_for_waiting_spares(self, pids: list[int], needed: int, timeout_s: float) -> bool:
        """Block until ``needed`` of ``pids`` wait for a rank, at most ``timeout_s``; whether they do."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._waiting_spares.intersection(pids)) < needed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def uses_api(self, pids: list[int]) -> bool:
        with self._cond:
            return all(pid in self._api_pids for pid in pids)

    def reruns(self, pids: list[int]) -> bool:
        """Whether every one of ``pids`` is a plain script's worker that can re-run it in-process."""
        with self._cond:
            return bool(pids) and all(pid in self._rerun_pids for pid in pids)

    def begin_generation(self, pids: list[int]) -> None:
        """These workers start a generation (spawned, given a rank, or recovering in-process): the
        first-step allowance applies to them until they commit a step in it."""
        now = self._now()
        with self._cond:
            for pid in pids:
                self._started[pid] = now
                self._progress.pop(pid, None)

    def assign(self, pid: int, env: dict[str, str]) -> None:
        with self._cond:
            # A spare waits inside resilrun.init(): it is on the API before it says hello as a rank,
            # and a second failure in that moment must not be mistaken for a plain torchrun script.
            self._api_pids.add(pid)
            self._assignments[pid] = env
            self._cond.notify_all()

    def publish_generation(self, round: int, envs: dict[int, dict[str, str]]) -> None:
        with self._cond:
            if round > self._round:
                self._round = round
                self._generation_env = dict(envs)
                self._cond.notify_all()

    def newest_step(self, pids: list[int]) -> int | None:
        with self._cond:
            steps = [self._progress[p][0] for p in pids if p in self._progress]
        return max(steps) if steps else None
