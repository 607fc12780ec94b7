"""A node's hot spares: started ahead of failures, watched while they wait, handed out when needed.

A composed part of the supervisor: it owns the decisions about spare processes (how many to start,
what to do when one dies while waiting, how long a recovery waits for one that is still warming up)
and is given everything it needs in its constructor, so each decision is unit-tested with fake
processes and no sleeps (tests/unit/test_spare_pool.py). The spares themselves live in the round
(``Round.spares``): a generation change moves a spare from there into the workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.supervision.rounds import Round, SignalFlag
from resilrun.agent.workers import procs
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.failures import collect_failure
from resilrun.agent.workers.procs import WorkerSpec
from resilrun.agent.workers.specs import NodeSetup, spare_spec
from resilrun.config import Config

logger = logging.getLogger(__name__)

# A failure in the first seconds finds the spare still importing torch: waiting for it (still far
# quicker than a restart) beats giving up on in-process recovery. Survivors wait longer than this.
SPARE_READY_TIMEOUT_S = 30.0
# While waiting for spares to become ready, how often to look for one that died meanwhile.
SPARE_EXIT_RECHECK_S = 0.25
# A spare that dies while waiting is started again after this, doubling while spares keep dying
# before they are ready: a one-off (the OOM killer) costs a second, a crash loop does not eat a core.
SPARE_BACKOFF_FIRST_S = 1.0
SPARE_BACKOFF_MAX_S = 60.0


class SpareBackoff:
    """How long to wait before starting a spare in place of one that died while waiting."""

    def __init__(self) -> None:
        self.exits_in_a_row = 0

    def next_delay(self) -> float:
        delay = min(SPARE_BACKOFF_MAX_S, SPARE_BACKOFF_FIRST_S * 2**self.exits_in_a_row)
        self.exits_in_a_row += 1
        return delay

    def spare_ready(self) -> None:
        self.exits_in_a_row = 0


class SparePool:
    """Starts, watches and hands out one node's hot spares (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        setup: NodeSetup,
        control: WorkerControl,
        telemetry: Telemetry,
        signals: SignalFlag,
        spawn: Callable[[WorkerSpec], procs.WorkerProcess] = procs.spawn,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``spawn`` and ``clock``: real processes and time unless a test gives fakes."""
        self.config = config
        self.setup = setup
        self.control = control
        self.telemetry = telemetry
        self.signals = signals
        self.backoff = SpareBackoff()
        self._spawn = spawn
        self._clock = clock

    def top_up(self, round_: Round, want: int | None = None) -> None:
        """Start spares until ``want`` (default ``--spares``) are alive."""
        round_.spares = [s for s in round_.spares if s.poll() is None]
        while len(round_.spares) < (self.config.spares if want is None else want):
            round_.spare_index += 1
            spec = spare_spec(self.config, self.setup, round_.state.round, round_.spare_index)
            round_.spares.append(self._spawn(spec))
        round_.respawn_at = None

    def check(self, round_: Round) -> None:
        """Notice spares that died while waiting for a rank: say why, and start others after a backoff.

        Why it matters: a node whose spares are gone still trains, but its next failure costs a new
        process (seconds) or a restart; the user should learn that from the log before it happens.
        """
        waiting = set(self.control.waiting_spares())
        if any(s.pid in waiting for s in round_.spares):
            self.backoff.spare_ready()
        exited = [s for s in round_.spares if s.poll() is not None]
        if not exited:
            return
        round_.spares = [s for s in round_.spares if s not in exited]
        delay = 0.0
        for spare in exited:
            spare.finish_output()
            failure = collect_failure(
                global_rank=-1,
                local_rank=-1,
                node_rank=round_.node_rank,
                pid=spare.pid,
                exit_code=spare.popen.returncode,
                observed_at=spare.exit_observed_at or time.time(),
                error_file=spare.spec.error_file,
            )
            delay = self.backoff.next_delay()
            summary = failure.message.splitlines()[0] if failure.message else f"exit code {failure.exit_code}"
            logger.error(
                "hot spare (pid %d) exited while waiting for a rank: %s; starting another in %.0f s (logs: %s)",
                spare.pid,
                summary,
                delay,
                spare.spec.log_dir,
            )
            if failure.traceback:
                logger.error("the spare's traceback:\n%s", failure.traceback.rstrip())
            self.telemetry.spare_exited(spare.pid, spare.popen.returncode, summary, len(round_.spares), delay)
        start_at = self._clock() + delay
        round_.respawn_at = start_at if round_.respawn_at is None else max(round_.respawn_at, start_at)
        if not round_.spares:
            logger.warning(
                "no hot spare left on this node (%d configured): until one is back, a failed rank waits for a "
                "new worker process to start",
                max(self.config.spares, len(exited)),
            )

    def due(self, round_: Round) -> bool:
        """Whether spares that died (or were used) are due to be started again now."""
        return round_.respawn_at is not None and self._clock() >= round_.respawn_at

    def ready(self, round_: Round, needed: int) -> list[procs.WorkerProcess]:
        """Spares waiting for a rank; a spare still warming up is worth waiting for (bounded).

        With fewer spares alive than failed ranks (``--spares 0``, or all used up), new processes
        are started for the missing places and waited for the same way: the survivors keep their
        processes and memory through the few seconds a new process needs to import, which beats
        restarting every worker (the fallback when even that does not come up in time).
        """
        alive = [s for s in round_.spares if s.poll() is None]
        if len(alive) < needed:
            missing = needed - len(alive)
            logger.warning(
                "no warm spare for %d failed rank(s): starting %s; the survivors wait for it (at most %.0f s)",
                missing,
                "a new worker process" if missing == 1 else f"{missing} new worker processes",
                SPARE_READY_TIMEOUT_S,
            )
            self.top_up(round_, want=needed)
        deadline = self._clock() + SPARE_READY_TIMEOUT_S
        while True:
            alive = [s for s in round_.spares if s.poll() is None]
            ready = [s for s in alive if s.pid in self.control.waiting_spares()]
            if len(ready) >= needed or len(alive) < needed or self._clock() >= deadline:
                return ready
            self.signals.raise_if_set()
            # Woken the moment a spare starts waiting; the timeout re-checks spares that died meanwhile.
            self.control.wait_for_waiting_spares(
                [s.pid for s in alive], needed, min(SPARE_EXIT_RECHECK_S, max(0.0, deadline - self._clock()))
            )
