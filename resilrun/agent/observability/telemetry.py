"""What the agent tells the outside world about the job: events, store history, timelines, metrics.

The supervisor, the worker channel, the persister and the replicator call the hooks of
:class:`Telemetry`; the base class does nothing, so a supervisor built without telemetry (tests,
simulations) needs no sink. :class:`AgentTelemetry` turns each hook into an ``events.jsonl`` line, a
job history record in the rendezvous store where the hook is job-wide, and metric updates.

Recovery timeline: every round entered after a failure (an in-process generation or a restart) is
tracked per node from the moment the node enters it. The workers report three milestones over the
agent channel (state restored with its tier, bytes and seconds; collectives rebuilt; first step
done), and the node writes its share of the timeline to the store on each report. ``status``
joins the job-wide record (failure time, replacement chosen) with every node's share. Offsets across
nodes are differences of wall-clock times (meant for people; skew between machines shows up as
such), durations inside one process are monotonic.

Invariant: hooks never raise into the caller for a store or file problem: a broken status must not
break recovery.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from resilrun.agent.observability.events import EventLog
from resilrun.errors import ResilrunError
from resilrun.rendezvous.api import RendezvousBackend
from resilrun.status import records as history

if TYPE_CHECKING:
    from resilrun.agent.observability.metrics import AgentMetrics
    from resilrun.agent.workers.failures import ProcessFailure
    from resilrun.agent.workers.procs import WorkerProcess
    from resilrun.rendezvous.protocol import RdzvState

logger = logging.getLogger(__name__)

# Exponential smoothing of the step time: about the last ten steps count.
_STEP_EWMA = 0.2


class Telemetry:
    """The hooks, doing nothing. See :class:`AgentTelemetry` for what each one records."""

    def round_started(self, state: RdzvState, node_rank: int, workers: list[WorkerProcess]) -> None:
        """The node formed ``state.round`` and spawned its workers."""

    def failures(self, round: int, failures: list[ProcessFailure]) -> None:
        """Workers of ``round`` failed (found by this agent)."""

    def hung(self, rank: int, pid: int, reason: str) -> None:
        """A worker was judged hung and is being killed."""

    def spare_exited(self, pid: int, exit_code: int | None, message: str, alive: int, retry_in_s: float) -> None:
        """A hot spare died while it waited for a rank; ``alive`` spares are left on this node."""

    def recovery_decided(
        self,
        new: RdzvState,
        failed: list[WorkerProcess],
        replacements: dict[int, WorkerProcess],
        decided_s: float,
        *,
        rerun: bool = False,
        straggler: bool = False,
    ) -> None:
        """This agent decided an in-process recovery into ``new.round`` with these spares; ``rerun``:
        the survivors run a plain script again from its first line (``--rerun-in-process``);
        ``straggler``: ``failed`` did not fail but was swapped out for being slow (``--stragglers swap``)."""

    def straggler(self, kind: str, rank: int, **evidence: Any) -> None:
        """A straggler of this node: ``kind`` is detected, cleared, swapped or swap_skipped."""

    def device_unhealthy(self, rank: int, pid: int, check: dict[str, Any]) -> None:
        """A process's device failed its check before it took ``rank`` (it exits; worker/health.py)."""

    def nodes_replaced(
        self, new: RdzvState, failures: list[ProcessFailure], *, straggler: tuple[int, str] | None = None
    ) -> None:
        """This agent gave lost nodes' places (``failures``, one per node) to spare nodes in ``new``,
        or its own place as a straggler (``straggler``: its node rank and host)."""

    def generation_entered(self, new: RdzvState, node_rank: int, workers: list[WorkerProcess]) -> None:
        """This node's workers (survivors and promoted spares) moved to generation ``new.round``."""

    def restart(self, old: RdzvState, new: RdzvState, cause: ProcessFailure | None) -> None:
        """A whole-job restart (the torchrun-style fallback) was asked for after ``old.round``."""

    def node_lost(self, state: RdzvState, failures: list[ProcessFailure], lost: tuple[str, ...]) -> None:
        """Nodes stopped heartbeating; ``failures`` describes each (rank and host)."""

    def committed(
        self, rank: int, step: int, nbytes: int, copy_s: float | None, compute_s: float | None = None
    ) -> None:
        """A worker committed ``step`` into node memory, copying ``nbytes`` (called per step: O(1));
        ``compute_s``: its mean compute time per step since its previous commit, if measured."""

    def worker_report(self, pid: int, report: dict[str, Any]) -> None:
        """A worker's recovery milestone, sent over the agent channel."""

    def replicated(self, rank: int, step: int, nbytes: int, seconds: float) -> None:
        """A snapshot reached a peer replica."""

    def replica_health(self, peer: str, keeps_up: bool, why: str) -> None:
        """Replication to ``peer`` started failing (its replicas fall behind) or caught up again."""

    def replica_dropped(self, peer: str) -> None:
        """``peer``, told behind, is no longer a replica target (the replica peers were chosen again)."""

    def persisted(self, rank: int, step: int, nbytes: int, seconds: float, complete: bool) -> None:
        """A rank's snapshot was uploaded; ``complete``: this upload completed the step for all ranks."""

    def exit(self, outcome: str, message: str | None = None) -> None:
        """The agent is leaving (succeeded, failed, stopped, or error)."""


