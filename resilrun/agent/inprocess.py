"""In-process recovery on one node: failed ranks given hot spares, survivors moved to a new generation.

A mixin of :class:`resilrun.agent.supervisor.Supervisor` (split out to keep modules small): the
survivors keep their processes and move to the next generation; only the failed ranks change process.
The spares themselves come from the composed ``SparePool`` (spare_pool.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from resilrun.agent import procs
from resilrun.agent.control import WorkerControl
from resilrun.agent.failures import ProcessFailure, root_cause
from resilrun.agent.rounds import Round, SignalFlag
from resilrun.agent.spare_pool import SparePool
from resilrun.agent.specs import NodeSetup, worker_specs
from resilrun.agent.telemetry import Telemetry
from resilrun.config import Config
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import MAX_RECOVERIES_WITHOUT_PROGRESS, RdzvState, recovery_budget_spent

logger = logging.getLogger("resilrun.agent.supervisor")

def _log_budget_spent(state: RdzvState, newest: int) -> None:
    if not state.closed and recovery_budget_spent(state, newest):
        logger.warning(
            "in-process recovery budget spent: %d recoveries in a row without a newer step than %d "
            "(at most %d): restarting instead (bounded by --max-restarts)",
            state.stalled_recoveries,
            state.progress_step,
            MAX_RECOVERIES_WITHOUT_PROGRESS,
        )


class InProcessRecovery:
    """Hot spares and generations of this node's workers (see the module docstring)."""

    config: Config
    setup: NodeSetup
    rdzv: RendezvousClient
    control: WorkerControl
    signals: SignalFlag
    telemetry: Telemetry
    run_id: str
    last_state: RdzvState | None
    spare_pool: SparePool

    if TYPE_CHECKING:

        def _round_master(self, state: RdzvState, node_rank: int) -> tuple[Any, str | None]: ...
        def _record_failures(self, round: int, failures: list[ProcessFailure]) -> None: ...
        def _describe(self, worker: procs.WorkerProcess, node_rank: int) -> ProcessFailure: ...

    def _recover_in_process(self, round_: Round) -> bool:
        """Replace failed workers with hot spares and move everyone to a new generation.

        Returns False when that is impossible (no ready spare, a worker not on the resilrun API,
        or the job moved on otherwise); the caller then restarts the job the torchrun way.
        """
        started = time.monotonic()
        failed = [w for w in round_.workers if w.poll() not in (None, 0)]
        if not failed:
            return False
        # Recorded at once, before anything waits (a spare still warming): other nodes' workers whose
        # collectives broke learn from this record that a peer failed first (``_judge_raised``).
        failures = [self._describe(w, round_.node_rank) for w in failed]
        self._record_failures(round_.state.round, failures)
        if not self.control.uses_api([w.pid for w in round_.workers]):
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
        ready = self.spare_pool.ready(round_, len(failed))
        if len(failed) > len(ready):
            return False
        cause = root_cause(failures)
        new = self.rdzv.recover(round_.state.round, failure=cause.to_dict() if cause else None, newest_step=newest)
        if new.closed or not (new.recovering and new.complete and new.round > round_.state.round):
            _log_budget_spent(new, newest)
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

    def _enter_generation(self, round_: Round, new: RdzvState, replacements: dict[int, procs.WorkerProcess]) -> bool:
        """Move this node's workers to generation ``new.round``: survivors keep their processes,
        spares named in ``replacements`` (by local rank) take the other places."""
        store, master = self._round_master(new, round_.node_rank)
        if master is None:
            return False
        specs = worker_specs(self.config, self.setup, self.run_id, new, round_.node_rank, master)
        envs: dict[int, dict[str, str]] = {}
        workers = []
        with round_.updating():  # a status read sees the promoted spare in one list, never in none
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
            # Start replacement spares once the recovery is past its busiest seconds (they compete
            # with it for the cores).
            round_.respawn_at = time.monotonic() + 5.0
        return True
