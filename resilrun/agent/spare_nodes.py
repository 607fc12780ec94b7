"""Spare nodes: standing by with warm workers, taking a lost node's place, watching heartbeats.

A mixin of :class:`resilrun.agent.supervisor.Supervisor` (split out to keep modules small). An agent
that finds the job full stands by; a survivor that sees a node go silent gives its node rank to a
spare node by one compare-and-set (one decision per generation), and every survivor moves to the new
generation in its processes.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from resilrun.agent import procs
from resilrun.agent.control import WorkerControl
from resilrun.agent.failures import ProcessFailure, root_cause
from resilrun.agent.heartbeat import StalenessJudge, watched_nodes
from resilrun.agent.heartbeat import read_counters as heartbeat_reader
from resilrun.agent.rounds import Round, RoundEnd, SignalFlag
from resilrun.agent.spare_pool import SparePool
from resilrun.agent.specs import NodeSetup
from resilrun.agent.telemetry import Telemetry
from resilrun.config import Config
from resilrun.errors import ShutdownRequested
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import RdzvState, recovery_budget_spent

logger = logging.getLogger("resilrun.agent.supervisor")

# Ring successors each node watches: two, so that two adjacent nodes lost together are seen together
# and a watcher that is itself slow is covered (see heartbeat.watched_nodes).
WATCH_FANOUT = 2


class SpareNodes:
    """Spare-node standby and lost-node replacement (see the module docstring)."""

    config: Config
    setup: NodeSetup
    control: WorkerControl
    rdzv: RendezvousClient
    signals: SignalFlag
    telemetry: Telemetry
    run_id: str
    last_state: RdzvState | None
    current: Round | None
    _standby: list[procs.WorkerProcess]
    spare_pool: SparePool

    if TYPE_CHECKING:

        def _follow_close(self, state: RdzvState) -> RoundEnd: ...
        def _open_next_round(self, state: RdzvState, failures: list[ProcessFailure]) -> RoundEnd: ...
        def _record_failures(self, round: int, failures: list[ProcessFailure]) -> None: ...
        def _enter_generation(
            self, round_: Round, new: RdzvState, replacements: dict[int, procs.WorkerProcess]
        ) -> bool: ...

    def _stand_by(self, state: RdzvState) -> RoundEnd | Round:
        """A spare node: warm workers wait to take a lost node's ranks; the job is followed meanwhile.

        Returns how the standby ended, or, when this node took a lost node's place, the round its
        warm workers now run (the caller supervises it like any other; no recursion into the loop).
        """
        me = self.rdzv.me.node_id
        round_ = Round(state, -1, [], self._standby, None)
        self.current = round_
        self._standby = []
        handed_over = False  # set once the warm workers run a lost node's ranks (the caller owns them then)
        # Warm workers wait in the Python bootstrap; a program run directly (--no-python) cannot wait
        # without running, so such a spare node starts its workers only when it takes a place.
        want = 0 if self.config.no_python else max(self.setup.nproc, self.config.spares)
        self.spare_pool.top_up(round_, want)
        logger.info(
            "all %d node(s) of the job are running: standing by as a spare node with %d warm worker(s)",
            len(state.participants),
            want,
        )
        try:
            while True:
                time.sleep(self.config.monitor_interval_s)
                if self.signals.signum is not None:
                    self.rdzv.leave()
                    procs.stop(round_.spares, self.signals.signum, self.config.shutdown_timeout_s)
                    raise ShutdownRequested(self.signals.signum)
                current = self.rdzv.state()
                if current.closed:
                    procs.stop(round_.spares, signal.SIGTERM, self.config.shutdown_timeout_s)
                    return self._follow_close(current)
                rank = current.node_rank(me)
                if rank is not None and current.complete and current.recovering:
                    taken = self._take_over(round_, current, rank)
                    if isinstance(taken, Round):
                        handed_over = True
                    return taken
                if rank is not None or not current.complete or not current.is_spare(me):
                    # A restart opened a new round (or this node was forgotten): join it like any
                    # node, keeping the warm workers for whatever role this node gets.
                    self._standby, round_.spares = [s for s in round_.spares if s.poll() is None], []
                    return RoundEnd.REJOIN
                self.spare_pool.check(round_)
                if self.spare_pool.due(round_):
                    self.spare_pool.top_up(round_, want)
        finally:
            if not handed_over:
                everyone = round_.workers + round_.spares
                procs.stop([w for w in everyone if w.poll() is None], signal.SIGKILL, 0.0)
                for worker in everyone:
                    worker.finish_output()

    def _take_over(self, round_: Round, new: RdzvState, node_rank: int) -> RoundEnd | Round:
        """This spare node was chosen for a lost node's place: its warm workers take those ranks."""
        started = time.monotonic()
        round_.node_rank = node_rank
        self.rdzv.me = replace(self.rdzv.me, preferred_rank=node_rank)
        ready = [] if self.config.no_python else self.spare_pool.ready(round_, self.setup.nproc)
        if len(ready) < self.setup.nproc or not self._enter_generation(round_, new, dict(enumerate(ready))):
            why = " (--no-python: no warm workers)" if self.config.no_python else ""
            logger.error("this spare node could not take node rank %d%s: restarting the job", node_rank, why)
            self._open_next_round(new, [])
            return RoundEnd.REJOIN
        logger.warning(
            "spare node takes node rank %d (ranks %d-%d) in generation %d, %.3f s after it was chosen",
            node_rank,
            round_.workers[0].spec.global_rank,
            round_.workers[-1].spec.global_rank,
            new.round,
            time.monotonic() - started,
        )
        return round_

    def _drop_standby(self) -> None:
        if self._standby:
            procs.stop(self._standby, signal.SIGTERM, self.config.shutdown_timeout_s)
            for worker in self._standby:
                worker.finish_output()
            self._standby = []

    def _judge_nodes(self, judge: StalenessJudge, state: RdzvState, current: RdzvState) -> tuple[str, ...]:
        """Read the heartbeats of the round's other nodes and of the spare nodes; returns the lost
        participants (a spare node that went silent is dropped from the spare list here)."""
        me = self.rdzv.me.node_id
        ring = [p.node_id for p in state.participants]
        # Each node watches its WATCH_FANOUT ring successors (O(N) store reads for the job, not
        # O(N^2)); the first two node ranks also watch the spare nodes.
        participants = watched_nodes(ring, me, WATCH_FANOUT)
        watches_spares = ring.index(me) < 2 if me in ring else False
        spares = [n.node_id for n in current.spares] if current.round == state.round and watches_spares else []
        watched = participants + spares
        judge.forget_all_but(watched)
        if not watched:
            return ()
        for node, counter in heartbeat_reader(self.rdzv.backend, self.run_id, watched)().items():
            judge.observe(node, counter)
        stale = set(judge.stale())
        lost = set(judge.lost())
        dead_spares = tuple(n for n in spares if n in stale)
        if dead_spares:
            logger.warning("spare node(s) %s stopped heartbeating: no longer counted as spares", ", ".join(dead_spares))
            self.rdzv.drop_spares(dead_spares)
        return tuple(n for n in participants if n in lost)

    def _replace_lost_nodes(self, round_: Round, lost: tuple[str, ...], judge: StalenessJudge) -> bool:
        """Give a lost node's place to a spare node; survivors move to the new generation in place.

        Returns False when no spare node can take it (the caller restarts the job instead).
        """
        state = round_.state
        if len(state.spares) < len(lost) and len(self.rdzv.state().spares) < len(lost):
            return False
        failures = self._lost_failures(state, lost, judge)
        self._record_failures(state.round, failures)
        cause = root_cause(failures)
        newest = self.control.newest_step([w.pid for w in round_.workers])
        newest = -1 if newest is None else newest
        new = self.rdzv.replace_nodes(state.round, lost, failure=cause.to_dict() if cause else None, newest_step=newest)
        if new.closed or not (new.recovering and new.complete and new.round > state.round):
            if not new.closed and recovery_budget_spent(new, newest):
                logger.warning(
                    "in-process recovery budget spent (%d in a row without a newer step than %d): the lost "
                    "node's place is not given to a spare node; restarting instead",
                    new.stalled_recoveries,
                    new.progress_step,
                )
            return False
        if new.node_rank(self.rdzv.me.node_id) != round_.node_rank:
            return False
        logger.error("%s", "; ".join(f"node {f.node_rank} ({f.host}) {f.message}" for f in failures))
        self.telemetry.nodes_replaced(new, failures)
        logger.warning(
            "spare node(s) %s take the lost node's place: generation %d (no restart)",
            ", ".join(new.participants[f.node_rank].hostname or "?" for f in failures if f.node_rank >= 0),
            new.round,
        )
        return self._enter_generation(round_, new, {})

    def _lost_failures(self, state: RdzvState, lost: tuple[str, ...], judge: StalenessJudge) -> list[ProcessFailure]:
        failures = []
        for node_id in lost:
            rank = state.node_rank(node_id)
            node = state.participants[rank] if rank is not None else None
            base = sum(p.local_world_size for p in state.participants[: rank or 0])
            failures.append(
                ProcessFailure(
                    global_rank=base,
                    local_rank=-1,
                    node_rank=rank if rank is not None else -1,
                    host=node.hostname if node else node_id,
                    pid=0,
                    exit_code=0,
                    timestamp=time.time(),
                    message=f"node lost: no heartbeat for {judge.age(node_id) or 0:.1f} s "
                    f"(--heartbeat-timeout {self.config.heartbeat_timeout_s:g})",
                )
            )
        self.telemetry.node_lost(state, failures, lost)
        return failures