class _Part:
    """One node's share of the timeline of a round entered after a failure."""

    def __init__(self, round: int, node_rank: int, kind: str, ranks: dict[int, bool], newest_before: int) -> None:
        self.round = round
        self.node_rank = node_rank
        self.kind = kind
        self.entered_at = time.time()
        self.entered_mono = time.monotonic()
        self.newest_before = newest_before
        self.ranks: dict[int, dict[str, Any]] = {rank: {"replacement": spare} for rank, spare in ranks.items()}
        self.done = False

    def to_dict(self) -> dict[str, Any]:
        restored = [r["restored_step"] for r in self.ranks.values() if "restored_step" in r]
        redone = max(0, self.newest_before - min(restored)) if restored and self.newest_before >= 0 else None
        return {
            "round": self.round,
            "node_rank": self.node_rank,
            "kind": self.kind,
            "entered_at": self.entered_at,
            "newest_step_before": self.newest_before,
            "steps_redone": redone,
            "complete": self.done,
            "ranks": {str(rank): info for rank, info in sorted(self.ranks.items())},
        }


class AgentTelemetry(Telemetry):
    """Events to the log file, job-wide records to the store, numbers to metrics (when enabled)."""

    def __init__(
        self,
        events: EventLog,
        backend: RendezvousBackend,
        run_id: str,
        metrics: AgentMetrics | None = None,
        finished: Callable[[list[int]], int | None] = lambda ranks: None,
    ) -> None:
        """``finished(ranks)``: the newest step those local ranks finished, snapshotted or not (node
        memory's control pages): what a failure's redone steps are counted from."""
        self.events = events
        self._finished = finished
        self.backend = backend
        self.run_id = run_id
        self.node_id = events.node_id
        self.metrics = metrics
        self._lock = threading.Lock()
        self._parts: dict[int, _Part] = {}
        self.newest_committed = -1
        # rank -> {"step", "at" (monotonic), "step_time_s"}: what status shows as steps/s
        self.progress: dict[int, dict[str, float]] = {}
        self.persisted_step: int | None = None  # newest step whose COMPLETE.json this agent wrote
        self.uploaded: dict[int, int] = {}  # rank -> newest step of it uploaded by this agent
        self.behind: dict[str, str] = {}  # replica peer -> why the commit gate no longer waits for it
        # The newest --snapshot-every auto decision rank 0 reported (this node's copy when rank 0 is
        # here; every rank took the same one): interval, measured step time, cost, overhead.
        self.interval: dict[str, Any] | None = None
        self.counts = {"failures": 0, "recoveries": 0, "restarts": 0, "nodes_lost": 0, "spares_exited": 0}
        self.outcome: str | None = None
        self._seen_failures: set[tuple[int, int, int]] = set()
        self._seen_lost: set[tuple[str, int]] = set()
        self._report_lock = threading.Lock()
        self._pids: set[int] = set()  # this node's worker processes in the current generation

    # -- store helpers ------------------------------------------------------------------------------
    def _store(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(self.backend, self.run_id, *args)
        except ResilrunError as exc:
            logger.debug("status: could not write %s: %s", what, exc.message)
            return None

    def _append_once(self, claim: str, record: dict[str, Any]) -> None:
        if self._store("history claim", history.claim, claim, self.node_id):
            self._store("history", history.append, {**record, "recorded_by": self.node_id})

    # -- supervisor hooks ---------------------------------------------------------------------------
    def round_started(self, state: RdzvState, node_rank: int, workers: list[WorkerProcess]) -> None:
        self.events.node_rank = node_rank
        self._pids = {w.pid for w in workers}
        ranks = [w.spec.global_rank for w in workers]
        self.events.record(
            "round_started",
            round=state.round,
            restarts=state.restarts,
            nodes=len(state.participants),
            world_size=sum(p.local_world_size for p in state.participants),
            ranks=ranks,
            pids=[w.pid for w in workers],
        )
        if state.round > 0:
            self._track(state.round, node_rank, "restart", dict.fromkeys(ranks, False))
        if self.metrics is not None:
            self.metrics.generation.set(state.round)

    def failures(self, round: int, failures: list[ProcessFailure]) -> None:
        # The restart path describes again the failures an in-process attempt already reported.
        failures = [f for f in failures if (round, f.global_rank, f.pid) not in self._seen_failures]
        self._seen_failures.update((round, f.global_rank, f.pid) for f in failures)
        for failure in failures:
            self.counts["failures"] += 1
            self.events.record(
                "failure_detected",
                round=round,
                rank=failure.global_rank,
                local_rank=failure.local_rank,
                pid=failure.pid,
                exit_code=failure.exit_code,
                signal=failure.signal_name,
                failed_at=failure.timestamp,
                message=(failure.message or "").splitlines()[0][:300] if failure.message else "",
            )
        if self.metrics is not None and failures:
            self.metrics.failures.inc(len(failures))

    def hung(self, rank: int, pid: int, reason: str) -> None:
        self.events.record("hang_detected", rank=rank, pid=pid, reason=reason)

    def spare_exited(self, pid: int, exit_code: int | None, message: str, alive: int, retry_in_s: float) -> None:
        self.counts["spares_exited"] += 1
        self.events.record(
            "spare_exited", pid=pid, exit_code=exit_code, message=message[:300], alive=alive, retry_in_s=retry_in_s
        )

    def recovery_decided(
        self,
        new: RdzvState,
        failed: list[WorkerProcess],
        replacements: dict[int, WorkerProcess],
        decided_s: float,
        *,
        rerun: bool = False,
        straggler: bool = False,
    ) -> None:
        detected_at = min((w.exit_observed_at or time.time()) for w in failed) if failed else time.time()
        promoted = []
        for worker in failed:
            spare = replacements.get(worker.spec.local_rank)
            if spare is not None:
                # warm: started before the failure was seen (a hot spare); else a new process the
                # survivors waited for (no spare was left).
                warm = getattr(spare, "started_at", detected_at) < detected_at
                promoted.append(
                    {"rank": worker.spec.global_rank, "failed_pid": worker.pid, "spare_pid": spare.pid, "warm": warm}
                )
                self.events.record(
                    "spare_promoted",
                    round=new.round,
                    rank=worker.spec.global_rank,
                    spare_pid=spare.pid,
                    warm=warm,
                    rerun=rerun,
                    straggler=straggler,
                )
        record = {
            "kind": "recovery",
            "round": new.round,
            "recoveries": new.recoveries,
            "nodes": len(new.participants),
            "detected_at": detected_at,
            "decided_at": detected_at + decided_s,
            "decided_s": round(decided_s, 6),
            "failed_ranks": sorted(w.spec.global_rank for w in failed),
            "exit_codes": {str(w.spec.global_rank): w.popen.returncode for w in failed},
            "replacements": promoted,
            # Why: a re-run redoes the script's own set-up and resumes from its own checkpoint
            # (its save interval), not from resilrun's snapshot: an operator reading a slower
            # recovery, or more steps redone, needs to know which path it took.
            "rerun": rerun,
            # Why: a swapped straggler did not fail; its "exit code" is that of a live process.
            "straggler": straggler,
            "cause": _cause(new.failure),
        }
        self._append_once(f"round-{new.round}", record)

    def straggler(self, kind: str, rank: int, **evidence: Any) -> None:
        self.events.record(f"straggler_{kind}", rank=rank, **evidence)
        if self.metrics is not None:
            self.metrics.on_straggler(kind, rank, evidence)

    def device_unhealthy(self, rank: int, pid: int, check: dict[str, Any]) -> None:
        fields = ("device", "round", "check", "reason", "answer_s", "gflops", "expected_gflops")
        self.events.record("device_unhealthy", rank=rank, pid=pid, **{k: check.get(k) for k in fields})

    def nodes_replaced(
        self, new: RdzvState, failures: list[ProcessFailure], *, straggler: tuple[int, str] | None = None
    ) -> None:
        detected_at = min((f.timestamp for f in failures), default=time.time())
        places = [(f.node_rank, f.host) for f in failures] + ([straggler] if straggler is not None else [])
        replaced, failed_ranks = [], []
        for node_rank, host in places:
            if not 0 <= node_rank < len(new.participants):
                continue
            node = new.participants[node_rank]
            first = sum(p.local_world_size for p in new.participants[:node_rank])
            failed_ranks += list(range(first, first + node.local_world_size))
            replaced.append({"node_rank": node_rank, "lost_host": host, "spare_node_id": node.node_id,
                             "spare_host": node.hostname})  # fmt: skip
            self.events.record("spare_promoted", round=new.round, node_rank_taken=node_rank,
                               spare_node_id=node.node_id, straggler=straggler is not None)  # fmt: skip
        record = {
            "kind": "recovery",
            "round": new.round,
            "recoveries": new.recoveries,
            "nodes": len(new.participants),
            "detected_at": detected_at,
            "decided_at": time.time(),
            "decided_s": round(time.time() - detected_at, 6),
            "failed_ranks": failed_ranks,
            "replacements": replaced,
            "rerun": False,  # a spare node takes a lost node's ranks only for scripts on the API
            "straggler": straggler is not None,  # the node was swapped out for being slow, not lost
            "cause": _cause(new.failure),
        }
        self._append_once(f"round-{new.round}", record)

    def generation_entered(self, new: RdzvState, node_rank: int, workers: list[WorkerProcess]) -> None:
        # A replacement is a process that did not run a rank of this node in the previous generation.
        ranks = {w.spec.global_rank: w.pid not in self._pids for w in workers}
        self._pids = {w.pid for w in workers}
        with self._lock:  # a replacement's compute time is its own, not its predecessor's
            for rank in (r for r, replaced in ranks.items() if replaced and r in self.progress):
                self.progress[rank].pop("compute_s", None)
        self.events.record(
            "generation_entered",
            round=new.round,
            ranks=sorted(ranks),
            pids=[w.pid for w in workers],
            newest_step_before=max(self.newest_committed, _or_none(self._finished(sorted(ranks)))),
        )
        self._track(new.round, node_rank, "recovery", ranks)
        if self.metrics is not None:
            self.metrics.generation.set(new.round)

    def restart(self, old: RdzvState, new: RdzvState, cause: ProcessFailure | None) -> None:
        if new.closed or new.round == old.round:
            return
        self.counts["restarts"] += 1
        self.events.record(
            "restart", from_round=old.round, round=new.round, restarts=new.restarts, cause=_cause(new.failure)
        )
        failed_at = cause.timestamp if cause is not None else time.time()
        record = {
            "kind": "restart",
            "round": new.round,
            "restarts": new.restarts,
            "detected_at": failed_at,
            "decided_at": time.time(),
            "failed_ranks": [cause.global_rank] if cause is not None else [],
            "cause": _cause(new.failure),
        }
        self._append_once(f"round-{new.round}", record)
        if self.metrics is not None:
            self.metrics.recoveries.labels(kind="restart").inc()

    def node_lost(self, state: RdzvState, failures: list[ProcessFailure], lost: tuple[str, ...]) -> None:
        new = 0
        for node_id, failure in zip(lost, failures, strict=False):
            if (node_id, state.round) in self._seen_lost:  # judged again on the restart path
                continue
            self._seen_lost.add((node_id, state.round))
            new += 1
            self.counts["nodes_lost"] += 1
            marker = {
                "round": state.round,
                "node_rank": failure.node_rank,
                "host": failure.host,
                "judged_by": self.node_id,
                "at": failure.timestamp,
                "message": failure.message,
            }
            self.events.record("node_lost", lost_node_id=node_id, **{k: v for k, v in marker.items() if k != "at"})
            self._store("lost marker", history.mark_lost, node_id, marker)
            self._append_once(f"lost-{node_id}-{state.round}", {"kind": "node_lost", "node_id": node_id, **marker})
        if self.metrics is not None and new:
            self.metrics.nodes_lost.inc(new)

    def exit(self, outcome: str, message: str | None = None) -> None:
        self.outcome = outcome
        self.events.record("exit", outcome=outcome, message=message)

    # -- channel, tiers -----------------------------------------------------------------------------
    def committed(
        self, rank: int, step: int, nbytes: int, copy_s: float | None, compute_s: float | None = None
    ) -> None:
        now = time.monotonic()
        with self._lock:
            self.newest_committed = max(self.newest_committed, step)
            seen = self.progress.get(rank)
            step_time = None
            if seen is not None and step > seen["step"]:
                step_time = (now - seen["at"]) / (step - seen["step"])
                previous = seen.get("step_time_s")
                smoothed = step_time if previous is None else previous + _STEP_EWMA * (step_time - previous)
                self.progress[rank] = {"step": step, "at": now, "step_time_s": smoothed}
            else:
                self.progress[rank] = {"step": step, "at": now, **({} if seen is None else _keep_rate(seen))}
            earlier = None if seen is None else seen.get("compute_s")
            if compute_s is not None:
                smoothed = compute_s if earlier is None else earlier + _STEP_EWMA * (compute_s - earlier)
                self.progress[rank]["compute_s"] = smoothed
            elif earlier is not None:
                self.progress[rank]["compute_s"] = earlier
        if self.metrics is not None:
            self.metrics.on_commit(rank, step, nbytes, copy_s, step_time)

    def worker_report(self, pid: int, report: dict[str, Any]) -> None:
        # Reports arrive on several channel threads at once; a part is rewritten whole on each one,
        # so building and writing it is serialized (or an older document could land last).
        with self._report_lock:
            self._worker_report(pid, report)

    def _worker_report(self, pid: int, report: dict[str, Any]) -> None:
        rank, round_, kind = int(report["rank"]), int(report["round"]), str(report["event"])
        if kind == "snapshot_interval":
            fields = {k: v for k, v in report.items() if k not in ("event", "op", "pid", "at")}
            with self._lock:
                self.interval = fields
            self.events.record("snapshot_interval", **fields)
            return
        with self._lock:
            part = self._parts.get(round_)
            if part is None or part.done:
                return
            info = part.ranks.setdefault(rank, {"replacement": False})
            info["pid"] = pid
            if kind == "state_restored":
                info.update(
                    restored_step=int(report["step"]),
                    tier=str(report["tier"]),
                    bytes=int(report["bytes"]),
                    transfer_s=float(report["seconds"]),
                    restored_at=float(report["at"]),
                )
            elif kind == "collectives_rebuilt":
                info.update(collectives_s=float(report["seconds"]), collectives_at=float(report["at"]))
            elif kind == "first_step":
                info.update(first_step=int(report["step"]), first_step_at=float(report["at"]))
            else:
                raise ValueError(f"unknown report {kind!r}")
            finished = all("first_step_at" in r for r in part.ranks.values())
            part.done = finished
            document = part.to_dict()
        event = {"state_restored": "state_transferred"}.get(kind, kind)
        fields = {k: v for k, v in report.items() if k not in ("event", "op", "pid")}
        self.events.record(event, pid=pid, **fields)
        if kind == "state_restored" and self.metrics is not None:
            self.metrics.on_restore(str(report["tier"]), int(report["bytes"]), float(report["seconds"]))
        if finished:
            self._finish(part, document)
        self._store("recovery part", history.write_part, round_, part.node_rank, document)

    def _finish(self, part: _Part, document: dict[str, Any]) -> None:
        last = max(r["first_step_at"] for r in part.ranks.values())
        seconds = time.monotonic() - part.entered_mono
        if part.kind == "recovery":
            self.counts["recoveries"] += 1
        self.events.record(
            "recovered",
            round=part.round,
            kind=part.kind,
            since_entered_s=round(last - part.entered_at, 6),
            steps_redone=document["steps_redone"],
            ranks=sorted(part.ranks),
        )
        if self.metrics is not None:
            kind = "in_process" if part.kind == "recovery" else "restart"
            if part.kind == "recovery":
                self.metrics.recoveries.labels(kind=kind).inc()
            self.metrics.recovery_seconds.labels(kind=kind).observe(max(seconds, last - part.entered_at))

    def replicated(self, rank: int, step: int, nbytes: int, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.on_snapshot("peer", nbytes, seconds)

    def replica_health(self, peer: str, keeps_up: bool, why: str) -> None:
        # Why an event and not only the status's lag: a replica that falls behind widens what a
        # node loss costs; the events file is where an operator reads, afterwards, when and why.
        with self._lock:
            if keeps_up:
                self.behind.pop(peer, None)
            else:
                self.behind[peer] = why
        if keeps_up:
            self.events.record("replica_caught_up", peer=peer)
        else:
            self.events.record("replica_behind", peer=peer, reason=why)

    def replica_dropped(self, peer: str) -> None:
        # A lost node's replica server stays "behind" for ever otherwise: no push to it will land
        with self._lock:
            was = self.behind.pop(peer, None)
        if was is not None:
            self.events.record("replica_dropped", peer=peer, reason="no longer a replica target")

    def replicas_behind(self) -> dict[str, str]:
        """The replica peers the commit gate no longer waits for, with why (a copy: status reads it)."""
        with self._lock:
            return dict(self.behind)

    def persisted(self, rank: int, step: int, nbytes: int, seconds: float, complete: bool) -> None:
        if self.metrics is not None:
            self.metrics.on_snapshot("persistent", nbytes, seconds)
        with self._lock:
            self.uploaded[rank] = max(step, self.uploaded.get(rank, -1))
        if complete:
            self.persisted_step = max(step, self.persisted_step if self.persisted_step is not None else -1)
            self.events.record("snapshot_persisted", step=step)

    # -- internals ----------------------------------------------------------------------------------
    def _track(self, round: int, node_rank: int, kind: str, ranks: dict[int, bool]) -> None:
        # The newest finished step, not the newest snapshot: with --snapshot-every > 1 the steps
        # since the snapshot are redone too.
        finished = self._finished(list(ranks))
        with self._lock:
            newest = max(self.newest_committed, _or_none(finished))
            part = _Part(round, node_rank, kind, ranks, newest)
            self._parts = {r: p for r, p in self._parts.items() if r > round - 8}  # a few recent rounds
            self._parts[round] = part
            document = part.to_dict()
        self._store("recovery part", history.write_part, round, node_rank, document)


def _or_none(step: int | None) -> int:
    return -1 if step is None else step


def _keep_rate(seen: dict[str, float]) -> dict[str, float]:
    return {"step_time_s": seen["step_time_s"]} if "step_time_s" in seen else {}


def _cause(failure: dict[str, Any] | None) -> dict[str, Any] | None:
    """The few fields of a failure record worth showing (the traceback stays in the log files)."""
    if not failure:
        return None
    message = str(failure.get("message") or "")
    return {
        "rank": failure.get("global_rank"),
        "node_rank": failure.get("node_rank"),
        "host": failure.get("host"),
        "exit_code": failure.get("exit_code"),
        "failed_at": failure.get("timestamp"),
        "message": message.splitlines()[0][:300] if message else "",
    }
