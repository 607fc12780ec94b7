"""In-process recovery on one node: hung workers killed, failed ranks given hot spares.

A mixin of :class:`resilrun.agent.supervisor.Supervisor` (split out to keep modules small): the
survivors keep their processes and move to the next generation; only the failed ranks change process.
The spares themselves come from the composed ``SparePool`` (spare_pool.py).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from resilrun import keys
from resilrun.agent import procs
from resilrun.agent.control import WorkerControl
from resilrun.agent.failures import ProcessFailure, root_cause
from resilrun.agent.heartbeat import read_counters
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


# A worker that raised waits at least this long for evidence that a peer failed before it (a failure
# record, which a peer's agent writes within milliseconds of seeing the exit), plus 1.5 heartbeat
# intervals on a multi-node job (a node whose counter did not move in that time may be lost: then the
# worker keeps waiting for the watchers' verdict, which takes --heartbeat-timeout).
RAISED_GRACE_S = 0.3


@dataclass
class _RaisedProbe:
    """Since when workers of this node wait after raising, and the other nodes' heartbeats then."""

    started: float
    counters: dict[str, int]


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
    raised_probe: _RaisedProbe | None

    if TYPE_CHECKING:

        def _round_master(self, state: RdzvState, node_rank: int) -> tuple[Any, str | None]: ...
        def _record_failures(self, round: int, failures: list[ProcessFailure]) -> None: ...
        def _describe(self, worker: procs.WorkerProcess, node_rank: int) -> ProcessFailure: ...

    def _kill_hung_workers(self, round_: Round) -> None:
        """A worker frozen (no heartbeat) or stuck (no committed step) for too long is killed, so the
        ordinary failure path (a spare, or a restart) takes over."""
        killed = []
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
                killed.append(worker)
        # Wait for them to be gone, so that workers killed together are recovered together (one
        # generation) rather than one by one as each exit is seen.
        deadline = time.monotonic() + 2.0
        for worker in killed:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.popen.wait(max(0.0, deadline - time.monotonic()))

    def _judge_raised(self, round_: Round, codes: tuple[int | None, ...], current: RdzvState) -> None:
        """Decide for the workers whose script raised whether they are survivors or the failure.

        Survivors (a peer failed first and broke their collective) wait for the next generation; the
        failure itself (its own error: a bug, an NCCL or CUDA error of its own) is told to exit, so the
        ordinary path replaces it. Decided from what the agents know, never from the error's text: a
        local worker that exited, a failure recorded by any agent in this round, or a round that moved
        on mean a peer failed; a node whose heartbeat stopped may be lost (wait for the verdict). None
        of these within the grace: nothing failed before it.
        """
        pending = [pid for pid, (round, _) in self.control.raised_workers().items() if round == round_.state.round]
        if not pending:
            self.raised_probe = None
            return
        state = round_.state
        if any(code not in (None, 0) for code in codes) or current.closed or current.round != state.round:
            return
        if self.rdzv.backend.add(keys.round_failure_count(self.run_id, state.round), 0) > 0:
            return
        me = self.rdzv.me.node_id
        others = [p.node_id for p in state.participants if p.node_id != me]
        counters = read_counters(self.rdzv.backend, self.run_id, others)() if others else {}
        now = time.monotonic()
        if self.raised_probe is None:
            self.raised_probe = _RaisedProbe(now, counters)
            return
        grace = RAISED_GRACE_S + (1.5 * self.config.heartbeat_interval_s if others else 0.0)
        if now - self.raised_probe.started < grace:
            return
        if any(counters.get(node) == self.raised_probe.counters.get(node) for node in others):
            return  # a node may be lost: its watchers decide within --heartbeat-timeout
        ranks = {w.pid: w.spec.global_rank for w in round_.workers}
        for pid in pending:
            if pid in ranks:
                logger.warning(
                    "rank %d raised with no failure before it anywhere in the job: its own error is the failure",
                    ranks[pid],
                )
                self.control.dismiss(pid)
        self.raised_probe = None

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
