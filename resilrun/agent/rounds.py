"""What one node runs in a round, shared by the supervisor and its recovery mixins."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from resilrun.agent import procs
from resilrun.errors import ShutdownRequested
from resilrun.rendezvous.protocol import RdzvState


class SignalFlag:
    """Set by signal handlers (which must do nothing else); read by the loop."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def handler(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum

    def raise_if_set(self) -> None:
        if self.signum is not None:
            raise ShutdownRequested(self.signum)


class RoundEnd(Enum):
    """How a round ended for this node."""

    DONE = "done"
    REJOIN = "rejoin"


@dataclass
class Round:
    """What this node runs in the current round; in-process recoveries update it in place."""

    state: RdzvState
    node_rank: int
    workers: list[procs.WorkerProcess]  # by local rank
    spares: list[procs.WorkerProcess]
    store: Any
    spare_index: int = 0
    respawn_at: float | None = None
    killed: set[int] = field(default_factory=set)  # pids SIGKILLed as hung, not yet reaped
    # Newest step committed on this node when the last in-process recovery started, and the
    # global ranks that had failed then.
    recovered_at_step: int | None = None
    recovered_ranks: frozenset[int] = frozenset()
