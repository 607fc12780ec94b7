"""The agent loop of one node: join a round, run the workers, observe, decide, apply.

In-process recovery (``inprocess``) and spare nodes (``spare_nodes``) are mixins of the one
Supervisor, in their own modules; what a round holds is in ``rounds``.

Invariants: the decision of every tick comes from ``policy.decide`` (pure); this module only does
I/O. Workers of a round never outlive it (``_run_round`` stops them on every exit path). Job-wide
decisions (restart, close) are compare-and-set writes to the rendezvous state, so exactly one node's
decision wins and every node follows it.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

from resilrun import keys
from resilrun.agent import procs
from resilrun.agent.control import WorkerControl
from resilrun.agent.failures import FailureLedger, ProcessFailure, collect_failure, format_report, root_cause
from resilrun.agent.heartbeat import StalenessJudge
from resilrun.agent.inprocess import InProcessRecovery
from resilrun.agent.policy import Action, AgentView, decide
from resilrun.agent.rounds import Round, RoundEnd, SignalFlag
from resilrun.agent.spare_nodes import WATCH_FANOUT, SpareNodes
from resilrun.agent.spare_pool import SparePool
from resilrun.agent.specs import NodeSetup, worker_specs
from resilrun.agent.telemetry import Telemetry
from resilrun.agent.worker_verdicts import HungWorkers, RaisedVerdict
from resilrun.config import Config
from resilrun.env import STATE_LOST_EXIT_CODE
from resilrun.errors import (
    RendezvousClosedError,
    RendezvousTimeoutError,
    ShutdownRequested,
    StateLostError,
    WorkerGroupFailed,
)
from resilrun.rendezvous.c10d import host_store
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import RdzvState

logger = logging.getLogger(__name__)


class Supervisor(InProcessRecovery, SpareNodes):
    """Runs the node's share of the job until it succeeds, fails for good, or is stopped."""

    def __init__(
        self,
        config: Config,
        setup: NodeSetup,
        rdzv: RendezvousClient,
        signals: SignalFlag,
        control: WorkerControl,
        telemetry: Telemetry | None = None,
    ) -> None:
        """``telemetry``: events, status history and metrics (resilrun.agent.telemetry; none: nothing recorded)."""
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.control = control
        self.config = config
        self.setup = setup
        self.rdzv = rdzv
        self.signals = signals
        self.run_id = rdzv.run_id
        self.last_state: RdzvState | None = None
        # A spare node's warm workers, kept across rounds it does not take part in.
        self._standby: list[procs.WorkerProcess] = []
        self.current: Round | None = None  # what this node runs now (read by the status publisher)
        self.spare_pool = SparePool(config, setup, control, self.telemetry, signals)
        self.hung_workers = HungWorkers(config, control, self.telemetry)
        self.failure_ledger = FailureLedger(rdzv.backend, rdzv.run_id)
        self.raised_verdict = RaisedVerdict(
            control, self.failure_ledger, rdzv.backend, rdzv.me.node_id, config.heartbeat_interval_s
        )

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        """Returns when the job succeeded.

        Raises:
            WorkerGroupFailed: the restart budget is spent; carries the root-cause report.
            ShutdownRequested: SIGTERM/SIGINT; workers were stopped and the job closed.
            RendezvousError: the store failed, the join timed out, or another node stopped the job.
        """
        while True:
            state = self.rdzv.join(on_wait=self.signals.raise_if_set)
            self.last_state = state
            node_rank = state.node_rank(self.rdzv.me.node_id)
            if node_rank is None:  # the round is full: this node stands by as a spare node
                standby = self._stand_by(state)
                # Chosen for a lost node's place: its warm workers now run that node's ranks.
                end = self._supervise(standby) if isinstance(standby, Round) else standby
                if end is RoundEnd.DONE:
                    return
                continue
            self._drop_standby()
            self.rdzv.me = replace(self.rdzv.me, preferred_rank=node_rank)
            if self._run_round(state) is RoundEnd.DONE:
                return

    def _run_round(self, state: RdzvState) -> RoundEnd:
        node_rank = state.node_rank(self.rdzv.me.node_id)
        if node_rank is None:  # cannot happen after a successful join
            return RoundEnd.REJOIN
        worker_store, master = self._round_master(state, node_rank)
        if master is None:
            return RoundEnd.REJOIN
        specs = worker_specs(self.config, self.setup, self.run_id, state, node_rank, master)
        world = sum(p.local_world_size for p in state.participants)
        logger.info(
            "round %d formed: %d node(s), world size %d, this node rank %d runs ranks %d-%d (restart %d/%d)",
            state.round,
            len(state.participants),
            world,
            node_rank,
            specs[0].global_rank,
            specs[-1].global_rank,
            state.restarts,
            self.config.max_restarts,
        )
        round_ = Round(state, node_rank, [procs.spawn(spec) for spec in specs], [], worker_store)
        self.control.begin_generation([w.pid for w in round_.workers])
        self.current = round_
        self.telemetry.round_started(state, node_rank, round_.workers)
        self.spare_pool.top_up(round_)
        return self._supervise(round_)

    def _supervise(self, round_: Round) -> RoundEnd:
        """Monitor a round to its end; its workers and spares never outlive it, on any exit path."""
        try:
            return self._monitor(round_)
        finally:
            everyone = round_.workers + round_.spares
            procs.stop([w for w in everyone if w.poll() is None], signal.SIGKILL, 0.0)
            for worker in everyone:
                worker.finish_output()

    def _monitor(self, round_: Round) -> RoundEnd:
        interval = self.config.monitor_interval_s
        grace = self.config.shutdown_timeout_s
        judge = StalenessJudge(self.config.heartbeat_timeout_s)
        next_heartbeat_check = 0.0
        lost: tuple[str, ...] = ()
        while True:
            procs.wait_any_exit(round_.workers, interval)
            state = round_.state
            codes = tuple(w.poll() for w in round_.workers)
            current = self.rdzv.state()
            if time.monotonic() >= next_heartbeat_check:
                lost = self._judge_nodes(judge, state, current)
                next_heartbeat_check = time.monotonic() + self.config.heartbeat_interval_s
            # A node judged lost before this node followed a recovery may be replaced already: only the
            # current generation's participants count (else a stale verdict restarts the whole job).
            lost = tuple(n for n in lost if state.node_rank(n) is not None)
            follow = (
                current.round > state.round
                and current.recovering
                and current.complete
                and current.node_rank(self.rdzv.me.node_id) == round_.node_rank
                and len(current.participants) == len(state.participants)
            )
            self.hung_workers.kill(round_)
            self.spare_pool.check(round_)
            self.raised_verdict.judge(round_, codes, current)
            action = decide(AgentView(state.round, codes, current, self.signals.signum, lost, follow))
            everyone = round_.workers + round_.spares
            if action is Action.WAIT:
                if self.spare_pool.due(round_):
                    self.spare_pool.top_up(round_)
                continue
            if action is Action.SHUTDOWN:
                signum = self.signals.signum or signal.SIGTERM
                logger.warning("received %s: stopping workers (grace %.0f s)", signal.Signals(signum).name, grace)
                procs.stop(everyone, signum, grace)
                self.rdzv.close(
                    "stopped", {"message": f"node {round_.node_rank} received {signal.Signals(signum).name}"}
                )
                self.rdzv.ack_closed()
                raise ShutdownRequested(signum)
            if action is Action.CLOSED:
                procs.stop(everyone, signal.SIGTERM, grace)
                return self._follow_close(current)
            if action is Action.FOLLOW_RECOVERY:
                self._enter_generation(round_, current, {})
                continue
            if action is Action.REJOIN:
                logger.warning("round %d ended by another node: stopping workers to rejoin", state.round)
                procs.stop(everyone, signal.SIGTERM, grace)
                return RoundEnd.REJOIN
            if action is Action.NODE_LOST:
                if self._replace_lost_nodes(round_, lost, judge):
                    lost = ()
                    continue
                return self._node_lost(state, lost, judge, everyone)
            if action is Action.RESTART_JOB:
                if any(code == STATE_LOST_EXIT_CODE for code in codes):
                    return self._stop_state_lost(round_)
                if self._recover_in_process(round_):
                    continue
                return self._restart_job(state, round_.node_rank, round_.workers, round_.spares)
            if action is Action.FINISH:
                procs.stop(round_.spares, signal.SIGTERM, grace)
                return self._exit_barrier(state)
            if action is Action.OPEN_ROUND:
                logger.info("a node is waiting to join: opening round %d", state.round + 1)
                self.rdzv.next_round(state.round, failure=None, max_restarts=self.config.max_restarts)

    def _describe(self, worker: procs.WorkerProcess, node_rank: int) -> ProcessFailure:
        return collect_failure(
            global_rank=worker.spec.global_rank,
            local_rank=worker.spec.local_rank,
            node_rank=node_rank,
            pid=worker.pid,
            exit_code=worker.popen.returncode,
            observed_at=worker.exit_observed_at or time.time(),
            error_file=worker.spec.error_file,
        )

    # -- actions --------------------------------------------------------------------------------
    def _node_lost(
        self, state: RdzvState, lost: tuple[str, ...], judge: StalenessJudge, workers: list[procs.WorkerProcess]
    ) -> RoundEnd:
        """Another node stopped heartbeating and no spare node can take its place: the job restarts."""
        failures = self._lost_failures(state, lost, judge)
        logger.error("%s", "; ".join(f"node {f.node_rank} ({f.host}) {f.message}" for f in failures))
        procs.stop(workers, signal.SIGTERM, self.config.shutdown_timeout_s)
        return self._open_next_round(state, failures)

    def _restart_job(
        self,
        state: RdzvState,
        node_rank: int,
        workers: list[procs.WorkerProcess],
        spares: list[procs.WorkerProcess] = (),  # type: ignore[assignment]  # read-only default
    ) -> RoundEnd:
        return self._open_next_round(state, self._stop_and_describe(workers, spares, node_rank))

    def _stop_and_describe(
        self, workers: list[procs.WorkerProcess], spares: list[procs.WorkerProcess], node_rank: int
    ) -> list[ProcessFailure]:
        """Stop every process and describe the failed workers, counting those caught mid-exit.

        A worker that raised wrote its error file before its interpreter's teardown, which can
        outlast the peer its failure broke: the agent then sees the peer die first. Such a worker is
        a failure (the root cause, by its error file's time) even though the stop ended it.
        """
        failed = {w.pid for w in workers if w.poll() not in (None, 0)}
        stopping_at = time.time()
        procs.stop([*workers, *spares], signal.SIGTERM, self.config.shutdown_timeout_s)
        # An error file written after the stop began is the stop's doing (a script that exits
        # non-zero on SIGTERM), not a failure.
        described = [self._describe(w, node_rank) for w in workers if w.pid in failed or w.spec.error_file.exists()]
        return [f for f in described if f.pid in failed or f.timestamp < stopping_at]

    def _stop_state_lost(self, round_: Round) -> RoundEnd:
        """Workers found their state in no tier: a restart would find the same, so the job stops now."""
        failures = self._stop_and_describe(round_.workers, round_.spares, round_.node_rank)
        self._record_failures(round_.state.round, failures)
        cause = root_cause(failures)
        new = self.rdzv.next_round(round_.state.round, failure=cause.to_dict() if cause else None, max_restarts=0)
        return self._follow_close(new) if new.closed else RoundEnd.REJOIN

    def _open_next_round(self, state: RdzvState, failures: list[ProcessFailure]) -> RoundEnd:
        self._record_failures(state.round, failures)
        cause = root_cause(failures)
        if cause is not None and cause.local_rank >= 0:
            logger.error(
                "rank %d failed (%s): stopping the job's workers",
                cause.global_rank,
                cause.message.splitlines()[0] if cause.message else "?",
            )
        new = self.rdzv.next_round(
            state.round, failure=cause.to_dict() if cause else None, max_restarts=self.config.max_restarts
        )
        self.telemetry.restart(state, new, cause)
        if new.closed:
            return self._follow_close(new)
        if new.round != state.round:
            logger.warning("restarting the job: restart %d of %d", new.restarts, self.config.max_restarts)
        return RoundEnd.REJOIN

    def _follow_close(self, state: RdzvState) -> RoundEnd:
        self.rdzv.ack_closed()
        if state.outcome == "succeeded":
            return RoundEnd.DONE
        if state.outcome == "failed":
            failures = self.failure_ledger.read(state.round)
            if not failures and state.failure:
                failures = [ProcessFailure.from_dict(state.failure)]
            report = format_report("resilrun: the job failed", failures)
            cause = root_cause(failures)
            if cause is not None and cause.exit_code == STATE_LOST_EXIT_CODE:
                raise StateLostError(
                    f"the job's state is lost: {cause.message.splitlines()[0] if cause.message else '?'}",
                    hint="a lost node and every node holding its replicas went together; use --replicas 2 or a "
                    "--checkpoint-uri to survive that; to start over from step 0 on purpose, use a new --rdzv-id",
                )
            summary = (
                f"rank {cause.global_rank} on node {cause.node_rank} ({cause.host}) failed: "
                f"{cause.message.splitlines()[0] if cause.message else cause.exit_code}"
                if cause
                else "workers failed"
            )
            raise WorkerGroupFailed(
                f"{summary}; no restart left (--max-restarts {self.config.max_restarts})",
                report=report,
                hint="see the root-cause report above and the per-rank logs under "
                f"{self.setup.log_root}; raise --max-restarts to retry more",
            )
        detail = (state.failure or {}).get("message", "")
        raise RendezvousClosedError(
            f"the job was stopped by another node{': ' + detail if detail else ''}", outcome=state.outcome or "stopped"
        )

    def _exit_barrier(self, state: RdzvState) -> RoundEnd:
        """Wait until every node's workers finished; nodes finishing early keep the store alive.

        A node says it finished with a key of its own, never a counter: a write retried by the store
        (etcd) counts it once, where a counter counted it twice and closed the job on a node whose
        workers still ran. The running nodes that no running agent watches any more (the first
        WATCH_FANOUT after this one on the ring) are watched here: one that goes silent before it
        finished lost its ranks' work, and the job restarts as on any node loss; one silent after it
        finished counts as finished. ``--exit-barrier-timeout`` after this node finished, the job is
        stopped, naming the nodes still running.
        """
        backend, clock, me = self.rdzv.backend, self.rdzv.clock, self.rdzv.me.node_id
        timeout = self.config.exit_barrier_timeout_s
        backend.set(keys.round_done(self.run_id, state.round, me), b"1")
        ring = [p.node_id for p in state.participants]
        index = ring.index(me) if me in ring else 0
        running = [n for n in ring[index + 1 :] + ring[:index] if n != me]  # ring order, from this node on
        if running:  # a one-node job has nobody to wait for
            logger.info("workers finished; waiting for the other nodes (at most %g s, --exit-barrier-timeout)", timeout)
        judge = StalenessJudge(self.config.heartbeat_timeout_s, clock)
        deadline = clock.monotonic() + timeout
        next_check = clock.monotonic()
        while True:
            self.signals.raise_if_set()
            current = self.rdzv.state()
            if current.closed:
                return self._follow_close(current)
            if current.round != state.round:
                return RoundEnd.REJOIN
            running = self._still_running(state.round, running)
            if not running:
                return self._follow_close(self.rdzv.close("succeeded"))
            now = clock.monotonic()
            if now >= next_check:
                next_check = now + self.config.heartbeat_interval_s
                lost = self._lost_before_finishing(state.round, running[:WATCH_FANOUT], judge)
                if lost:
                    return self._node_lost(state, lost, judge, [])
            if now >= deadline:
                return self._give_up_waiting(state, running)
            clock.sleep(self.config.monitor_interval_s)

    def _done_flags(self, round: int, nodes: list[str]) -> list[bool]:
        flags = self.rdzv.backend.get_many([keys.round_done(self.run_id, round, n) for n in nodes])
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

    def _lost_before_finishing(self, round: int, watched: list[str], judge: StalenessJudge) -> tuple[str, ...]:
        judge.forget_all_but(watched)
        for node in watched:
            judge.observe(node, self.rdzv.backend.add(keys.node_heartbeat(self.run_id, node), 0))
        lost = judge.lost()
        # A node that finished just before it went silent is not lost: read its flag once more.
        return tuple(n for n, done in zip(lost, self._done_flags(round, lost), strict=True) if not done)

    def _give_up_waiting(self, state: RdzvState, running: list[str]) -> RoundEnd:
        """The exit barrier's deadline passed: stop the job, so the nodes still running end too."""
        running = [n for n, done in zip(running, self._done_flags(state.round, running), strict=True) if not done]
        if not running:
            return self._follow_close(self.rdzv.close("succeeded"))
        timeout = self.config.exit_barrier_timeout_s
        names = ", ".join(
            f"node {rank} ({state.participants[rank].hostname or n})"
            for n in running
            if (rank := state.node_rank(n)) is not None
        )
        message = (
            f"the workers of {names} did not finish within {timeout:g} s of node "
            f"{state.node_rank(self.rdzv.me.node_id)}'s: gave up at the exit barrier (--exit-barrier-timeout)"
        )
        closed = self.rdzv.close("stopped", {"message": message})
        if (closed.failure or {}).get("message") != message:  # another node closed the job first
            return self._follow_close(closed)
        self.rdzv.ack_closed()
        raise RendezvousTimeoutError(
            message,
            hint="see the per-rank logs of the nodes named for workers stuck after training "
            "(a collective with peers that exited); raise --exit-barrier-timeout if they need longer",
        )

    # -- helpers --------------------------------------------------------------------------------
    def _round_master(self, state: RdzvState, node_rank: int) -> tuple[Any, str | None]:
        """The round's worker store: hosted by node rank 0's agent, fresh every round.

        A fresh store per round is what keeps a restarted worker from reading the gloo addresses
        of the previous attempt (torchrun 2.13's stale-store trap).
        """
        key = keys.round_master(self.run_id, state.round)
        if node_rank == 0:
            # An IP literal (--local-addr) is bound exactly; a host name keeps the wildcard.
            store = host_store(self.setup.addr, 0, timedelta(seconds=self.rdzv_read_timeout()))
            master = f"{self.setup.addr}:{store.port}"
            self.rdzv.backend.set(key, master.encode())
            return store, master
        # Node rank 0 may be dead already (two nodes lost a heartbeat check apart: the generation
        # that replaced the first still names the second): watch it, or this wait lasts the join timeout.
        leader = state.participants[0].node_id
        judge = StalenessJudge(self.config.heartbeat_timeout_s)
        next_check = 0.0
        deadline = time.monotonic() + self.rdzv.join_timeout.total_seconds()
        while time.monotonic() < deadline:
            self.signals.raise_if_set()
            raw = self.rdzv.backend.get(key)
            if raw is not None:
                return None, raw.decode()
            current = self.rdzv.state()
            if current.closed or current.round != state.round:
                return None, None
            if time.monotonic() >= next_check:
                judge.observe(leader, self.rdzv.backend.add(keys.node_heartbeat(self.run_id, leader), 0))
                next_check = time.monotonic() + self.config.heartbeat_interval_s
                if judge.stale():
                    self._leader_lost(state, leader, judge)
                    return None, None
            time.sleep(0.02)
        return None, None

    def _leader_lost(self, state: RdzvState, leader: str, judge: StalenessJudge) -> None:
        """Node rank 0 died before hosting this generation's worker store: give its place to a spare
        node if one stands by, else restart the job (whichever decision lands first, every node follows)."""
        failures = self._lost_failures(state, (leader,), judge)
        logger.error("node 0 (%s) %s, before it hosted the worker store", failures[0].host, failures[0].message)
        self._record_failures(state.round, failures)
        cause = root_cause(failures)
        workers = self.current.workers if self.current is not None else []
        newest = self.control.newest_step([w.pid for w in workers])
        failure = cause.to_dict() if cause else None
        new = self.rdzv.replace_nodes(
            state.round, (leader,), failure=failure, newest_step=-1 if newest is None else newest
        )
        if not (new.round > state.round and new.recovering) and not new.closed:
            self.rdzv.next_round(
                state.round, failure=cause.to_dict() if cause else None, max_restarts=self.config.max_restarts
            )

    def replica_targets(self) -> list[str]:
        """Replica servers of the next ``--replicas`` nodes in node-rank order (a ring)."""
        state = self.last_state
        if state is None or self.config.replicas < 1:
            return []
        rank = state.node_rank(self.rdzv.me.node_id)
        nodes = state.participants
        if rank is None or len(nodes) < 2:
            return []
        count = min(self.config.replicas, len(nodes) - 1)
        return [a for a in (nodes[(rank + i) % len(nodes)].peer_addr for i in range(1, count + 1)) if a]

    def peer_addresses(self) -> list[str]:
        state = self.last_state
        if state is None:
            return []
        return [p.peer_addr for p in state.participants if p.node_id != self.rdzv.me.node_id and p.peer_addr]

    def world_size(self) -> int:
        """World size of the current round (0 before the first)."""
        state = self.last_state
        return sum(p.local_world_size for p in state.participants) if state is not None else 0

    def rdzv_read_timeout(self) -> float:
        return self.config.rdzv.read_timeout_s

    def _record_failures(self, round: int, failures: list[ProcessFailure]) -> None:
        """Each failure once, in the store and the telemetry (the restart path describes again what
        an in-process attempt recorded)."""
        self.telemetry.failures(round, self.failure_ledger.record(round, failures))
