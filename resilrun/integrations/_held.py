"""Resuming before the framework has built the objects the restored state belongs to.

A framework decides where its loop starts (epoch, batch to skip to, step counter) before it
builds its optimizer and scheduler, so the step to resume must be agreed (``Job.resume``, a
collective every rank makes at the same point) while those objects do not exist yet. Stand-ins
are tracked under the objects' names for that restore; each holds its state until the framework
asks for it, at the point where it would have read its own checkpoint file. From then on the
real objects are tracked under the same names, so every later snapshot is theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from resilrun.worker.job import Job
from resilrun.worker.rng import RngState


class _StandIn:
    """Tracked in an object's place during the restore: keeps the state it is given."""

    def __init__(self) -> None:
        self.state: Any = None

    def state_dict(self) -> Any:
        raise RuntimeError("resilrun: a stand-in was snapshotted before the framework built its object")

    def load_state_dict(self, state: Any) -> None:
        self.state = state


class LiveState:
    """Tracked in place of state a framework keeps spread over its objects: read afresh at each
    snapshot, and restored through the framework's own path, never loaded in place."""

    def __init__(self, read: Callable[[], Any], restored: str) -> None:
        self._read = read
        self._restored = restored

    def state_dict(self) -> Any:
        return self._read()

    def load_state_dict(self, state: Any) -> None:
        raise RuntimeError(f"resilrun: {self._restored}, not in place")


class HeldRestore:
    """The restored state of ``names``, held until each real object exists."""

    def __init__(self, job: Job, names: Iterable[str]) -> None:
        self._job = job
        self._stand_ins = {name: _StandIn() for name in names}
        self._rng: dict[str, Any] | None = None

    def resume(self) -> int:
        """Agree on and restore the newest step every rank holds (-1: a fresh start)."""
        self._job.track(**self._stand_ins)
        step = self._job.resume()
        if step >= 0:
            # The restore set the random generators; the framework consumes some before its step
            # runs (building the data iterator), and sets them again where it would load its own.
            self._rng = RngState().state_dict()
        return step

    def has(self, name: str) -> bool:
        stand_in = self._stand_ins.get(name)
        return stand_in is not None and stand_in.state is not None

    def load_into(self, name: str, obj: Any) -> None:
        """Load the held state of ``name`` into the real object (once; the copy is dropped)."""
        obj.load_state_dict(self.take(name))

    def take(self, name: str) -> Any:
        """The held state of ``name`` itself (once), for a framework that loads it its own way."""
        stand_in = self._stand_ins[name]
        if stand_in.state is None:
            raise RuntimeError(f"resilrun holds no restored state for {name!r}")
        state, stand_in.state = stand_in.state, None
        return state

    def restore_rng(self) -> None:
        """Set the random generators to the restored step's again."""
        if self._rng is not None:
            RngState().load_state_dict(self._rng)
