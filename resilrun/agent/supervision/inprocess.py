"""In-process recovery on one node: failed ranks given hot spares, survivors moved to a new generation.

The survivors keep their processes (and their memory) and move to the next generation; only the
failed ranks change process, taking a hot spare from the ``SparePool``. A plain torchrun script's
survivors (never on the API) re-run the script from its first line in their processes, when the
job opted in (``--rerun-in-process``) and each registered as able to (``WorkerControl.reruns``).
The decision refuses when a spare is missing, a worker is neither on the resilrun API nor
re-runnable, the same rank failed again without progress, or the job-wide recovery budget is spent
(``protocol.recovery_budget_spent``): the caller then restarts the job the torchrun way (bounded by
``--max-restarts``). A plain script reports no steps, so for it the same rank failing twice in a
row, or a fourth recovery in a row, restarts.
"""

from __future__ import annotations

import logging

from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.state.captured import CAPTURED_RESTORE_S, CapturedFolder
from resilrun.agent.supervision.restarts import Restarts
from resilrun.agent.supervision.round_master import RoundMaster
from resilrun.agent.supervision.rounds import Membership, Round
from resilrun.agent.supervision.spare_pool import SparePool
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.failures import root_cause
from resilrun.agent.workers.procs import WorkerProcess, prepare_log_dir
from resilrun.agent.workers.specs import NodeSetup, worker_specs
from resilrun.clock import Clock
from resilrun.config import Config
from resilrun.env import EXPECTED_GFLOPS_ENV, UNHEALTHY_EXIT_CODE
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import MAX_RECOVERIES_WITHOUT_PROGRESS, RdzvState, recovery_budget_spent

logger = logging.getLogger(__name__)

# Replacement spares start this long after a recovery, past its busiest seconds (they compete with
# it for the cores).
RESPAWN_DELAY_S = 5.0


