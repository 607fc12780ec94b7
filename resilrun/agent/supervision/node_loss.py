"""Node loss: watching other nodes' heartbeats, describing a lost node, giving its place to a spare node.

Each node watches its ring successors and, on the first two node ranks, the spare nodes. A lost
participant's place goes to a spare node by one compare-and-set on the rendezvous state
(``protocol.decide_replace``: one decision per generation, whichever node's lands first); the
survivors then move to the new generation in their processes (``InProcessRecovery.enter_generation``).

A heartbeat verdict is confirmed before it counts (``NodeWatch.confirm_lost``): heartbeats are
counters in the rendezvous store, and a party that can write the store but lacks the job secret can
hold a live node's counter still. A node whose counter stood still past the timeout but whose agent
proves the job secret on its replica server within one heartbeat interval (``PeerLiveness``) is not
lost; the watcher says so and watches it afresh. A dead, frozen or cut-off node cannot answer, so a
real loss costs at most one more interval to confirm (a refused connection costs nothing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from resilrun.agent.liveness.heartbeat import StalenessJudge, read_heartbeats, watched_nodes
from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.supervision.restarts import Restarts
from resilrun.agent.supervision.rounds import Round
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.failures import ProcessFailure, root_cause
from resilrun.config import Config
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import NodeInfo, RdzvState, recovery_budget_spent
from resilrun.tiers.peer import ReplicationError, alive
from resilrun.tiers.peer.wire import Credential

logger = logging.getLogger(__name__)

# Ring successors each node watches: two, so that two adjacent nodes lost together are seen together
# and a watcher that is itself slow is covered (see heartbeat.watched_nodes).
WATCH_FANOUT = 2


class PeerLiveness:
    """Asks a node's agent, over its replica server's authenticated channel, whether it is alive."""

    def __init__(self, secret: Credential, timeout_s: float) -> None:
        self._secret = secret
        self._timeout = timedelta(seconds=timeout_s)

    def answers(self, node: NodeInfo) -> bool:
        """Whether ``node``'s own agent proved the job secret and its node id within the timeout."""
        if not node.peer_addr:
            return False
        try:
            return alive(node.peer_addr, self._secret, self._timeout) == node.node_id
        except ReplicationError as exc:
            logger.debug("node %s did not answer on its peer channel: %s", node.node_id, exc.message)
            return False


class NodeWatch:
    """Heartbeat verdicts on other nodes and the spare-node replacement of lost ones."""

    def __init__(
        self,
        config: Config,
        rdzv: RendezvousClient,
        control: WorkerControl,
        telemetry: Telemetry,
        restarts: Restarts,
        liveness: PeerLiveness | None = None,
    ) -> None:
        """``liveness``: confirms heartbeat verdicts (None: a counter standing still is proof enough,
        as when replication is off and nodes run no replica server)."""
        self._config = config
        self._rdzv = rdzv
        self._control = control
        self._telemetry = telemetry
        self._restarts = restarts
        self._liveness = liveness
        self._refuted: set[str] = set()  # nodes whose stalled counter was refuted (warned once each)

    def confirm_lost(
        self, states: Iterable[RdzvState], candidates: Iterable[str], judge: StalenessJudge
    ) -> tuple[str, ...]:
        """The ``candidates`` (judged stale) whose agents do not prove they are alive.

        ``states``: where to look the nodes up (participants and spares). A node that answers is
        watched afresh (``judge.revive``) and is not lost; the first time, the watcher warns that
        its heartbeat key may have been tampered with."""
        candidates = tuple(candidates)
        if self._liveness is None or not candidates:
            return candidates
        infos = {n.node_id: n for state in states for n in (*state.participants, *state.spares)}
        known = [infos[n] for n in candidates if n in infos]
        # Asked at once: nodes lost together (a rack) cost one timeout to confirm, not one each.
        with ThreadPoolExecutor(max_workers=max(1, len(known)), thread_name_prefix="resilrun-liveness") as pool:
            answered = {n.node_id for n, ok in zip(known, pool.map(self._liveness.answers, known), strict=True) if ok}
        lost = []
        for node_id in candidates:
            node = infos.get(node_id)
            if node is None or node_id not in answered:
                lost.append(node_id)
                continue
            age = judge.age(node_id) or 0.0
            judge.revive(node_id)
            level = logging.DEBUG if node_id in self._refuted else logging.WARNING
            self._refuted.add(node_id)
            logger.log(
                level,
                "the heartbeat counter of %s (%s) has not moved in the store for %.1f s, yet its agent proved the "
                "job secret on its replica server: not judged lost (a party with access to the store may be "
                "holding its counter still, or the node's store link is cut)",
                node.hostname or node_id,
                node_id,
                age,
            )
        return tuple(lost)

    @property
    def pushed(self) -> bool:
        """Whether the store pushes liveness (leases followed by watches): a look between the
        heartbeat checks then costs the store nothing (``judge(pushed_only=True)``)."""
        return self._rdzv.backend.leases()

    def judge(
        self, judge: StalenessJudge, state: RdzvState, current: RdzvState, *, pushed_only: bool = False
    ) -> tuple[str, ...]:
        """Read the heartbeats of the round's other nodes and of the spare nodes; returns the lost
        participants (a spare node that went silent is dropped from the spare list here).
        ``pushed_only``: look only at what the store pushed (``read_heartbeats``)."""
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
        readings = read_heartbeats(self._rdzv.backend, self._rdzv.run_id, watched, pushed_only=pushed_only)
        for node, reading in readings.items():
            judge.observe_reading(node, reading)
        stale = set(judge.stale())
        lost = set(judge.lost())
        confirmed = set(self.confirm_lost((state, current), [n for n in watched if n in stale], judge))
        stale, lost = stale & confirmed, lost & confirmed
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
        if not self._control.uses_api([w.pid for w in round_.workers]):
            # A script that does not use resilrun's API (a plain torchrun script) cannot move to a
            # new generation in its processes: its collectives would wait on the lost node until
            # their own timeout. It restarts, and the spare node joins the next round instead.
            logger.info("this node's workers do not use resilrun's API: the job restarts to replace the lost node")
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
