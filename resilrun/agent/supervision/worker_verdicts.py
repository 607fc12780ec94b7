"""What an agent concludes about its own workers from what they tell it: hung, or raised.

Two composed parts of the supervisor, each given its collaborators (and a clock) in its
constructor and called once per monitor tick:

- ``HungWorkers``: a worker frozen (no heartbeat), stuck (no committed step) or never reaching its
  first step is killed, so the ordinary failure path (a spare, or a restart) takes over.
- ``RaisedVerdict``: a worker whose script raised waits in its bootstrap; it is either a survivor
  (a peer failed first and broke its collective: it joins the next generation) or the failure
  itself (its own error: it is told to exit and is replaced). Decided from what the agents know,
  never from the error's text.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from resilrun.agent.liveness.heartbeat import read_heartbeats
from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.supervision.rounds import Round
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.failures import FailureLedger
from resilrun.config import Config
from resilrun.rendezvous.api import RendezvousBackend
from resilrun.rendezvous.protocol import RdzvState

logger = logging.getLogger(__name__)

# Workers killed as hung in one tick are waited for this long, so that they are recovered together.
_HUNG_REAP_S = 2.0
# A worker that raised waits at least this long for evidence that a peer failed before it (a failure
# record, which a peer's agent writes within milliseconds of seeing the exit), plus 1.5 heartbeat
# intervals on a multi-node job (a node whose counter did not move in that time may be lost: then the
# worker keeps waiting for the watchers' verdict, which takes --heartbeat-timeout).
RAISED_GRACE_S = 0.3


class HungWorkers:
    """Kills this node's workers that stopped making progress (see the module docstring)."""

    def __init__(self, config: Config, control: WorkerControl, telemetry: Telemetry) -> None:
        self.config = config
        self.control = control
        self.telemetry = telemetry

    def reason(self, pid: int) -> str | None:
        """Why the worker ``pid`` counts as hung now; None while it does not."""
        silent = self.control.silent_for(pid)
        stalled = self.control.stalled_for(pid)
        pending = self.control.first_step_pending_for(pid)
        if silent is not None and silent > self.config.heartbeat_timeout_s:
            return f"no heartbeat for {silent:.1f} s (frozen?)"
        if stalled is not None and stalled > self.config.hang_timeout_s:
            return f"no step committed for {stalled:.0f} s (--hang-timeout {self.config.hang_timeout_s:g})"
        if pending is not None and pending > self.config.first_step_timeout_s:
            return f"no first step after {pending:.0f} s (--first-step-timeout {self.config.first_step_timeout_s:g})"
        return None

    def kill(self, round_: Round) -> None:
        """SIGKILL every hung worker of the round, and wait for them to be gone: workers killed
        together are recovered together (one generation) rather than one by one as each exit is seen."""
        killed = []
        for worker in round_.workers:
            if worker.poll() is not None or worker.pid in round_.killed:
                continue
            reason = self.reason(worker.pid)
            if reason is not None:
                logger.error("rank %d hung: %s; killing it", worker.spec.global_rank, reason)
                self.telemetry.hung(worker.spec.global_rank, worker.pid, reason)
                round_.killed.add(worker.pid)
                worker.signal_group(signal.SIGKILL)
                killed.append(worker)
        deadline = time.monotonic() + _HUNG_REAP_S
        for worker in killed:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.popen.wait(max(0.0, deadline - time.monotonic()))


@dataclass
class _Probe:
    """Since when workers of this node wait after raising, and the other nodes' heartbeats then."""

    started: float
    counters: dict[str, int]


class RaisedVerdict:
    """Survivor or failure, for each worker whose script raised (see the module docstring)."""

    def __init__(
        self,
        control: WorkerControl,
        failures: FailureLedger,
        backend: RendezvousBackend,
        node_id: str,
        heartbeat_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``backend``: where the other nodes' heartbeat counters are read."""
        self.control = control
        self.failures = failures
        self.backend = backend
        self.node_id = node_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self._clock = clock
        self._probe: _Probe | None = None

    def judge(self, round_: Round, codes: tuple[int | None, ...], current: RdzvState) -> None:
        """One tick: a local worker that exited, a failure recorded by any agent in this round, or a
        round that moved on mean a peer failed (survivors: nothing to do, the recovery takes them);
        a node whose heartbeat stopped may be lost (wait for the verdict). None of these within the
        grace: nothing failed before it, so its own error is the failure and it is dismissed."""
        pending = [pid for pid, (round, _) in self.control.raised_workers().items() if round == round_.state.round]
        if not pending:
            self._probe = None
            return
        state = round_.state
        if any(code not in (None, 0) for code in codes) or current.closed or current.round != state.round:
            return
        if self.failures.count(state.round) > 0:
            return
        others = [p.node_id for p in state.participants if p.node_id != self.node_id]
        readings = read_heartbeats(self.backend, self.failures.run_id, others, watch=False)
        counters = {node: reading.counter for node, reading in readings.items()}
        now = self._clock()
        if self._probe is None:
            self._probe = _Probe(now, counters)
            return
        grace = RAISED_GRACE_S + (1.5 * self.heartbeat_interval_s if others else 0.0)
        if now - self._probe.started < grace:
            return
        if any(counters.get(node) == self._probe.counters.get(node) for node in others):
            return  # a node may be lost: its watchers decide within --heartbeat-timeout
        ranks = {w.pid: w.spec.global_rank for w in round_.workers}
        for pid in pending:
            if pid in ranks:
                logger.warning(
                    "rank %d raised with no failure before it anywhere in the job: its own error is the failure",
                    ranks[pid],
                )
                self.control.dismiss(pid)
        self._probe = None
