"""The node's status document, built from the agent's live state and published to the store.

One background thread per agent rewrites one key (its own) every heartbeat interval, and at once
when an event happens (a failure, a promotion, a recovery), so ``resilrun status`` is at most one
interval stale. Cost per agent and interval: one write of about 1 KB (a few hundred bytes plus
~150 bytes per local rank), plus reading the heartbeat counters of its next ``_WATCHED`` nodes in
node-rank order: each node is watched by that many predecessors, so every node's heartbeat age is
known without any agent reading every counter for status.

Heartbeat ages are judged as the supervisor judges them (counters on the observer's monotonic clock),
never from timestamps written by another machine.

The supervisor thread owns the round and its worker processes; this thread reads their snapshots
only (``Round.snapshot()``), so it never reaps a worker or closes a descriptor the supervisor waits on.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any

from resilrun.agent.liveness.heartbeat import StalenessJudge, read_heartbeats
from resilrun.agent.observability.telemetry import AgentTelemetry
from resilrun.agent.supervision.rounds import Membership
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.procs import WorkerState
from resilrun.env import SNAPSHOT_AUTO
from resilrun.errors import ResilrunError
from resilrun.status import records as history
from resilrun.tiers.memory import NodeMemoryTier

if TYPE_CHECKING:
    from resilrun.agent.state.captured import CapturedFolder
    from resilrun.agent.workers.procs import WorkerSnapshot
    from resilrun.config import Config
    from resilrun.rendezvous.executor import RendezvousClient

logger = logging.getLogger(__name__)


class RankState(Enum):
    """A rank's state in the status document (``ranks[].state``, docs/status.md)."""

    STARTING = "starting"  # no heartbeat and no step yet (importing, restoring)
    RUNNING = "running"
    UNRESPONSIVE = "unresponsive"  # no worker heartbeat for --heartbeat-timeout: about to be killed
    FINISHED = "finished"  # exit 0
    FAILED = "failed"  # non-zero exit or a signal

    @classmethod
    def of(cls, exit_code: int | None, silent_s: float | None, timeout_s: float, stepped: bool) -> RankState:
        """From what the agent knows of the worker: its exit, its heartbeat's age, whether it stepped."""
        state = WorkerState.of(exit_code)
        if state.ended:
            return cls.FINISHED if state is WorkerState.SUCCEEDED else cls.FAILED
        if silent_s is None:
            return cls.RUNNING if stepped else cls.STARTING
        return cls.RUNNING if silent_s <= timeout_s else cls.UNRESPONSIVE


_WATCHED = 2
# Event-triggered publishes closer together than this are merged (a burst of reports in a recovery).
_MIN_GAP_S = 0.1


