"""Where a rank's snapshot can be restored from: one interface, three tiers.

A restore asks each source in order (node memory, then peers, then durable storage) what it holds
and fetches from the first that has the step. Each source answers the same three questions (which
steps it holds for a rank, every snapshot it can reach, and the bytes of one, within a deadline),
so ``NodeTiers`` never branches on a tier's name and a new tier is one class here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from resilrun.errors import CheckpointError
from resilrun.snapshot.restore import world_of
from resilrun.snapshot.selection import Selection
from resilrun.storage.api import Storage
from resilrun.tiers import durable
from resilrun.tiers.memory import NodeMemoryTier

logger = logging.getLogger(__name__)

# Given a snapshot's size, the buffer to receive it into.
Into = Callable[[int], memoryview]


@dataclass(frozen=True, slots=True)
class Fetched:
    """A snapshot (or the ranges asked for) as a source gave it: its bytes (``into``'s buffer for
    a ranged read; None where they stay in place), its values tree, and how many bytes moved."""

    data: Any
    values: Any
    moved: int  # bytes that crossed a network or came from storage
    in_place: bool = False  # node memory holds it: the worker reads it where it is


class RestoreSource(Protocol):
    """One tier a rank's snapshot can be restored from."""

    name: str  # what the restore plan and the reports call it: "memory", "peer" or "persistent"

    def held(self, rank: int) -> list[int]:
        """Steps this source can give ``rank``, newest first."""
        ...

    def inventory(self) -> set[tuple[int, int, int]]:
        """Every (rank, step, world size) this source can give, for a restore at another world size."""
        ...

    def fetch(
        self,
        rank: int,
        step: int,
        deadline: float,
        *,
        world_size: int | None = None,
        select: Selection | None = None,
        into: Into | None = None,
    ) -> Fetched | None:
        """``rank``'s snapshot of ``step`` (written at ``world_size``, when given), or only the
        bytes ``select`` names into ``into``'s buffer; None when this source does not hold it.
        Gives up at ``deadline`` (``time.monotonic()``), as the worker waiting for it does.

        Raises:
            CheckpointError: the source holds the step but it cannot be given (refused, corrupt).
        """
        ...


class MemorySource:
    """Node memory: what this node's workers committed, read in place (nothing is moved)."""

    name = "memory"

    def __init__(self, memory: NodeMemoryTier) -> None:
        self.memory = memory

    def complete(self, rank: int) -> list[dict[str, Any]]:
        """``rank``'s committed snapshots whose every byte is still here (borrowed ones included)."""
        return [found for found in self.memory.describe(rank)["committed"].values() if found["complete"]]

    def held(self, rank: int) -> list[int]:
        return sorted((int(found["step"]) for found in self.complete(rank)), reverse=True)

    def inventory(self) -> set[tuple[int, int, int]]:
        return {
            (rank, int(found["step"]), world_of(found["values"]))
            for rank in self.memory.held_ranks()
            for found in self.complete(rank)
        }

    def fetch(
        self,
        rank: int,
        step: int,
        deadline: float,
        *,
        world_size: int | None = None,
        select: Selection | None = None,
        into: Into | None = None,
    ) -> Fetched | None:
        for found in self.complete(rank):
            if int(found["step"]) == step and (world_size is None or world_of(found["values"]) == world_size):
                return Fetched(None, found["values"], 0, in_place=True)
        return None


