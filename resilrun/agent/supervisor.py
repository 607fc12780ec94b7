"""The agent loop of one node: join a round, run the workers, observe, decide, apply.

Invariants: the decision of every tick comes from ``policy.decide`` (pure); this module only does
I/O. Workers of a round never outlive it (``_run_round`` stops them on every exit path). Job-wide
decisions (restart, close) are compare-and-set writes to the rendezvous state, so exactly one node's
decision wins and every node follows it.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from enum import Enum
from typing import Any

from resilrun import keys
from resilrun.agent import procs
from resilrun.agent.control import WorkerControl
from resilrun.agent.failures import ProcessFailure, collect_failure, format_report, root_cause
from resilrun.agent.heartbeat import StalenessJudge, watched_nodes
from resilrun.agent.heartbeat import read_counters as heartbeat_reader
from resilrun.agent.policy import Action, AgentView, decide
from resilrun.agent.specs import NodeSetup, spare_spec, worker_specs
from resilrun.agent.telemetry import Telemetry
from resilrun.config import Config
from resilrun.env import STATE_LOST_EXIT_CODE
from resilrun.errors import RendezvousClosedError, ShutdownRequested, StateLostError, WorkerGroupFailed
from resilrun.rendezvous.c10d import host_store
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import RdzvState

logger = logging.getLogger(__name__)

# A failure in the first seconds finds the spare still importing torch: waiting for it (still far
# quicker than a restart) beats giving up on in-process recovery. Survivors wait longer than this.
_SPARE_READY_TIMEOUT_S = 30.0
# Ring successors each node watches: two, so that two adjacent nodes lost together are seen together
# and a watcher that is itself slow is covered (see heartbeat.watched_nodes).
_WATCH_FANOUT = 2


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


class _RoundEnd(Enum):
    DONE = "done"
    REJOIN = "rejoin"


@dataclass
class _Round:
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


class Supervisor:
    """Runs the node's share of the job until it succeeds, fails for good, or is stopped."""

    # Events, status history and metrics (resilrun.agent.telemetry); the base class records nothing.
    telemetry: Telemetry = Telemetry()

    def __init__(
        self, config: Config, setup: NodeSetup, rdzv: RendezvousClient, signals: SignalFlag, control: WorkerControl
    ) -> None:
        self.control = control
        self.config = config
        self.setup = setup
        self.rdzv = rdzv
        self.signals = signals
        self.run_id = rdzv.run_id
        self.last_state: RdzvState | None = None
        # A spare node's warm workers, kept across rounds it does not take part in.
        self._standby: list[procs.WorkerProcess] = []
        self.current: _Round | None = None  # what this node runs now (read by the status publisher)

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
                if self._stand_by(state) is _RoundEnd.DONE:
                    return
                continue
            self._drop_standby()
            self.rdzv.me = replace(self.rdzv.me, preferred_rank=node_rank)
            if self._run_round(state) is _RoundEnd.DONE:
                return

    def _run_round(self, state: RdzvState) -> _RoundEnd:
        node_rank = state.node_rank(self.rdzv.me.node_id)
        if node_rank is None:  # cannot happen after a successful join
            return _RoundEnd.REJOIN
        worker_store, master = self._round_master(state, node_rank)
        if master is None:
            return _RoundEnd.REJOIN
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
        round_ = _Round(state, node_rank, [procs.spawn(spec) for spec in specs], [], worker_store)
        self.control.begin_generation([w.pid for w in round_.workers])
        self.current = round_
        self.telemetry.round_started(state, node_rank, round_.workers)
        self._top_up_spares(round_)
        try:
            return self._monitor(round_)
        finally:
            everyone = round_.workers + round_.spares
            procs.stop([w for w in everyone if w.poll() is None], signal.SIGKILL, 0.0)
            for worker in everyone:
                worker.finish_output()

    def _monitor(self, round_: _Round) -> _RoundEnd:
        interval = self.config.monitor_interval_s
        grace = self.config.shutdown_timeout_s
        judge = StalenessJudge(self.config.heartbeat_timeout_s)
        next_heartbeat_check = 0.0
        lost: tuple[str, ...] = ()
        while True:
            time.sleep(interval)
            state = round_.state
            codes = tuple(w.poll() for w in round_.workers)
            current = self.rdzv.state()
            if time.monotonic() >= next_heartbeat_check:
                lost = self._judge_nodes(judge, state, current)
                next_heartbeat_check = time.monotonic() + self.config.heartbeat_interval_s
            follow = (
                current.round > state.round
                and current.recovering
                and current.complete
                and current.node_rank(self.rdzv.me.node_id) == round_.node_rank
                and len(current.participants) == len(state.participants)
            )
            self._kill_hung_workers(round_)
            action = decide(AgentView(state.round, codes, current, self.signals.signum, lost, follow))
            everyone = round_.workers + round_.spares
            if action is Action.WAIT:
                if round_.respawn_at is not None and time.monotonic() >= round_.respawn_at:
                    self._top_up_spares(round_)
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
                return _RoundEnd.REJOIN
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

    def _kill_hung_workers(self, round_: _Round) -> None:
        """A worker frozen (no heartbeat) or stuck (no committed step) for too long is killed, so the
        ordinary failure path (a spare, or a restart) takes over."""
        for worker in round_.workers:
            if worker.poll() is not None or worker.pid in round_.killed:
                continue
            silent = self.control.silent_for(worker.pid)
            stalled = self.control.stalled_for(worker.pid)
            pending = self.control.first_step_pending_for(worker.pid)
            reason = None
            if silent is not None and silent > self.config.heartbeat_timeout_s:
                reason = f"no heartbeat for {silent:.1f} s (frozen?)"
            elif stalled is not None and stalled > self.config.hang_timeout_s:
                reason = f"no step committed for {stalled:.0f} s (--hang-timeout {self.config.hang_timeout_s:g})"
            elif pending is not None and pending > self.config.first_step_timeout_s:
                reason = (
                    f"no first step after {pending:.0f} s (--first-step-timeout {self.config.first_step_timeout_s:g})"
                )
            if reason is not None:
                logger.error("rank %d hung: %s; killing it", worker.spec.global_rank, reason)
                self.telemetry.hung(worker.spec.global_rank, worker.pid, reason)
                round_.killed.add(worker.pid)
                worker.signal_group(signal.SIGKILL)

    # -- in-process recovery ------------------------------------------------------------------
    def _top_up_spares(self, round_: _Round, want: int | None = None) -> None:
        round_.spares = [s for s in round_.spares if s.poll() is None]
        while len(round_.spares) < (self.config.spares if want is None else want):
            round_.spare_index += 1
            spec = spare_spec(self.config, self.setup, round_.state.round, round_.spare_index)
            round_.spares.append(procs.spawn(spec))
        round_.respawn_at = None

    def _recover_in_process(self, round_: _Round) -> bool:
        """Replace failed workers with hot spares and move everyone to a new generation.

        Returns False when that is impossible (no ready spare, a worker not on the resilrun API,
        or the job moved on otherwise); the caller then restarts the job the torchrun way.
        """
        started = time.monotonic()
        failed = [w for w in round_.workers if w.poll() not in (None, 0)]
        if not failed or not self.control.uses_api([w.pid for w in round_.workers]):
            return False
        newest = self.control.newest_step([w.pid for w in round_.workers])
        newest = -1 if newest is None else newest
        ranks = frozenset(w.spec.global_rank for w in failed)
        no_progress = round_.recovered_at_step is not None and newest <= round_.recovered_at_step
        if no_progress and ranks & round_.recovered_ranks:
            # The same rank failed again with no step committed since its last recovery: a
            # deterministic failure (a bug, bad data) would make spares fail at the same step
            # forever. The bounded restart path (--max-restarts) decides instead. (Another rank
            # failing during a recovery is an independent failure and is recovered in-process.)
            logger.warning("no progress since the last in-process recovery (step %s): not recovering again", newest)
            return False
        ready = self._ready_spares(round_, len(failed))
        if len(failed) > len(ready):
            return False
        failures = [self._describe(w, round_.node_rank) for w in failed]
        self._record_failures(round_.state.round, failures)
        cause = root_cause(failures)
        new = self.rdzv.recover(round_.state.round, failure=cause.to_dict() if cause else None)
        if new.closed or not (new.recovering and new.complete and new.round > round_.state.round):
            return False
        if new.node_rank(self.rdzv.me.node_id) != round_.node_rank:
            return False
        logger.warning(
            "rank %s failed (%s): hot spare takes over, generation %d (no restart)",
            ", ".join(str(w.spec.global_rank) for w in failed),
            cause.message.splitlines()[0] if cause and cause.message else "?",
            new.round,
        )
        round_.recovered_at_step = newest
        round_.recovered_ranks = ranks
        replacements = dict(zip([w.spec.local_rank for w in failed], ready, strict=False))
        self.telemetry.recovery_decided(new, failed, replacements, time.monotonic() - started)
        self._enter_generation(round_, new, replacements)
        logger.info("recovery decided in %.3f s", time.monotonic() - started)
        return True

    def _ready_spares(self, round_: _Round, needed: int) -> list[procs.WorkerProcess]:
        """Spares waiting for a rank; a spare still warming up is worth waiting for (bounded)."""
        deadline = time.monotonic() + _SPARE_READY_TIMEOUT_S
        while True:
            alive = [s for s in round_.spares if s.poll() is None]
            ready = [s for s in alive if s.pid in self.control.waiting_spares()]
            if len(ready) >= needed or len(alive) < needed or time.monotonic() >= deadline:
                return ready
            self.signals.raise_if_set()
            time.sleep(0.05)

    def _enter_generation(self, round_: _Round, new: RdzvState, replacements: dict[int, procs.WorkerProcess]) -> bool:
        """Move this node's workers to generation ``new.round``: survivors keep their processes,
        spares named in ``replacements`` (by local rank) take the other places."""
        store, master = self._round_master(new, round_.node_rank)
        if master is None:
            return False
        specs = worker_specs(self.config, self.setup, self.run_id, new, round_.node_rank, master)
        envs: dict[int, dict[str, str]] = {}
        workers = []
        for spec in specs:
            spare = replacements.get(spec.local_rank)
            if spare is not None:
                round_.spares.remove(spare)
                spare.spec = spec
                self.control.assign(spare.pid, spec.env)
                workers.append(spare)
            else:
                worker = round_.workers[spec.local_rank]
                worker.spec = spec
                envs[worker.pid] = spec.env
                workers.append(worker)
        round_.workers = workers
        self.control.begin_generation([w.pid for w in workers])
        self.control.publish_generation(new.round, envs)
        round_.state = new
        round_.store = store  # the previous generation's store goes; its clients have moved on
        self.last_state = new
        self.telemetry.generation_entered(new, round_.node_rank, round_.workers)
        if replacements:
            # Start replacement spares once the recovery is past its busiest seconds (2 cores here).
            round_.respawn_at = time.monotonic() + 5.0
        return True

    # -- spare nodes ----------------------------------------------------------------------------
    def _stand_by(self, state: RdzvState) -> _RoundEnd:
        """A spare node: warm workers wait to take a lost node's ranks; the job is followed meanwhile."""
        me = self.rdzv.me.node_id
        round_ = _Round(state, -1, [], self._standby, None)
        self.current = round_
        self._standby = []
        want = max(self.setup.nproc, self.config.spares)
        self._top_up_spares(round_, want)
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
                    return self._take_over(round_, current, rank)
                if rank is not None or not current.complete or not current.is_spare(me):
                    # A restart opened a new round (or this node was forgotten): join it like any
                    # node, keeping the warm workers for whatever role this node gets.
                    self._standby, round_.spares = [s for s in round_.spares if s.poll() is None], []
                    return _RoundEnd.REJOIN
                if any(s.poll() is not None for s in round_.spares):
                    self._top_up_spares(round_, want)
        finally:
            everyone = round_.workers + round_.spares
            procs.stop([w for w in everyone if w.poll() is None], signal.SIGKILL, 0.0)
            for worker in everyone:
                worker.finish_output()

    def _take_over(self, round_: _Round, new: RdzvState, node_rank: int) -> _RoundEnd:
        """This spare node was chosen for a lost node's place: its warm workers take those ranks."""
        started = time.monotonic()
        round_.node_rank = node_rank
        self.rdzv.me = replace(self.rdzv.me, preferred_rank=node_rank)
        ready = self._ready_spares(round_, self.setup.nproc)
        if len(ready) < self.setup.nproc or not self._enter_generation(round_, new, dict(enumerate(ready))):
            logger.error("this spare node could not take node rank %d: restarting the job", node_rank)
            self._open_next_round(new, [])
            return _RoundEnd.REJOIN
        logger.warning(
            "spare node takes node rank %d (ranks %d-%d) in generation %d, %.3f s after it was chosen",
            node_rank,
            round_.workers[0].spec.global_rank,
            round_.workers[-1].spec.global_rank,
            new.round,
            time.monotonic() - started,
        )
        return self._monitor(round_)

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
        # Each node watches its _WATCH_FANOUT ring successors (O(N) store reads for the job, not
        # O(N^2)); the first two node ranks also watch the spare nodes.
        participants = watched_nodes(ring, me, _WATCH_FANOUT)
        watches_spares = ring.index(me) < 2 if me in ring else False
        spares = [n.node_id for n in current.spares] if current.round == state.round and watches_spares else []
        watched = participants + spares
        judge.forget_all_but(watched)
        if not watched:
            return ()
        for node, counter in heartbeat_reader(self.rdzv.backend, self.run_id, watched)().items():
            judge.observe(node, counter)
        stale = set(judge.stale())
        dead_spares = tuple(n for n in spares if n in stale)
        if dead_spares:
            logger.warning("spare node(s) %s stopped heartbeating: no longer counted as spares", ", ".join(dead_spares))
            self.rdzv.drop_spares(dead_spares)
        return tuple(n for n in participants if n in stale)

    def _replace_lost_nodes(self, round_: _Round, lost: tuple[str, ...], judge: StalenessJudge) -> bool:
        """Give a lost node's place to a spare node; survivors move to the new generation in place.

        Returns False when no spare node can take it (the caller restarts the job instead).
        """
        state = round_.state
        if len(state.spares) < len(lost) and len(self.rdzv.state().spares) < len(lost):
            return False
        failures = self._lost_failures(state, lost, judge)
        self._record_failures(state.round, failures)
        cause = root_cause(failures)
        new = self.rdzv.replace_nodes(state.round, lost, failure=cause.to_dict() if cause else None)
        if new.closed or not (new.recovering and new.complete and new.round > state.round):
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
    ) -> _RoundEnd:
        """Another node stopped heartbeating and no spare node can take its place: the job restarts."""
        failures = self._lost_failures(state, lost, judge)
        logger.error("%s", "; ".join(f"node {f.node_rank} ({f.host}) {f.message}" for f in failures))
        procs.stop(workers, signal.SIGTERM, self.config.shutdown_timeout_s)
        return self._open_next_round(state, failures)

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

    def _restart_job(
        self,
        state: RdzvState,
        node_rank: int,
        workers: list[procs.WorkerProcess],
        spares: list[procs.WorkerProcess] = (),  # type: ignore[assignment]  # read-only default
    ) -> _RoundEnd:
        failed = [w for w in workers if w.poll() not in (None, 0)]
        procs.stop([*workers, *spares], signal.SIGTERM, self.config.shutdown_timeout_s)
        return self._open_next_round(state, [self._describe(w, node_rank) for w in failed])

    def _stop_state_lost(self, round_: _Round) -> _RoundEnd:
        """Workers found their state in no tier: a restart would find the same, so the job stops now."""
        failed = [w for w in round_.workers if w.poll() not in (None, 0)]
        procs.stop(round_.workers + round_.spares, signal.SIGTERM, self.config.shutdown_timeout_s)
        failures = [self._describe(w, round_.node_rank) for w in failed]
        self._record_failures(round_.state.round, failures)
        cause = root_cause(failures)
        new = self.rdzv.next_round(round_.state.round, failure=cause.to_dict() if cause else None, max_restarts=0)
        return self._follow_close(new) if new.closed else _RoundEnd.REJOIN

    def _open_next_round(self, state: RdzvState, failures: list[ProcessFailure]) -> _RoundEnd:
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
        return _RoundEnd.REJOIN

    def _follow_close(self, state: RdzvState) -> _RoundEnd:
        self.rdzv.ack_closed()
        if state.outcome == "succeeded":
            return _RoundEnd.DONE
        if state.outcome == "failed":
            failures = self._read_failures(state.round)
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

    def _exit_barrier(self, state: RdzvState) -> _RoundEnd:
        """Wait until every node's workers finished; nodes finishing early keep the store alive."""
        done = self.rdzv.backend.add(keys.round_done(self.run_id, state.round), 1)
        logger.info("workers finished; waiting for the other nodes (%d/%d done)", done, len(state.participants))
        while True:
            self.signals.raise_if_set()
            current = self.rdzv.state()
            if current.closed:
                return self._follow_close(current)
            if current.round != state.round:
                return _RoundEnd.REJOIN
            if self.rdzv.backend.add(keys.round_done(self.run_id, state.round), 0) >= len(state.participants):
                closed = self.rdzv.close("succeeded")
                return self._follow_close(closed)
            time.sleep(self.config.monitor_interval_s)

    # -- helpers --------------------------------------------------------------------------------
    def _round_master(self, state: RdzvState, node_rank: int) -> tuple[Any, str | None]:
        """The round's worker store: hosted by node rank 0's agent, fresh every round.

        A fresh store per round is what keeps a restarted worker from reading the gloo addresses
        of the previous attempt (torchrun 2.13's stale-store trap).
        """
        key = keys.round_master(self.run_id, state.round)
        if node_rank == 0:
            store = host_store("0.0.0.0", 0, timedelta(seconds=self.rdzv_read_timeout()))
            master = f"{self.setup.addr}:{store.port}"
            self.rdzv.backend.set(key, master.encode())
            return store, master
        deadline = time.monotonic() + self.rdzv.join_timeout.total_seconds()
        while time.monotonic() < deadline:
            self.signals.raise_if_set()
            raw = self.rdzv.backend.get(key)
            if raw is not None:
                return None, raw.decode()
            current = self.rdzv.state()
            if current.closed or current.round != state.round:
                return None, None
            time.sleep(0.02)
        return None, None

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
        self.telemetry.failures(round, failures)
        for failure in failures:
            index = self.rdzv.backend.add(keys.round_failure_count(self.run_id, round), 1)
            self.rdzv.backend.set(keys.round_failure(self.run_id, round, index), json.dumps(failure.to_dict()).encode())

    def _read_failures(self, round: int) -> list[ProcessFailure]:
        count = self.rdzv.backend.add(keys.round_failure_count(self.run_id, round), 0)
        failures = []
        for index in range(1, count + 1):
            raw = self.rdzv.backend.get(keys.round_failure(self.run_id, round, index))
            if raw is not None:
                failures.append(ProcessFailure.from_dict(json.loads(raw)))
        return failures