class StatusPublisher:
    """Builds and publishes this node's status document until closed."""

    def __init__(
        self,
        config: Config,
        rdzv: RendezvousClient,
        membership: Membership,
        control: WorkerControl,
        memory: NodeMemoryTier,
        telemetry: AgentTelemetry,
        *,
        replication: Callable[[], dict[int, dict[str, int | None]]] | None = None,
        on_published: Sequence[Callable[[dict[str, Any]], None]] = (),
        captured: CapturedFolder | None = None,
        interval_s: float,
    ) -> None:
        """``membership``: where the node stands, as its supervisor moves it (read only here);
        ``on_published``: given each document written, in order (the metrics export serves the
        newest; the straggler watch judges from it);
        ``captured``: the node's ``--capture-dir`` folder, whose files the document lists."""
        self.config = config
        self.membership = membership
        self.control = control
        self.memory = memory
        self.telemetry = telemetry
        self.replication = replication
        self.on_published = tuple(on_published)
        self.captured = captured
        self.interval_s = interval_s
        self.backend = rdzv.backend
        self.run_id = rdzv.run_id
        self.node_id = rdzv.me.node_id
        self.addr = rdzv.me.addr
        self.outcome: str | None = None  # set once the agent left (succeeded, failed, stopped, error)
        self.started = time.monotonic()
        self.latest: dict[str, Any] | None = None
        self.bytes_written = 0
        self.writes = 0
        self._judge = StalenessJudge(config.heartbeat_timeout_s)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failing = False
        self._seq = 0
        # (incarnation, seq) orders this node's documents for readers that read more than once: a
        # replayed older one is refused (status/view.py DocumentVersions). Wall-clock start first,
        # so a document of an earlier agent on this node also sorts before this one's.
        self.incarnation = f"{time.time_ns():020d}-{os.urandom(4).hex()}"
        telemetry.events.add_listener(lambda record: self._wake.set())
        try:
            history.register_node(self.backend, self.run_id, self.node_id)
        except ResilrunError as exc:
            logger.warning("status: could not register this node: %s", exc.message)
        self._thread = threading.Thread(target=self._run, name="resilrun-status", daemon=True)
        self._thread.start()

    # -- the document -------------------------------------------------------------------------------
    def build(self) -> dict[str, Any]:
        """This node's document (schema in docs/status.md); pure reads of the agent's state."""
        membership = self.membership
        current = membership.current
        state = membership.state
        node_rank = state.node_rank(self.node_id) if state is not None else None
        view = current.snapshot() if current is not None else None
        workers = list(view.workers) if view is not None else []
        spares = list(view.spares) if view is not None else []
        waiting = set(self.control.waiting_spares())
        ranks = [self._rank(w) for w in workers]
        # While the agent runs, the phase its supervisor set; once it left, the outcome (close()).
        node_state = self.outcome or membership.phase.value
        alive_spares = [s for s in spares if s.exit_code is None]
        document: dict[str, Any] = {
            "schema": history.SCHEMA,
            "node_id": self.node_id,
            "host": socket.gethostname(),
            "agent_pid": os.getpid(),
            "addr": self.addr,
            "state": node_state,
            "node_rank": node_rank,
            "round": state.round if state is not None else None,
            "seq": self._seq,
            "incarnation": self.incarnation,
            "written_at": round(time.time(), 3),
            "uptime_s": round(time.monotonic() - self.started, 3),
            "heartbeat_interval_s": self.config.heartbeat_interval_s,
            "ranks": ranks,
            "spares": {
                "configured": self.config.spares,
                "alive": len(alive_spares),
                "ready": len([s for s in alive_spares if s.pid in waiting]),
                "pids": [s.pid for s in alive_spares],
            },
            "tiers": self._tiers([w.global_rank for w in workers], self._finished(workers)),
            "snapshots": self._snapshots(),
            "peer_ages": self._peer_ages(),
            "counts": dict(self.telemetry.counts),
        }
        if self.captured is not None:  # (only then: a job without --capture-dir keeps its document)
            document["captured"] = self.captured.describe()
        return document

    def _rank(self, worker: WorkerSnapshot) -> dict[str, Any]:
        rank = worker.global_rank
        code = worker.exit_code
        silent = self.control.silent_for(worker.pid)
        stalled = self.control.stalled_for(worker.pid)
        progress = self.telemetry.progress.get(rank, {})
        step_time = progress.get("step_time_s")
        # The newest finished step (heartbeats carry it): with --snapshot-every > 1 commits are sparser.
        finished = self._finished([worker])
        step = max(-1 if finished is None else finished, int(progress.get("step", -1)))
        state = RankState.of(code, silent, self.config.heartbeat_timeout_s, "step" in progress)
        return {
            "rank": rank,
            "local_rank": worker.local_rank,
            "pid": worker.pid,
            "state": state.value,
            "exit_code": code,
            "step": step if step >= 0 else None,
            "step_time_s": round(step_time, 6) if step_time else None,
            "steps_per_s": round(1.0 / step_time, 3) if step_time else None,
            # to the rank's last gradient, without its waits for the others (smoothed): the slowest
            # rank's is the longest (issue 48)
            "compute_s": round(compute, 6) if (compute := progress.get("compute_s")) is not None else None,
            "heartbeat_age_s": round(silent, 3) if silent is not None else None,
            "since_commit_s": round(stalled, 3) if stalled is not None else None,
        }

    def _finished(self, workers: list[WorkerSnapshot]) -> int | None:
        """The newest step these workers finished: exact from node memory's control pages, else
        what their heartbeats said (scripts that finish steps without snapshotting any)."""
        exact = self.memory.finished([w.global_rank for w in workers])
        beaten = self.control.newest_step([w.pid for w in workers])
        return max((s for s in (exact, beaten) if s is not None), default=None)

    def _snapshots(self) -> dict[str, Any]:
        config = self.config
        return snapshot_policy(config, self.telemetry.interval, persisting=bool(config.checkpoint_uri))

    def _tiers(self, ranks: list[int], done: int | None) -> dict[str, Any]:
        """The newest step every local rank holds in each tier, and the steps at risk: how many
        finished steps a failure now would redo if it had to restore from that tier (a worker
        failure: memory; a node loss: peer; both replicas lost too: persistent)."""
        steps: list[int | None] = []
        nbytes = 0
        for rank in ranks:
            committed = self.memory.describe(rank)["committed"].values()
            if committed:
                newest = max(committed, key=lambda c: int(c["step"]))
                steps.append(int(newest["step"]))
                nbytes += int(newest["nbytes"])
            else:
                steps.append(None)
        memory_step = None if not steps or None in steps else min(s for s in steps if s is not None)
        tiers: dict[str, Any] = {
            "memory": {"step": memory_step, "bytes": nbytes, "at_risk_steps": _at_risk(done, memory_step)}
        }
        if self.replication is not None:
            status = self.replication()
            replicated = [status.get(rank, {}).get("replicated") for rank in ranks]
            step = None if not replicated or None in replicated else min(s for s in replicated if s is not None)
            # The longest any local rank's training waited for its replicas (the commit gate), in all.
            held = max((float(status.get(rank, {}).get("held_s") or 0.0) for rank in ranks), default=0.0)
            behind = sorted(self.telemetry.replicas_behind().items())
            tiers["peer"] = {
                "step": step,
                "lag_steps": _lag(memory_step, step),
                "at_risk_steps": _at_risk(done, step),
                "waited_s": round(held, 3),
                # Peers the commit gate stopped waiting for (failing, or slower than their usual
                # pace): replicas there lag more than a step until they catch up.
                "behind": [{"peer": peer, "reason": why} for peer, why in behind],
            }
        if self.config.checkpoint_uri:
            uploaded = [self.telemetry.uploaded.get(rank) for rank in ranks]
            step = None if not uploaded or None in uploaded else min(s for s in uploaded if s is not None)
            tiers["persistent"] = {
                "step": step,  # newest step every local rank uploaded
                "lag_steps": _lag(memory_step, step),
                "at_risk_steps": _at_risk(done, step),
                "complete_step": self.telemetry.persisted_step,  # newest step this agent committed for all
            }
        return tiers

    def _peer_ages(self) -> dict[str, float | None]:
        """Heartbeat ages of the next ``_WATCHED`` nodes, judged on this agent's clock."""
        state = self.membership.state
        if state is None or len(state.participants) < 2:
            return {}
        rank = state.node_rank(self.node_id)
        if rank is None:
            return {}
        nodes = state.participants
        watched = [nodes[(rank + i) % len(nodes)].node_id for i in range(1, min(_WATCHED, len(nodes) - 1) + 1)]
        for node, reading in read_heartbeats(self.backend, self.run_id, watched).items():
            self._judge.observe_reading(node, reading)
        self._judge.forget_all_but(watched)
        return {node: _round(self._judge.age(node)) for node in watched}

    # -- publishing -----------------------------------------------------------------------------------
    def publish(self) -> None:
        """Build and write the document once (store errors are logged once, then retried)."""
        self._seq += 1
        try:
            document = self.build()
            self.latest = document
            for listener in self.on_published:
                listener(document)
            self.bytes_written += history.publish_node(self.backend, self.run_id, self.node_id, document)
            self.writes += 1
            self._failing = False
        except ResilrunError as exc:
            if not self._failing:
                logger.warning("status: could not publish: %s", exc.message)
            self._failing = True

    def _run(self) -> None:
        while not self._stop.is_set():
            self.publish()
            self._wake.wait(self.interval_s)
            if self._wake.is_set():
                self._wake.clear()
                self._stop.wait(_MIN_GAP_S)

    def close(self, final_state: str | None = None) -> None:
        """Stop the thread; with ``final_state`` (succeeded, failed, stopped) publish it one last time."""
        self._stop.set()
        self._wake.set()
        self._thread.join(self.interval_s + 5)
        if final_state is not None:
            self.outcome = final_state
            self.publish()