class InProcessRecovery:
    """Decides an in-process recovery and moves this node's workers between generations."""

    def __init__(
        self,
        config: Config,
        setup: NodeSetup,
        rdzv: RendezvousClient,
        control: WorkerControl,
        telemetry: Telemetry,
        spare_pool: SparePool,
        round_master: RoundMaster,
        restarts: Restarts,
        membership: Membership,
        clock: Clock,
        *,
        captured: CapturedFolder | None = None,
    ) -> None:
        """``captured``: the script's own checkpoint folder (``--capture-dir``), put back before
        survivors re-run a plain script (``--rerun-in-process``): a save the failure tore must be
        replaced before they load it."""
        self._config = config
        self._captured = captured
        self._setup = setup
        self._rdzv = rdzv
        self._control = control
        self._telemetry = telemetry
        self._spare_pool = spare_pool
        self._round_master = round_master
        self._restarts = restarts
        self._membership = membership
        self._clock = clock

    def recover(self, round_: Round) -> bool:
        """Replace failed workers with hot spares and move everyone to a new generation.

        Returns False when that is impossible (see the module docstring) or the job moved on
        otherwise; the caller then restarts the job.
        """
        started = self._clock.monotonic()
        failed = [w for w in round_.workers if w.poll() not in (None, 0)]
        if not failed:
            return False
        # Recorded at once, before anything waits (a spare still warming): other nodes' workers whose
        # collectives broke learn from this record that a peer failed first (``RaisedVerdict``).
        failures = [self._restarts.describe(w, round_.node_rank) for w in failed]
        self._restarts.record(round_.state.round, failures)
        pids = [w.pid for w in round_.workers]
        if not self._control.uses_api(pids) and not self._reruns(pids):
            return False
        newest = self._control.newest_step([w.pid for w in round_.workers])
        newest = -1 if newest is None else newest
        ranks = frozenset(w.spec.global_rank for w in failed)
        no_progress = round_.recovered_at_step is not None and newest <= round_.recovered_at_step
        # A process whose device failed its check never ran the rank: the process is at fault, not
        # the rank, so the next spare may take it at once.
        unhealthy = all(w.poll() == UNHEALTHY_EXIT_CODE for w in failed)
        if no_progress and ranks & round_.recovered_ranks and not unhealthy:
            # The same rank failed again with no step committed since its last recovery: a
            # deterministic failure (a bug, bad data) would make spares fail at the same step
            # forever. The bounded restart path (--max-restarts) decides instead. (Another rank
            # failing during a recovery is an independent failure and is recovered in-process.)
            logger.warning("no progress since the last in-process recovery (step %s): not recovering again", newest)
            return False
        ready = self._spare_pool.ready(round_, len(failed))
        if len(failed) > len(ready):
            return False
        cause = root_cause(failures)
        new = self._rdzv.recover(round_.state.round, failure=cause.to_dict() if cause else None, newest_step=newest)
        if new.closed or not (new.recovering and new.complete and new.round > round_.state.round):
            if not new.closed and recovery_budget_spent(new, newest):
                logger.warning(
                    "in-process recovery budget spent: %d recoveries in a row without a newer step than %d "
                    "(at most %d): restarting instead (bounded by --max-restarts)",
                    new.stalled_recoveries,
                    new.progress_step,
                    MAX_RECOVERIES_WITHOUT_PROGRESS,
                )
            return False
        if new.node_rank(self._rdzv.me.node_id) != round_.node_rank:
            return False
        logger.warning(
            "rank %s failed (%s): hot spare takes over, generation %d (no restart)%s",
            ", ".join(str(w.spec.global_rank) for w in failed),
            cause.message.splitlines()[0] if cause and cause.message else "?",
            new.round,
            "; the survivors re-run the script in their processes" if self._reruns(pids) else "",
        )
        round_.recovered_at_step = newest
        round_.recovered_ranks = ranks
        replacements = dict(zip([w.spec.local_rank for w in failed], ready, strict=False))
        decided_s = self._clock.monotonic() - started
        self._telemetry.recovery_decided(new, failed, replacements, decided_s, rerun=self._reruns(pids))
        self.enter_generation(round_, new, replacements)
        logger.info("recovery decided in %.3f s", self._clock.monotonic() - started)
        return True

    def swap(self, round_: Round, worker: WorkerProcess, step: int) -> bool:
        """Give a live worker's rank to a hot spare: the failure path without a failure.

        ``worker`` was stopped right after committing ``step`` (a straggler fenced at a step
        boundary: agent/workers/step_fence.py), so the spare restores that step and nothing is
        redone. Only a spare that already waits for a rank is taken: a swap is never urgent enough
        to wait for one warming up. Returns False when the job cannot open the generation (it moved
        on, or closed); the caller then lets the worker go on.
        """
        started = self._clock.monotonic()
        waiting = set(self._control.waiting_spares())
        ready = [s for s in round_.spares if s.poll() is None and s.pid in waiting][:1]
        if not ready:
            return False
        new = self._rdzv.recover(round_.state.round, failure=None, newest_step=step)
        if new.closed or not (new.recovering and new.complete and new.round > round_.state.round):
            return False
        if new.node_rank(self._rdzv.me.node_id) != round_.node_rank:
            return False
        logger.warning(
            "rank %d is a straggler: hot spare %d takes it after step %d, generation %d",
            worker.spec.global_rank,
            ready[0].pid,
            step,
            new.round,
        )
        round_.recovered_at_step = step
        round_.recovered_ranks = frozenset({worker.spec.global_rank})
        replacements = {worker.spec.local_rank: ready[0]}
        decided_s = self._clock.monotonic() - started
        self._telemetry.recovery_decided(new, [worker], replacements, decided_s, straggler=True)
        # Opened: from here the worker must go, whether or not this node enters the generation now
        # (if not, the next tick follows the newer round and sees the worker's end as a failure).
        self.enter_generation(round_, new, replacements)
        return True

    def _reruns(self, pids: list[int]) -> bool:
        """Whether these are a plain script's workers that can all re-run it in-process (opt-in)."""
        return self._config.rerun_in_process and self._control.reruns(pids)

    def enter_generation(self, round_: Round, new: RdzvState, replacements: dict[int, WorkerProcess]) -> bool:
        """Move this node's workers to generation ``new.round``: survivors keep their processes,
        spares named in ``replacements`` (by local rank) take the other places.

        Returns False when the generation ended before its worker store was found (the caller's
        next tick sees the newer round).
        """
        store, master = self._round_master.resolve(new, round_.node_rank)
        if master is None:
            return False
        specs = worker_specs(self._config, self._setup, self._rdzv.run_id, new, round_.node_rank, master)
        for spec in specs:
            prepare_log_dir(spec)
        survivors = [w.pid for w in round_.workers if w.spec.local_rank not in replacements]
        if self._captured is not None and self._reruns(survivors):
            # The survivors load the script's checkpoint as soon as the generation is published: the
            # newest complete version must be in the folder first, as before a restart.
            self._captured.restore(CAPTURED_RESTORE_S)
        envs: dict[int, dict[str, str]] = {}
        workers = []
        with round_.updating():  # a status read sees the promoted spare in one list, never in none
            for spec in specs:
                spare = replacements.get(spec.local_rank)
                if spare is not None:
                    round_.spares.remove(spare)
                    spare.spec = spec
                    env = dict(spec.env)
                    if (expected := self._control.expected_gflops()) is not None:
                        env[EXPECTED_GFLOPS_ENV] = f"{expected:.1f}"  # what its device check is held to
                    self._control.assign(spare.pid, env)
                    workers.append(spare)
                else:
                    worker = round_.workers[spec.local_rank]
                    worker.spec = spec
                    envs[worker.pid] = spec.env
                    workers.append(worker)
            round_.workers = workers
            self._control.begin_generation([w.pid for w in workers])
            self._control.publish_generation(new.round, envs)
            round_.state = new
        round_.replace_store(store, self._clock.monotonic())
        self._membership.enter(new)
        self._telemetry.generation_entered(new, round_.node_rank, round_.workers)
        round_.close_retired(self._clock.monotonic())
        if replacements:
            round_.respawn_at = self._clock.monotonic() + RESPAWN_DELAY_S
        return True