class DurableSource:
    """The persistent tier (``--checkpoint-uri``): the newest complete persisted step, checked
    against its MACs when the job has a key from outside.

    A rollback of the persistent tier (COMPLETE.json of the newest steps deleted, or the bucket
    put back from an older copy: MACs cannot tell, each older step is authentic) is reported, not
    refused: when the newest complete step in storage is older than the newest this agent saw
    complete there earlier or ``persisted_before()`` says was persisted (the persister's newest
    commit), a warning is logged and ``on_rollback(newest now, newest before)`` called, once per
    such pair. Only what this agent saw is known: storage rolled back before its first look, or
    to a step no agent of this node saw, is not detected.
    """

    name = "persistent"

    def __init__(
        self,
        storage: Storage,
        *,
        mac_key: bytes | None = None,
        require_mac: bool = False,
        persisted_before: Callable[[], int | None] | None = None,
        on_rollback: Callable[[int | None, int], None] | None = None,
    ) -> None:
        """``mac_key``: the durable key (tiers/authentic.py): persisted steps are checked against
        their MACs; ``require_mac``: no persisted step is restored unless they verify (none at all
        without a key: --require-auth)."""
        self.storage = storage
        self.mac_key = mac_key
        self.require_mac = require_mac
        self.persisted_before = persisted_before
        self.on_rollback = on_rollback
        self._rollback_lock = threading.Lock()  # the channel's threads restore at once
        self._newest_seen: int | None = None
        self._rollback_said: tuple[int | None, int] | None = None

    def newest(self) -> tuple[int, int] | None:
        """The newest complete persisted step and its world size (None: none, or unreadable)."""
        try:
            step = durable.latest_complete_step(self.storage)
            self._check_rollback(step)
            if step is None:
                return None
            complete = durable.read_complete(self.storage, step)
        except CheckpointError as exc:
            logger.warning("persistent tier unreadable: %s", exc.message)
            return None
        return step, int(complete.get("world_size", -1))

    def held(self, rank: int) -> list[int]:
        newest = self.newest()
        return [newest[0]] if newest is not None else []

    def inventory(self) -> set[tuple[int, int, int]]:
        """Nothing: a restore at another world size reads the persisted step from its own
        COMPLETE.json (``newest``), not from a list of every step storage holds."""
        return set()

    def fetch(
        self,
        rank: int,
        step: int,
        deadline: float,
        *,
        world_size: int | None = None,
        select: Selection | None = None,
        into: Into | None = None,
    ) -> Fetched | None:
        # The storage client bounds each request itself; the deadline only stops a late start.
        if time.monotonic() >= deadline:
            return None
        if select is not None and into is not None:
            complete = self._complete(step)
            if complete is None or (world_size is not None and complete["world_size"] != world_size):
                return None
            _, manifest, nbytes = durable.read_rank_ranges(
                self.storage,
                step,
                rank,
                select,
                into,
                complete=complete,
                mac_key=self.mac_key,
                require_mac=self.require_mac,
            )
            self._warn_unsigned(step, manifest)
            return Fetched(None, manifest.get("values"), nbytes)
        # A whole rank: the worker planned it from ``newest``; read_rank refuses an incomplete step.
        _, data, manifest = durable.read_rank(
            self.storage, step, rank, verify=True, mac_key=self.mac_key, require_mac=self.require_mac
        )
        self._warn_unsigned(step, manifest)
        return Fetched(data, manifest.get("values"), len(data))

    def _warn_unsigned(self, step: int, manifest: dict[str, Any]) -> None:
        if self.mac_key is not None and not manifest.get("authentic"):
            logger.warning("persisted step %d carries no MAC: restored without an authenticity check", step)

    def _complete(self, step: int) -> dict[str, Any] | None:
        """Persisted ``step``'s COMPLETE.json (None: not complete there)."""
        try:
            return durable.read_complete(self.storage, step)
        except CheckpointError:
            return None

    def _check_rollback(self, newest: int | None) -> None:
        """Report storage's newest complete step being older than one known complete before."""
        recorded = self.persisted_before() if self.persisted_before is not None else None
        with self._rollback_lock:
            known = max((s for s in (self._newest_seen, recorded) if s is not None), default=None)
            self._newest_seen = max((s for s in (known, newest) if s is not None), default=None)
            if known is None or (newest is not None and newest >= known) or self._rollback_said == (newest, known):
                return
            self._rollback_said = (newest, known)
        logger.warning(
            "the persistent tier was rolled back: its newest complete step is %s, but step %d was complete "
            "there before (its COMPLETE.json deleted, or the bucket put back from an older copy); a restore "
            "from storage resumes from the older step",
            "none" if newest is None else newest,
            known,
        )
        if self.on_rollback is not None:
            self.on_rollback(newest, known)
