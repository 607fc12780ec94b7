"""Node loss: watching other nodes' heartbeats, describing a lost node, giving its place to a spare node.

Each node watches its ring successors and, on the first two node ranks, the spare nodes. A lost
participant's place goes to a spare node by one compare-and-set on the rendezvous state
(``protocol.decide_replace``: one decision per generation, whichever node's lands first); the
survivors then move to the new generation in their processes (``InProcessRecovery.enter_generation``).
"""

from __future__ import annotations

import logging
import time

from resilrun.agent.control import WorkerControl
from resilrun.agent.failures import ProcessFailure, root_cause
from resilrun.agent.heartbeat import StalenessJudge, watched_nodes
from resilrun.agent.heartbeat import read_counters as heartbeat_reader
from resilrun.agent.restarts import Restarts
from resilrun.agent.rounds import Round
from resilrun.agent.telemetry import Telemetry
from resilrun.config import Config
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import RdzvState, recovery_budget_spent

logger = logging.getLogger("resilrun.agent.supervisor")

# Ring successors each node watches: two, so that two adjacent nodes lost together are seen together
# and a watcher that is itself slow is covered (see heartbeat.watched_nodes).
WATCH_FANOUT = 2


class NodeWatch:
    """Heartbeat verdicts on other nodes and the spare-node replacement of lost ones."""

    def __init__(
        self,
        config: Config,
        rdzv: RendezvousClient,
        control: WorkerControl,
        telemetry: Telemetry,
        restarts: Restarts,
    ) -> None:
        self._config = config
        self._rdzv = rdzv
        self._control = control
        self._telemetry = telemetry
        self._restarts = restarts

    def judge(self, judge: StalenessJudge, state: RdzvState, current: RdzvState) -> tuple[str, ...]:
        """Read the heartbeats of the round's other nodes and of the spare nodes; returns the lost
        participants (a spare node that went silent is dropped from the spare list here)."""
        me = self._rdzv.me.node_id
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
        for node, counter in heartbeat_reader(self._rdzv.backend, self._rdzv.run_id, watched)().items():
            judge.observe(node, counter)
        stale = set(judge.stale())
        lost = set(judge.lost())
        dead_spares = tuple(n for n in spares if n in stale)
        if dead_spares:
            logger.warning("spare node(s) %s stopped heartbeating: no longer counted as spares", ", ".join(dead_spares))
            self._rdzv.drop_spares(dead_spares)
        return tuple(n for n in participants if n in lost)

    def failures(self, state: RdzvState, lost: tuple[str, ...], judge: StalenessJudge) -> list[ProcessFailure]:
        """One failure record per lost node (its first global rank, no process), told to telemetry."""
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
                    f"(--heartbeat-timeout {self._config.heartbeat_timeout_s:g})",
                )
            )
        self._telemetry.node_lost(state, failures, lost)
        return failures

    def replace(self, round_: Round, lost: tuple[str, ...], judge: StalenessJudge) -> RdzvState | None:
        """Give the lost nodes' places to spare nodes; returns the generation this node moves to in
        place, or None when no spare node took them (the caller restarts the job instead)."""
        state = round_.state
        if len(state.spares) < len(lost) and len(self._rdzv.state().spares) < len(lost):
            return None
        failures = self.failures(state, lost, judge)
        self._restarts.record(state.round, failures)
        cause = root_cause(failures)
        newest = self._control.newest_step([w.pid for w in round_.workers])
        newest = -1 if newest is None else newest
        new = self._rdzv.replace_nodes(
            state.round, lost, failure=cause.to_dict() if cause else None, newest_step=newest
        )
        if new.closed or not (new.recovering and new.complete and new.round > state.round):
            if not new.closed and recovery_budget_spent(new, newest):
                logger.warning(
                    "in-process recovery budget spent (%d in a row without a newer step than %d): the lost "
                    "node's place is not given to a spare node; restarting instead",
                    new.stalled_recoveries,
                    new.progress_step,
                )
            return None
        if new.node_rank(self._rdzv.me.node_id) != round_.node_rank:
            return None
        logger.error("%s", "; ".join(f"node {f.node_rank} ({f.host}) {f.message}" for f in failures))
        self._telemetry.nodes_replaced(new, failures)
        logger.warning(
            "spare node(s) %s take the lost node's place: generation %d (no restart)",
            ", ".join(new.participants[f.node_rank].hostname or "?" for f in failures if f.node_rank >= 0),
            new.round,
        )
        return new
