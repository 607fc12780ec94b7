"""The round loop of one node: join a round, run the workers, observe, decide, act.

The Supervisor composes the parts that act (each given its collaborators at construction, none
reaching into another): ``SparePool`` (hot spares), ``HungWorkers`` and ``RaisedVerdict`` (verdicts
on single workers), ``NodeWatch`` (other nodes' heartbeats, spare-node replacement),
``InProcessRecovery`` (a failed rank's spare, a new generation in place), ``SpareNodeStandby`` (a
node the full job has no place for), ``RoundMaster`` (each round's worker store), ``ExitBarrier``
and ``Restarts`` (the torchrun path and the job's end). docs/architecture.md draws them.

Invariants: the decision of every tick comes from ``policy.decide`` (pure); the parts do the I/O.
Workers of a round never outlive it (``_supervise`` stops them on every exit path). Job-wide
decisions (restart, close) are compare-and-set writes to the rendezvous state, so exactly one
node's decision wins and every node follows it. Time comes from one clock, the rendezvous
client's, so every wait here runs on a fake clock in the unit tests.
"""

from __future__ import annotations

import logging
import signal

from resilrun.agent.liveness.heartbeat import StalenessJudge
from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.state.captured import CAPTURED_RESTORE_S, CapturedFolder
from resilrun.agent.supervision.exit_barrier import ExitBarrier
from resilrun.agent.supervision.inprocess import InProcessRecovery
from resilrun.agent.supervision.node_loss import NodeWatch, PeerLiveness
from resilrun.agent.supervision.policy import Action, AgentView, decide
from resilrun.agent.supervision.restarts import Restarts
from resilrun.agent.supervision.round_master import RoundMaster
from resilrun.agent.supervision.rounds import Membership, NodePhase, Round, RoundEnd, SignalFlag
from resilrun.agent.supervision.spare_nodes import SpareNodeStandby
from resilrun.agent.supervision.spare_pool import SparePool
from resilrun.agent.supervision.stragglers import StragglerSwap, SwapOutcome
from resilrun.agent.supervision.worker_verdicts import HungWorkers, RaisedVerdict
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.failures import FailureLedger
from resilrun.agent.workers.procs import Processes
from resilrun.agent.workers.specs import NodeSetup, worker_specs
from resilrun.agent.workers.step_fence import StepFence
from resilrun.config import Config
from resilrun.env import STOP_EXIT_CODES
from resilrun.errors import ShutdownRequested
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import RdzvState

logger = logging.getLogger(__name__)

__all__ = ["Supervisor", "SignalFlag"]