def _lag(newest: int | None, step: int | None) -> int | None:
    return None if newest is None or step is None else max(0, newest - step)


def _at_risk(done: int | None, step: int | None) -> int | None:
    """Finished steps after ``step`` (none held: all of them, from step 0)."""
    if done is None:
        return None
    return max(0, done - (-1 if step is None else step))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def snapshot_policy(config: Config, decided: dict[str, Any] | None, *, persisting: bool) -> dict[str, Any]:
    """How often each tier takes a step: the intervals set, and what ``auto`` measured and chose
    (``decided``: the workers' newest ``snapshot_interval`` decision). With ``--replicas 0`` no
    snapshot goes to a peer, so no replica interval is claimed whatever ``--replicate-every`` says."""
    auto = config.snapshot_every == SNAPSHOT_AUTO
    replicating = config.replicas > 0
    replicas_auto = config.replicate_every == SNAPSHOT_AUTO and replicating
    decided = decided or {}
    replicate_every: int | str | None = None
    if replicating:
        replicate_every = "auto" if config.replicate_every == SNAPSHOT_AUTO else config.replicate_every
    return {
        "every": "auto" if auto else config.snapshot_every,
        "interval": decided.get("interval") if auto else config.snapshot_every,
        "max_overhead_pct": config.max_overhead_pct if auto else None,
        # measured by the workers at their last decision (auto only): fraction of step time
        "overhead": decided.get("overhead") if auto else None,
        "step_time_s": decided.get("quiet_step_s") if auto else None,
        "decided_at_step": decided.get("step") if auto else None,
        "replicas": config.replicas,
        "replicate_every": replicate_every,
        # --replicate-every auto: every k-th snapshot goes to the peers, about every N steps
        "replicate_every_snapshots": decided.get("replicate_every") if replicas_auto else None,
        "replica_interval": decided.get("replica_interval") if replicas_auto else None,
        "persist_every": config.persist_every if persisting else None,
    }
