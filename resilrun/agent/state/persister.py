"""Tier 3 mechanism: the agent uploads every ``--persist-every``-th committed step, in the background.

Workers never wait for storage. When a due step is committed, the agent copies it out of the slot
while the worker's commit message is being answered (one memcpy, checked against the commit's
crc32s, every ``--persist-every`` steps: the slot cannot be overwritten during that copy, which it
could be during a slow upload; a copy that fails the check is skipped, like one overwritten); the
upload runs in the background through ``durable.write_rank``. A store counter tells the agent that
finishes the last rank of a step to write that step's COMPLETE.json (the commit point) and apply
``--keep-last``. When uploads fall more than a few steps behind, the oldest pending ones are
dropped, and said so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from resilrun.errors import CheckpointError, CheckpointNotFoundError, ResilrunError
from resilrun.storage.api import Storage
from resilrun.tiers import durable
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.priority import yield_to_training
from resilrun.tiers.slots import Committed

logger = logging.getLogger(__name__)

# Pending uploads per rank before the oldest is dropped: bounds the agent's memory to a few copies.
_MAX_BACKLOG = 3


class Persister:
    """One background thread per agent; ``close`` waits for uploads in flight (bounded)."""

    def __init__(
        self,
        memory: NodeMemoryTier,
        storage: Storage,
        *,
        every: int,
        keep_last: int,
        count_persisted: Callable[[int], int],
        world_size: Callable[[], int],
        may_write: Callable[[], bool] = lambda: True,
        on_persisted: Callable[[int, int, int, float, bool], None] | None = None,
        upload_delay_s: float = 0.0,
        mac_key: bytes | None = None,
    ) -> None:
        """``may_write``: asked before each upload and before it counts towards its step's commit
        (the write fence, ``agent.fence``: a node cut off and replaced must not write).
        ``on_persisted(rank, step, bytes, seconds, step_complete)`` runs after each upload (events, metrics).
        ``upload_delay_s``: a fault hook (``fault_hooks.PERSIST_DELAY_ENV``): each upload waits this long first.
        ``mac_key``: the durable key (tiers/authentic.py): files and COMPLETE.json then carry MACs.
        Of the snapshots, the first at or past each multiple of ``every`` steps is persisted
        (``Committed.crosses``): with a snapshot every step that is steps every-1, 2*every-1, ...;
        with sparser snapshots (``--snapshot-every``), a multiple falling between two of them is
        persisted at the next one. Every rank snapshots the same steps, so all persist the same."""
        self.memory = memory
        self.storage = storage
        self.every = every
        self.keep_last = keep_last
        self._count = count_persisted
        self._world_size = world_size
        self._may_write = may_write
        self._upload_delay_s = upload_delay_s
        self._on_persisted = on_persisted
        self._mac_key = mac_key
        self._due: deque[tuple[int, int, bytes, Any]] = deque()  # (rank, step, bytes, values)
        self._cond = threading.Condition()
        self._closed = False
        self.persisted_step: int | None = None  # newest step this agent saw complete
        self._thread = threading.Thread(target=self._run, name="resilrun-persister", daemon=True)
        self._thread.start()

    def on_commit(self, rank: int, committed: Committed) -> None:
        """Node memory's announcement of a complete snapshot (the commit pipeline registers it):
        copied out now if its step is due, uploaded on this persister's thread."""
        if not committed.crosses(self.every) or committed.origin == "persistent":
            return  # (a step restored from storage is there already)
        snapshot = self.memory.read(rank, committed.step)  # the worker waits for this copy only
        if snapshot is None:
            return
        with self._cond:
            pending = [item for item in self._due if item[0] == rank]
            if len(pending) >= _MAX_BACKLOG:
                self._due.remove(pending[0])
                logger.warning(
                    "uploads are slower than --persist-every %d: step %d of rank %d dropped",
                    self.every,
                    pending[0][1],
                    rank,
                )
            self._due.append((rank, committed.step, *snapshot))
            self._cond.notify()

    def _run(self) -> None:
        yield_to_training()  # uploads are background work: they may lag, steps may not slow down
        while True:
            with self._cond:
                while not self._due and not self._closed:
                    self._cond.wait()
                if not self._due and self._closed:
                    return
                rank, step, data, values = self._due.popleft()
            try:
                self._persist(rank, step, data, values)
            except ResilrunError as exc:
                logger.error("could not persist step %d of rank %d: %s", step, rank, exc.message)

    def _persist(self, rank: int, step: int, data: bytes, values: Any) -> None:
        world = self._world_size()
        if self._upload_delay_s:
            time.sleep(self._upload_delay_s)
        if not self._may_write():
            logger.info("step %d of rank %d not persisted: this node may not write (see above)", step, rank)
            return
        started = time.monotonic()
        durable.write_rank(self.storage, step, rank, world, data, values, mac_key=self._mac_key)
        seconds = time.monotonic() - started
        logger.debug("rank %d step %d persisted (%d bytes, %.2f s)", rank, step, len(data), seconds)
        if not self._may_write():  # the upload outlasted the lease: it must not complete a step
            logger.info("step %d of rank %d uploaded but not counted: this node may not write", step, rank)
            return
        complete = False
        try:
            if self._count(step) >= world:
                try:
                    durable.commit_step(self.storage, step, world, mac_key=self._mac_key)
                except CheckpointNotFoundError:
                    return  # another rank's upload is still missing; whoever finishes it commits
                except CheckpointError as exc:  # e.g. a size the storage reports differs from the upload's
                    logger.error(
                        "step %d not committed: storage does not hold what was uploaded: %s", step, exc.message
                    )
                    return
                complete = True
        finally:
            if self._on_persisted is not None:
                self._on_persisted(rank, step, len(data), seconds, complete)
        if complete:
            self.persisted_step = step
            removed = durable.retain(self.storage, self.keep_last)
            logger.info("step %d persisted for all %d ranks%s", step, world, f"; removed {removed}" if removed else "")

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish the uploads already due, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)