class Supervisor:
    """Runs the node's share of the job until it succeeds, fails for good, or is stopped."""

    def __init__(
        self,
        config: Config,
        setup: NodeSetup,
        rdzv: RendezvousClient,
        signals: SignalFlag,
        control: WorkerControl,
        telemetry: Telemetry | None = None,
        processes: Processes | None = None,
        liveness: PeerLiveness | None = None,
        membership: Membership | None = None,
        captured: CapturedFolder | None = None,
        fence: StepFence | None = None,
    ) -> None:
        """``telemetry``: events, status history and metrics (none: nothing recorded);
        ``processes``: real worker processes unless a test gives fakes; ``liveness``: confirms a
        node's silence on its peer channel before it counts as lost (node_loss.py);
        ``membership``: the node's place in the job, which this loop moves and the replication
        and status threads read (a fresh one when nothing else reads it); ``captured``: the
        script's own checkpoint folder (``--capture-dir``), put back before each round's workers
        start and told when one of them fails. The clock is ``rdzv.clock``."""
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.control = control
        self.config = config
        self.setup = setup
        self.rdzv = rdzv
        self.signals = signals
        self.run_id = rdzv.run_id
        self.membership = membership if membership is not None else Membership(rdzv.me.node_id)
        self.captured = captured
        self._processes = processes if processes is not None else Processes()
        clock = rdzv.clock
        self._clock = clock
        ledger = FailureLedger(rdzv.backend, rdzv.run_id)
        self.spare_pool = SparePool(
            config, setup, control, self.telemetry, signals, spawn=self._processes.spawn, clock=clock.monotonic
        )
        self.hung_workers = HungWorkers(config, control, self.telemetry)
        self.raised_verdict = RaisedVerdict(
            control, ledger, rdzv.backend, rdzv.me.node_id, config.heartbeat_interval_s, clock=clock.monotonic
        )
        self.restarts = Restarts(config, setup, rdzv, ledger, self.telemetry, self._processes)
        self.node_watch = NodeWatch(config, rdzv, control, self.telemetry, self.restarts, liveness)
        self.round_master = RoundMaster(
            config, setup, rdzv, signals, control, self.membership, self.node_watch, self.restarts
        )
        self.in_process = InProcessRecovery(
            config,
            setup,
            rdzv,
            control,
            self.telemetry,
            self.spare_pool,
            self.round_master,
            self.restarts,
            self.membership,
            clock,
            captured=captured,
        )
        self.standby = SpareNodeStandby(
            config,
            setup,
            rdzv,
            signals,
            self.spare_pool,
            self.in_process,
            self.restarts,
            self.membership,
            self._processes,
            clock,
            captured,
        )
        self.exit_barrier = ExitBarrier(config, rdzv, signals, self.node_watch, self.restarts)
        self.straggler_swap = (
            StragglerSwap(fence, control, self.in_process, self._processes, self.telemetry, rdzv, clock.monotonic)
            if fence is not None
            else None
        )

    # -- what other threads read --------------------------------------------------------------------
    @property
    def last_state(self) -> RdzvState | None:
        """The newest generation this node follows (None before the first round)."""
        return self.membership.state

    @property
    def current(self) -> Round | None:
        """What this node runs now (read by the status publisher through ``Round.snapshot()``)."""
        return self.membership.current

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        """Returns when the job succeeded.

        Raises:
            WorkerGroupFailed: the restart budget is spent; carries the root-cause report.
            ShutdownRequested: SIGTERM/SIGINT; workers were stopped and the job closed.
            RendezvousError: the store failed, the join timed out, or another node stopped the job.
        """
        while True:
            self.membership.phase = NodePhase.JOINING
            state = self.rdzv.join(on_wait=self.signals.raise_if_set)
            self.membership.enter(state)
            node_rank = state.node_rank(self.rdzv.me.node_id)
            if node_rank is None:  # the round is full: this node stands by as a spare node
                standby = self.standby.stand_by(state)
                # Chosen for a lost node's place: its warm workers now run that node's ranks.
                end = self._supervise(standby) if isinstance(standby, Round) else standby
                if end is RoundEnd.DONE:
                    return
                continue
            self.standby.drop()
            self.rdzv.prefer_rank(node_rank)
            if self._run_round(state, node_rank) is RoundEnd.DONE:
                return

    def _run_round(self, state: RdzvState, node_rank: int) -> RoundEnd:
        worker_store, master = self.round_master.resolve(state, node_rank)
        if master is None:
            return RoundEnd.REJOIN
        specs = worker_specs(self.config, self.setup, self.run_id, state, node_rank, master)
        if self.captured is not None:  # the script's own checkpoints where it looks, before it starts
            self.captured.restore(CAPTURED_RESTORE_S)
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
        round_ = Round(state, node_rank, [self._processes.spawn(spec) for spec in specs], [], worker_store)
        self.control.begin_generation([w.pid for w in round_.workers])
        self.membership.run(round_, NodePhase.ACTIVE)
        self.telemetry.round_started(state, node_rank, round_.workers)
        self.spare_pool.top_up(round_)
        return self._supervise(round_)

    def _supervise(self, round_: Round) -> RoundEnd:
        """Monitor a round to its end; its workers and spares never outlive it, on any exit path."""
        try:
            return self._monitor(round_)
        finally:
            everyone = round_.workers + round_.spares
            self._processes.stop([w for w in everyone if w.poll() is None], signal.SIGKILL, 0.0)
            for worker in everyone:
                worker.finish_output()
            round_.close_retired()

    def _monitor(self, round_: Round) -> RoundEnd:
        interval = self.config.monitor_interval_s
        grace = self.config.shutdown_timeout_s
        stop = self._processes.stop
        judge = StalenessJudge(self.config.heartbeat_timeout_s, self._clock)
        next_heartbeat_check = self._clock.monotonic()
        pushed = self.node_watch.pushed
        lost: tuple[str, ...] = ()
        while True:
            self._processes.wait_any_exit(round_.workers, interval)
            swapped = self.straggler_swap.tick(round_) if self.straggler_swap is not None else SwapOutcome.NONE
            if swapped is SwapOutcome.SWAPPED:
                continue  # a straggler's place changed process: look again at the new generation
            if swapped is SwapOutcome.LEFT:  # a spare node runs this node's ranks: stand by from here
                return RoundEnd.REJOIN
            state = round_.state
            codes = tuple(w.poll() for w in round_.workers)
            current = self.rdzv.state()
            if self._clock.monotonic() >= next_heartbeat_check:
                lost = self.node_watch.judge(judge, state, current)
                next_heartbeat_check = self._clock.monotonic() + self.config.heartbeat_interval_s
            elif pushed:  # free between the checks: an expiry is judged within a tick of being heard
                lost = self.node_watch.judge(judge, state, current, pushed_only=True)
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
                stop(everyone, signum, grace)
                self.rdzv.close(
                    "stopped", {"message": f"node {round_.node_rank} received {signal.Signals(signum).name}"}
                )
                self.rdzv.ack_closed()
                raise ShutdownRequested(signum)
            if action is Action.CLOSED:
                stop(everyone, signal.SIGTERM, grace)
                return self.restarts.follow_close(current)
            if action is Action.FOLLOW_RECOVERY:
                self.in_process.enter_generation(round_, current, {})
                continue
            if action is Action.REJOIN:
                logger.warning("round %d ended by another node: stopping workers to rejoin", state.round)
                stop(everyone, signal.SIGTERM, grace)
                return RoundEnd.REJOIN
            if action is Action.NODE_LOST:
                new = self.node_watch.replace(round_, lost, judge)
                if new is not None and self.in_process.enter_generation(round_, new, {}):
                    lost = ()
                    continue
                failures = self.node_watch.failures(state, lost, judge)
                return self.restarts.after_node_loss(state, failures, everyone)
            if action is Action.RESTART_JOB:
                if self.captured is not None:
                    self.captured.worker_failed()
                if any(code in STOP_EXIT_CODES for code in codes):
                    return self.restarts.stop_state_lost(round_)
                if self.in_process.recover(round_):
                    continue
                return self.restarts.restart_job(round_)
            if action is Action.FINISH:
                stop(round_.spares, signal.SIGTERM, grace)
                return self.exit_barrier.wait(state)
            if action is Action.OPEN_ROUND:
                logger.info("a node is waiting to join: opening round %d", state.round + 1)
                self.rdzv.next_round(state.round, failure=None, max_restarts=self.config.max_restarts)
