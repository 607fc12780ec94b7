"""The exit barrier: a node whose workers finished waits for the others, then the job closes.

A node says it finished with a key of its own, never a counter: a write retried by the store
(etcd) counts it once, where a counter counted it twice and closed the job on a node whose workers
still ran. The running nodes that no running agent watches any more (the first ``WATCH_FANOUT``
after this one on the ring) are watched here: one that goes silent before it finished lost its
ranks' work, and the job restarts as on any node loss; one silent after it finished counts as
finished. ``--exit-barrier-timeout`` after this node finished, the job is stopped, naming the nodes
still running.
"""

from __future__ import annotations

import logging

from resilrun import keys
from resilrun.agent.liveness.heartbeat import StalenessJudge, read_heartbeats
from resilrun.agent.supervision.node_loss import WATCH_FANOUT, NodeWatch
from resilrun.agent.supervision.restarts import Restarts
from resilrun.agent.supervision.rounds import RoundEnd, SignalFlag
from resilrun.config import Config
from resilrun.errors import RendezvousTimeoutError
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import RdzvState

logger = logging.getLogger(__name__)


class ExitBarrier:
    """Waits, after this node's workers all exited 0, until every node's did (module docstring)."""

    def __init__(
        self,
        config: Config,
        rdzv: RendezvousClient,
        signals: SignalFlag,
        node_watch: NodeWatch,
        restarts: Restarts,
    ) -> None:
        self._config = config
        self._rdzv = rdzv
        self._signals = signals
        self._node_watch = node_watch
        self._restarts = restarts

    def wait(self, state: RdzvState) -> RoundEnd:
        """DONE once every node finished (this node closes the job as succeeded, or follows the
        close); REJOIN when a node was lost meanwhile and the job restarts.

        Raises:
            RendezvousTimeoutError: the deadline passed with nodes still running (the job is stopped).
        """
        rdzv, clock = self._rdzv, self._rdzv.clock
        me = rdzv.me.node_id
        timeout = self._config.exit_barrier_timeout_s
        rdzv.backend.set(keys.round_done(rdzv.run_id, state.round, me), b"1")
        ring = [p.node_id for p in state.participants]
        index = ring.index(me) if me in ring else 0
        running = [n for n in ring[index + 1 :] + ring[:index] if n != me]  # ring order, from this node on
        if running:  # a one-node job has nobody to wait for
            logger.info("workers finished; waiting for the other nodes (at most %g s, --exit-barrier-timeout)", timeout)
        judge = StalenessJudge(self._config.heartbeat_timeout_s, clock)
        deadline = clock.monotonic() + timeout
        next_check = clock.monotonic()
        while True:
            self._signals.raise_if_set()
            current = rdzv.state()
            if current.closed:
                return self._restarts.follow_close(current)
            if current.round != state.round:
                return RoundEnd.REJOIN
            running = self._still_running(state.round, running)
            if not running:
                return self._restarts.follow_close(rdzv.close("succeeded"))
            now = clock.monotonic()
            if now >= next_check:
                next_check = now + self._config.heartbeat_interval_s
                lost = self._lost_before_finishing(state, running[:WATCH_FANOUT], judge)
                if lost:
                    return self._restarts.after_node_loss(state, self._node_watch.failures(state, lost, judge), [])
            if now >= deadline:
                return self._give_up(state, running)
            clock.sleep(self._config.monitor_interval_s)

    def _done_flags(self, round: int, nodes: list[str]) -> list[bool]:
        flags = self._rdzv.backend.get_many([keys.round_done(self._rdzv.run_id, round, n) for n in nodes])
        return [flag is not None for flag in flags]

    def _still_running(self, round: int, running: list[str]) -> list[str]:
        """``running`` less the nodes that finished since: reads the first few until one is still
        running (a node never un-finishes), so a poll costs WATCH_FANOUT keys, not one per node."""
        while running:
            head = running[:WATCH_FANOUT]
            finished = {n for n, done in zip(head, self._done_flags(round, head), strict=True) if done}
            if not finished:
                return running
            running = [n for n in running if n not in finished]
        return running

    def _lost_before_finishing(self, state: RdzvState, watched: list[str], judge: StalenessJudge) -> tuple[str, ...]:
        judge.forget_all_but(watched)
        for node, reading in read_heartbeats(self._rdzv.backend, self._rdzv.run_id, watched).items():
            judge.observe_reading(node, reading)
        lost = judge.lost()
        # A node that finished just before it went silent is not lost: read its flag once more.
        lost = [n for n, done in zip(lost, self._done_flags(state.round, lost), strict=True) if not done]
        return self._node_watch.confirm_lost((state,), lost, judge)

    def _give_up(self, state: RdzvState, running: list[str]) -> RoundEnd:
        """The deadline passed: stop the job, so the nodes still running end too."""
        running = [n for n, done in zip(running, self._done_flags(state.round, running), strict=True) if not done]
        if not running:
            return self._restarts.follow_close(self._rdzv.close("succeeded"))
        timeout = self._config.exit_barrier_timeout_s
        names = ", ".join(
            f"node {rank} ({state.participants[rank].hostname or n})"
            for n in running
            if (rank := state.node_rank(n)) is not None
        )
        message = (
            f"the workers of {names} did not finish within {timeout:g} s of node "
            f"{state.node_rank(self._rdzv.me.node_id)}'s: gave up at the exit barrier (--exit-barrier-timeout)"
        )
        closed = self._rdzv.close("stopped", {"message": message})
        if (closed.failure or {}).get("message") != message:  # another node closed the job first
            return self._restarts.follow_close(closed)
        self._rdzv.ack_closed()
        raise RendezvousTimeoutError(
            message,
            hint="see the per-rank logs of the nodes named for workers stuck after training "
            "(a collective with peers that exited); raise --exit-barrier-timeout if they need longer",
        )
