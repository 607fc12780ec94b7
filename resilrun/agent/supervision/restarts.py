"""The torchrun path and the job's end: failures recorded, a job-wide restart, following a close.

Every way out of a round that is not an in-process move goes through :class:`Restarts`: a worker
failure no spare can take (restart), a lost node with no spare node (restart), a state nobody holds
(stop), and the job's close by any node (succeeded, failed, stopped), which it turns into this
node's return value or error. Job-wide decisions are compare-and-set writes to the rendezvous
state, so exactly one node's decision wins and every node follows it.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence

from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.supervision.rounds import Round, RoundEnd
from resilrun.agent.workers.failures import (
    FailureLedger,
    ProcessFailure,
    collect_failure,
    ending_cause,
    format_report,
    root_cause,
)
from resilrun.agent.workers.procs import Processes, WorkerProcess, WorkerState
from resilrun.agent.workers.specs import NodeSetup
from resilrun.config import Config
from resilrun.errors import RendezvousClosedError, StateLostError, StateRefusedError, WorkerGroupFailed
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import RdzvState

logger = logging.getLogger(__name__)


class Restarts:
    """Failure records and the job-wide decisions that end a round (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        setup: NodeSetup,
        rdzv: RendezvousClient,
        ledger: FailureLedger,
        telemetry: Telemetry,
        processes: Processes,
    ) -> None:
        self._config = config
        self._setup = setup
        self._rdzv = rdzv
        self._ledger = ledger
        self._telemetry = telemetry
        self._processes = processes

    # -- failures -------------------------------------------------------------------------------
    def record(self, round: int, failures: list[ProcessFailure]) -> None:
        """Each failure once, in the store and the telemetry (the restart path describes again what
        an in-process attempt recorded)."""
        self._telemetry.failures(round, self._ledger.record(round, failures))

    @staticmethod
    def describe(worker: WorkerProcess, node_rank: int) -> ProcessFailure:
        return collect_failure(
            global_rank=worker.spec.global_rank,
            local_rank=worker.spec.local_rank,
            node_rank=node_rank,
            pid=worker.pid,
            exit_code=worker.popen.returncode,
            observed_at=worker.exit_observed_at or time.time(),
            error_file=worker.spec.error_file,
        )

    def stop_and_describe(
        self, workers: Sequence[WorkerProcess], spares: Sequence[WorkerProcess], node_rank: int
    ) -> list[ProcessFailure]:
        """Stop every process and describe the failed workers, counting those caught mid-exit.

        A worker that raised wrote its error file before its interpreter's teardown, which can
        outlast the peer its failure broke: the agent then sees the peer die first. Such a worker is
        a failure (the root cause, by its error file's time) even though the stop ended it.
        """
        failed = {w.pid for w in workers if w.poll() not in (None, 0)}
        stopping_at = time.time()
        self._processes.stop([*workers, *spares], signal.SIGTERM, self._config.shutdown_timeout_s)
        # An error file written after the stop began is the stop's doing (a script that exits
        # non-zero on SIGTERM), not a failure.
        described = [self.describe(w, node_rank) for w in workers if w.pid in failed or w.spec.error_file.exists()]
        return [f for f in described if f.pid in failed or f.timestamp < stopping_at]

    # -- decisions ------------------------------------------------------------------------------
    def restart_job(self, round_: Round) -> RoundEnd:
        """A local worker failed and no in-process recovery took it: every node restarts its workers."""
        failures = self.stop_and_describe(round_.workers, round_.spares, round_.node_rank)
        return self.open_next_round(round_.state, failures)

    def after_node_loss(
        self, state: RdzvState, failures: list[ProcessFailure], workers: Sequence[WorkerProcess]
    ) -> RoundEnd:
        """Another node stopped heartbeating and no spare node can take its place: the job restarts."""
        logger.error("%s", "; ".join(f"node {f.node_rank} ({f.host}) {f.message}" for f in failures))
        self._processes.stop(workers, signal.SIGTERM, self._config.shutdown_timeout_s)
        return self.open_next_round(state, failures)

    def stop_state_lost(self, round_: Round) -> RoundEnd:
        """Workers found their state in no tier: a restart would find the same, so the job stops now."""
        failures = self.stop_and_describe(round_.workers, round_.spares, round_.node_rank)
        self.record(round_.state.round, failures)
        cause = root_cause(failures)
        new = self._rdzv.next_round(round_.state.round, failure=cause.to_dict() if cause else None, max_restarts=0)
        return self.follow_close(new) if new.closed else RoundEnd.REJOIN

    def open_next_round(self, state: RdzvState, failures: list[ProcessFailure]) -> RoundEnd:
        """Record the failures and open the next round (or close the job once --max-restarts is spent)."""
        self.record(state.round, failures)
        cause = root_cause(failures)
        if cause is not None and cause.local_rank >= 0:
            logger.error(
                "rank %d failed (%s): stopping the job's workers",
                cause.global_rank,
                cause.message.splitlines()[0] if cause.message else "?",
            )
        new = self._rdzv.next_round(
            state.round, failure=cause.to_dict() if cause else None, max_restarts=self._config.max_restarts
        )
        self._telemetry.restart(state, new, cause)
        if new.closed:
            return self.follow_close(new)
        if new.round != state.round:
            logger.warning("restarting the job: restart %d of %d", new.restarts, self._config.max_restarts)
        return RoundEnd.REJOIN

    def follow_close(self, state: RdzvState) -> RoundEnd:
        """The job is closed: DONE when it succeeded; otherwise the error that says how it ended."""
        self._rdzv.ack_closed()
        if state.outcome == "succeeded":
            return RoundEnd.DONE
        if state.outcome == "failed":
            raise self._failed(state)
        detail = (state.failure or {}).get("message", "")
        raise RendezvousClosedError(
            f"the job was stopped by another node{': ' + detail if detail else ''}", outcome=state.outcome or "stopped"
        )

    def _failed(self, state: RdzvState) -> WorkerGroupFailed | StateLostError:  # (StateRefusedError is one)
        failures = self._ledger.read(state.round)
        if not failures and state.failure:
            failures = [ProcessFailure.from_dict(state.failure)]
        cause = ending_cause(failures)
        if cause is not None and cause.state is WorkerState.STATE_REFUSED:
            return StateRefusedError(
                f"the job's state was refused: {cause.message.splitlines()[0] if cause.message else '?'}",
                hint="check the step with resilrun inspect-checkpoint --verify (and the job's --job-secret-file); "
                "to resume from the step before, move the refused step's folder away",
            )
        if cause is not None and cause.state is WorkerState.STATE_LOST:
            return StateLostError(
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
        return WorkerGroupFailed(
            f"{summary}; no restart left (--max-restarts {self._config.max_restarts})",
            report=format_report("resilrun: the job failed", failures),
            hint="see the root-cause report above and the per-rank logs under "
            f"{self._setup.log_root}; raise --max-restarts to retry more",
        )
