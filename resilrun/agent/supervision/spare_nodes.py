"""Spare nodes: an agent the full job has no place for stands by with warm workers.

Its warm workers wait in the worker bootstrap (torch and the script's imports loaded). When a
survivor gives a lost node's place to this node (``NodeWatch.replace``), the warm workers take
that node's ranks in the new generation, in their processes, and the round loop supervises them
like any other round. A restart (a new round) ends the standby: the node joins it like any node and
keeps its warm workers for whatever role it gets.
"""

from __future__ import annotations

import logging
import signal

from resilrun.agent.state.captured import CAPTURED_RESTORE_S, CapturedFolder
from resilrun.agent.supervision.inprocess import InProcessRecovery
from resilrun.agent.supervision.restarts import Restarts
from resilrun.agent.supervision.rounds import Membership, NodePhase, Round, RoundEnd, SignalFlag
from resilrun.agent.supervision.spare_pool import SparePool
from resilrun.agent.workers.procs import Processes, WorkerProcess
from resilrun.agent.workers.specs import NodeSetup
from resilrun.clock import Clock
from resilrun.config import Config
from resilrun.errors import ShutdownRequested
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import RdzvState

logger = logging.getLogger(__name__)


class SpareNodeStandby:
    """A spare node's standby and take-over (see the module docstring). Owns the warm workers
    kept between rounds this node does not take part in."""

    def __init__(
        self,
        config: Config,
        setup: NodeSetup,
        rdzv: RendezvousClient,
        signals: SignalFlag,
        spare_pool: SparePool,
        generations: InProcessRecovery,
        restarts: Restarts,
        membership: Membership,
        processes: Processes,
        clock: Clock,
        captured: CapturedFolder | None = None,
    ) -> None:
        self._config = config
        self._setup = setup
        self._rdzv = rdzv
        self._signals = signals
        self._spare_pool = spare_pool
        self._generations = generations
        self._restarts = restarts
        self._membership = membership
        self._processes = processes
        self._clock = clock
        self._captured = captured  # the script's own checkpoints, put back before the warm workers run it
        self._kept: list[WorkerProcess] = []  # warm workers kept across a rejoin

    def stand_by(self, state: RdzvState) -> RoundEnd | Round:
        """Stand by until the job ends, a restart opens a new round (REJOIN), or this node takes a
        lost node's place: then the round its warm workers now run (the caller supervises it)."""
        me = self._rdzv.me.node_id
        round_ = Round(state, -1, [], self._kept, None)
        self._membership.run(round_, NodePhase.SPARE)
        self._kept = []
        handed_over = False  # set once the warm workers run a lost node's ranks (the caller owns them then)
        # Warm workers wait in the Python bootstrap; a program run directly (--no-python) cannot wait
        # without running, so such a spare node starts its workers only when it takes a place.
        want = 0 if self._config.no_python else max(self._setup.nproc, self._config.spares)
        self._spare_pool.top_up(round_, want)
        logger.info(
            "all %d node(s) of the job are running: standing by as a spare node with %d warm worker(s)",
            len(state.participants),
            want,
        )
        try:
            while True:
                # Wakes early when a warm worker exits (it is restarted after a backoff).
                self._processes.wait_any_exit(round_.spares, self._config.monitor_interval_s)
                if self._signals.signum is not None:
                    self._rdzv.leave()
                    self._processes.stop(round_.spares, self._signals.signum, self._config.shutdown_timeout_s)
                    raise ShutdownRequested(self._signals.signum)
                current = self._rdzv.state()
                if current.closed:
                    self._processes.stop(round_.spares, signal.SIGTERM, self._config.shutdown_timeout_s)
                    return self._restarts.follow_close(current)
                rank = current.node_rank(me)
                if rank is not None and current.complete and current.recovering:
                    taken = self._take_over(round_, current, rank)
                    handed_over = isinstance(taken, Round)
                    return taken
                if rank is not None or not current.complete or not current.is_spare(me):
                    # A restart opened a new round (or this node was forgotten): join it like any
                    # node, keeping the warm workers for whatever role this node gets.
                    self._kept, round_.spares = [s for s in round_.spares if s.poll() is None], []
                    return RoundEnd.REJOIN
                self._spare_pool.check(round_)
                if self._spare_pool.due(round_):
                    self._spare_pool.top_up(round_, want)
        finally:
            if not handed_over:
                everyone = round_.workers + round_.spares
                self._processes.stop([w for w in everyone if w.poll() is None], signal.SIGKILL, 0.0)
                for worker in everyone:
                    worker.finish_output()

    def _take_over(self, round_: Round, new: RdzvState, node_rank: int) -> RoundEnd | Round:
        """This spare node was chosen for a lost node's place: its warm workers take those ranks."""
        started = self._clock.monotonic()
        round_.node_rank = node_rank
        self._rdzv.prefer_rank(node_rank)
        ready = [] if self._config.no_python else self._spare_pool.ready(round_, self._setup.nproc)
        if self._captured is not None:
            self._captured.restore(CAPTURED_RESTORE_S)
        if len(ready) < self._setup.nproc or not self._generations.enter_generation(
            round_, new, dict(enumerate(ready))
        ):
            why = " (--no-python: no warm workers)" if self._config.no_python else ""
            logger.error("this spare node could not take node rank %d%s: restarting the job", node_rank, why)
            self._restarts.open_next_round(new, [])
            return RoundEnd.REJOIN
        self._membership.run(round_, NodePhase.ACTIVE)
        logger.warning(
            "spare node takes node rank %d (ranks %d-%d) in generation %d, %.3f s after it was chosen",
            node_rank,
            round_.workers[0].spec.global_rank,
            round_.workers[-1].spec.global_rank,
            new.round,
            self._clock.monotonic() - started,
        )
        return round_

    def drop(self) -> None:
        """This node got a place in a round: the warm workers kept from a standby are not needed."""
        if self._kept:
            self._processes.stop(self._kept, signal.SIGTERM, self._config.shutdown_timeout_s)
            for worker in self._kept:
                worker.finish_output()
            self._kept = []
