"""Whether this node may still write durable state: it is a participant of the job's current
generation, and it is sure nobody has judged it lost.

A node cut off from the others for longer than the heartbeat timeout is replaced (a spare node
takes its node rank, or the job goes on without it), but it does not know that while cut off, and
after the partition heals its workers may still hold steps of the generation it was replaced in.
Peer replicas are fenced by the generation each push names (the receiver refuses older ones);
the persistent tier has no server to refuse anything, so the writer checks itself, before it writes
and again before it counts a rank's upload towards the step's commit:

- a lease: its own heartbeat reached the store less than half the heartbeat timeout ago (measured
  from when that write began). A watcher judges a node lost only after a full timeout without a
  new counter, so within the lease no verdict against this node can have been reached;
- and the store, read now, names this node a participant of the current generation (a node
  replaced while cut off is not, even once its heartbeats flow again).

A check cannot make a write that is already under way atomic: an upload that outlasts the lease
can land after a verdict. The recount before the commit bounds that to the rank's own files, which
the step's COMPLETE.json then does not pin (docs/recovery.md, "partition").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from resilrun.clock import Clock
from resilrun.errors import ResilrunError
from resilrun.rendezvous.protocol import RdzvState

logger = logging.getLogger(__name__)


class WriteFence:
    """``allows()`` before each durable write; see the module docstring."""

    def __init__(
        self,
        heartbeat_confirmed_at: Callable[[], float | None],
        read_state: Callable[[], RdzvState],
        node_id: str,
        heartbeat_timeout_s: float,
        clock: Clock,
    ) -> None:
        self._confirmed_at = heartbeat_confirmed_at
        self._read_state = read_state
        self._node_id = node_id
        self._lease_s = heartbeat_timeout_s / 2
        self._clock = clock
        self._refused: str | None = None

    def allows(self) -> bool:
        why = self._why_not()
        if why != self._refused:  # said once per change, not once per write
            if why is not None:
                logger.warning("not writing to the persistent tier: %s", why)
            elif self._refused is not None:
                logger.info("writing to the persistent tier again: this node is in the current generation")
        self._refused = why
        return why is None

    def _why_not(self) -> str | None:
        confirmed = self._confirmed_at()
        age = None if confirmed is None else self._clock.monotonic() - confirmed
        if age is None or age > self._lease_s:
            return (
                f"this node's heartbeat has not reached the store for {age:.1f} s (the others may have judged it lost)"
                if age is not None
                else "this node's heartbeat has not reached the store yet"
            )
        try:
            state = self._read_state()
        except ResilrunError as exc:
            return f"the rendezvous store cannot confirm this node's generation: {exc.message}"
        if state.node_rank(self._node_id) is None:
            return f"this node is not a participant of generation {state.round} (it was replaced)"
        return None
