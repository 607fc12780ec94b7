"""Stragglers acted on by the agents: one verdict the job shares, and under ``--stragglers swap``
the slow rank replaced by a hot spare at a step boundary.

**Who judges.** The agent of node rank 0 (the leader), each time it publishes its status document
(every heartbeat interval): it reads every participant's document in one store call and applies the
rule of :mod:`resilrun.status.stragglers` to the ranks' compute times (each already smoothed over
about ten steps by its agent). One reading is not a verdict: a rank becomes a straggler once
``SUSTAIN_CHECKS`` readings in a row name it, and stops being one only after as many readings in a
row that do not (no flapping near the threshold). A new generation starts every count again: the
first steps after a recovery are slow on every rank, and a replaced rank's time is another
process's. Only the leader reads every document (one ``get_many`` per interval): an agent that
judged alone would read all of them too, N times over.

**Who speaks.** The leader writes its verdicts (and swap orders) to one key when they change. Every
agent reads that key once per publish and speaks for its own ranks: ``straggler_detected`` and
``straggler_cleared`` in its events (so the event's host is the slow one's), the swap carried out by
the node that runs the rank (:class:`StragglerSwap`).

**Swap orders.** At most one per generation (a swap opens the next one); only for a rank whose node
reports a hot spare waiting for a rank; at most ``--straggler-swaps`` in any hour, job-wide (the
orders' times are kept in the key, so a new leader goes on counting). A node that cannot carry an
order out (the spare went, the script commits no steps) says why in ``straggler_swap_skipped``.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.supervision.inprocess import InProcessRecovery
from resilrun.agent.supervision.rounds import Membership, Round
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.procs import Processes, WorkerProcess
from resilrun.agent.workers.step_fence import StepFence
from resilrun.config import Config
from resilrun.errors import ResilrunError
from resilrun.rendezvous.api import RendezvousBackend
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.status import records
from resilrun.status.stragglers import stragglers

logger = logging.getLogger(__name__)

SUSTAIN_CHECKS = 5  # readings (heartbeat intervals) in a row that name a rank, or clear it
HOUR_S = 3600.0
# A straggler commits every snapshot; one that has not within this long is not stopped (the order
# lapses): a swap must never stall the job waiting for a boundary.
FENCE_WAIT_S = 60.0


@dataclass
class Verdicts:
    """The leader's judgement across readings (pure: the caller reads and writes the store)."""

    swap: bool
    budget: int
    round: int = -1
    named_in_a_row: dict[int, int] = field(default_factory=dict)
    quiet_in_a_row: dict[int, int] = field(default_factory=dict)
    current: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> evidence
    orders: list[dict[str, Any]] = field(default_factory=list)

    def check(
        self, generation: int, documents: list[dict[str, Any]], now: float, spare_nodes: int = 0
    ) -> dict[str, Any] | None:
        """One reading of the participants' documents (this generation's only), with the number of
        spare nodes standing by; the key's new content when the verdicts or orders changed, else None."""
        if generation != self.round:
            self.round, self.named_in_a_row, self.quiet_in_a_row = generation, {}, {}
            changed = bool(self.current)
            self.current = {}
        else:
            changed = False
        where: dict[int, dict[str, Any]] = {}
        ready: dict[str, int] = {}
        for doc in documents:
            if doc.get("round") != generation:
                continue
            ready[doc["node_id"]] = int(doc.get("spares", {}).get("ready", 0))
            for rank in doc.get("ranks", []):
                if rank.get("state") == "running" and rank.get("compute_s"):
                    where[rank["rank"]] = {"node_id": doc["node_id"], "host": doc.get("host"), **rank}
        named = {s.rank: s for s in stragglers({r: float(e["compute_s"]) for r, e in where.items()})}
        for rank in where:
            if rank in named:
                self.named_in_a_row[rank] = self.named_in_a_row.get(rank, 0) + 1
                self.quiet_in_a_row.pop(rank, None)
            else:
                self.named_in_a_row.pop(rank, None)
                self.quiet_in_a_row[rank] = self.quiet_in_a_row.get(rank, 0) + 1
            if rank in named and self.named_in_a_row[rank] >= SUSTAIN_CHECKS and rank not in self.current:
                s = named[rank]
                self.current[rank] = {
                    "rank": rank,
                    "node_id": where[rank]["node_id"],
                    "host": where[rank]["host"],
                    "compute_s": _r6(s.compute_s),
                    "others_median_s": _r6(s.others_median_s),
                    "ratio": round(s.ratio, 2),
                }
                changed = True
            elif rank not in named and rank in self.current and self.quiet_in_a_row[rank] >= SUSTAIN_CHECKS:
                del self.current[rank]
                changed = True
        for rank in [r for r in self.current if r not in where]:  # gone (replaced, finished)
            del self.current[rank]
            changed = True
        changed |= self._order(ready, spare_nodes, now)
        return self.document() if changed else None

    def _order(self, ready: dict[str, int], spare_nodes: int, now: float) -> bool:
        """A swap of the slowest straggler: by a hot spare on its node if one waits, else its whole
        node by a spare node (a throttled device, a bad host: what a process swap cannot fix)."""
        self.orders = [o for o in self.orders if now - o["at"] < HOUR_S]
        if not self.swap or not self.current or any(o["round"] == self.round for o in self.orders):
            return False
        if len(self.orders) >= self.budget:
            return False
        slowest = max(self.current.values(), key=lambda e: (e["ratio"], -e["rank"]))
        if ready.get(slowest["node_id"], 0) >= 1:
            kind = "process"
        elif spare_nodes >= 1:
            kind = "host"
        else:
            return False
        number = max((o["id"] for o in self.orders), default=0) + 1
        self.orders.append(
            {
                "id": number,
                "kind": kind,
                "rank": slowest["rank"],
                "node_id": slowest["node_id"],
                "round": self.round,
                "at": now,
            }
        )
        return True

    def document(self) -> dict[str, Any]:
        named = sorted(self.current.values(), key=lambda e: e["rank"])
        return {"round": self.round, "stragglers": named, "swaps": self.orders}

    def resume(self, document: dict[str, Any] | None) -> None:
        """Go on from a previous leader's key (its orders count against the budget)."""
        if document is not None:
            self.orders = [o for o in document.get("swaps", []) if isinstance(o, dict) and "at" in o]


def _r6(seconds: float) -> float:
    return round(seconds, 6)


class StragglerWatch:
    """Called with each status document this node publishes (the status thread): judges as the
    leader, speaks for this node's ranks, and hands this node's swap orders to ``request_swap``."""

    def __init__(
        self,
        backend: RendezvousBackend,
        run_id: str,
        membership: Membership,
        telemetry: Telemetry,
        *,
        swap: bool,
        budget: int,
        request_swap: Callable[[dict[str, Any]], None],
        spare_nodes: Callable[[], int] = lambda: 0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """``spare_nodes``: how many spare nodes stand by now (the rendezvous document)."""
        self._spare_nodes = spare_nodes
        self._backend = backend
        self._run_id = run_id
        self._membership = membership
        self._telemetry = telemetry
        self._request_swap = request_swap
        self._wall = wall
        self._verdicts = Verdicts(swap=swap, budget=budget)
        self._resumed = False
        self._reported: dict[int, dict[str, Any]] = {}
        self._handled = 0  # the newest order id this node acted on
        self._failing = False

    def observe(self, document: dict[str, Any]) -> None:
        state = self._membership.state
        if state is None or document.get("node_rank") is None:
            return
        try:
            if document["node_rank"] == 0:
                shared = self._judge(state.round, document, [p.node_id for p in state.participants])
            else:
                shared = records.stragglers(self._backend, self._run_id)
            self._failing = False
        except ResilrunError as exc:
            if not self._failing:
                logger.warning("stragglers: the store did not answer: %s", exc.message)
            self._failing = True
            return
        if shared is not None:
            self._speak(document, shared)

    def _judge(self, generation: int, mine: dict[str, Any], nodes: list[str]) -> dict[str, Any]:
        if not self._resumed:
            self._verdicts.resume(records.stragglers(self._backend, self._run_id))
            self._resumed = True
        others = [n for n in nodes if n != mine["node_id"]]
        documents = [mine] + [d for d in records.node_documents(self._backend, self._run_id, others) if d]
        # Spare nodes come and go without a new generation: read only while there is a straggler.
        spare_nodes = self._spare_nodes() if self._verdicts.current or self._verdicts.named_in_a_row else 0
        changed = self._verdicts.check(generation, documents, self._wall(), spare_nodes)
        if changed is not None:
            records.publish_stragglers(self._backend, self._run_id, changed)
        return self._verdicts.document()

    def _speak(self, mine: dict[str, Any], shared: dict[str, Any]) -> None:
        if shared.get("round") != mine.get("round"):
            return
        own = {r["rank"] for r in mine.get("ranks", [])}
        named = {e["rank"]: e for e in shared.get("stragglers", []) if e.get("rank") in own}
        for rank, evidence in named.items():
            if rank not in self._reported:
                self._telemetry.straggler("detected", rank, **_evidence(evidence))
                logger.warning(
                    "rank %d is a straggler: computes %.1fx the others' median (%.1f ms vs %.1f ms)",
                    rank,
                    evidence["ratio"],
                    evidence["compute_s"] * 1e3,
                    evidence["others_median_s"] * 1e3,
                )
        for rank in [r for r in self._reported if r not in named]:
            self._telemetry.straggler("cleared", rank)
        self._reported = named
        for order in shared.get("swaps", []):
            if order.get("node_id") == mine["node_id"] and order.get("id", 0) > self._handled:
                self._handled = order["id"]
                if order.get("round") == mine.get("round"):
                    self._request_swap(order)


def _evidence(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: entry[k] for k in ("compute_s", "others_median_s", "ratio") if k in entry}


def straggler_watch(
    config: Config,
    rdzv: RendezvousClient,
    membership: Membership,
    telemetry: Telemetry,
    swap: StragglerSwap | None,
) -> Callable[[dict[str, Any]], None] | None:
    """What judges and reports stragglers from each document the node publishes (none under
    ``--stragglers off``); ``swap``: this node's executor of swap orders (none: report only)."""
    if config.stragglers == "off":
        return None
    watch = StragglerWatch(
        rdzv.backend,
        rdzv.run_id,
        membership,
        telemetry,
        swap=swap is not None,
        budget=config.straggler_swaps,
        request_swap=swap.request if swap is not None else lambda order: None,
        spare_nodes=lambda: len(rdzv.state().spares),
    )
    return watch.observe


class SwapOutcome(Enum):
    """What a ``StragglerSwap.tick`` did to the round."""

    NONE = "none"  # nothing yet (or the order was skipped)
    SWAPPED = "swapped"  # a hot spare runs the rank now: the round is in a new generation
    LEFT = "left"  # a spare node took this node's place: this node's round is over, it stands by


class StragglerSwap:
    """Carries out this node's swap orders from the supervisor's loop (``tick``): stop the rank (or,
    for a host swap, every rank of this node) at its next commit, give its place to a waiting hot
    spare (or this node's place to a spare node), release the stopped processes."""

    def __init__(
        self,
        fence: StepFence,
        control: WorkerControl,
        in_process: InProcessRecovery,
        processes: Processes,
        telemetry: Telemetry,
        rdzv: RendezvousClient,
        monotonic: Callable[[], float],
    ) -> None:
        self._fence = fence
        self._control = control
        self._in_process = in_process
        self._processes = processes
        self._telemetry = telemetry
        self._rdzv = rdzv
        self._now = monotonic
        self._lock = threading.Lock()
        self._pending: dict[str, Any] | None = None
        self._asked: tuple[list[int], float] | None = None  # (pids, when) once the fence was asked

    def request(self, order: dict[str, Any]) -> None:
        """From the status thread; the newest order replaces one not started yet."""
        with self._lock:
            if self._asked is None:
                self._pending = order

    def tick(self, round_: Round) -> SwapOutcome:
        """One step of the pending order, if any."""
        with self._lock:
            order = self._pending
        if order is None:
            return SwapOutcome.NONE
        rank, host = int(order["rank"]), order.get("kind") == "host"
        alive = [w for w in round_.workers if w.poll() is None]
        targets = alive if host else [w for w in alive if w.spec.global_rank == rank]
        if not targets or rank not in {w.spec.global_rank for w in alive} or order.get("round") != round_.state.round:
            self._skip(rank, "the rank is no longer this node's in that generation")
            return SwapOutcome.NONE
        if self._asked is None:
            if not self._control.uses_api([w.pid for w in targets]):
                self._skip(rank, "the script commits no steps through resilrun: no step boundary to stop it at")
                return SwapOutcome.NONE
            for worker in targets:
                self._fence.ask(worker.pid)
            self._asked = ([w.pid for w in targets], self._now())
            return SwapOutcome.NONE
        pids, asked_at = self._asked
        step = self._closed_at(pids)
        if step is None:
            if self._now() - asked_at > FENCE_WAIT_S:
                self._skip(rank, f"no commit within {FENCE_WAIT_S:.0f} s")
            return SwapOutcome.NONE
        fenced_after_s, started = self._now() - asked_at, self._now()
        evidence = {"step": step, "round": round_.state.round, "fenced_after_s": _r6(fenced_after_s)}
        if host:
            new = self._rdzv.replace_nodes(round_.state.round, (self._rdzv.me.node_id,), failure=None, newest_step=step)
            if new.closed or new.round <= round_.state.round or new.node_rank(self._rdzv.me.node_id) is not None:
                self._skip(rank, "no spare node took this node's place, or the job moved on")
                return SwapOutcome.NONE
            self._release(targets)
            self._telemetry.nodes_replaced(new, [], straggler=(round_.node_rank, socket.gethostname()))
            swap_s = _r6(self._now() - started)
            self._telemetry.straggler(
                "swapped", rank, by="spare node", pids=pids, swap_s=swap_s, **{**evidence, "round": new.round}
            )
            logger.warning(
                "rank %d is a straggler: a spare node takes this node's place after step %d, generation %d; "
                "this node stands by",
                rank,
                step,
                new.round,
            )
            self._done()
            return SwapOutcome.LEFT
        (worker,) = targets
        if not self._in_process.swap(round_, worker, step):
            self._skip(rank, "no hot spare waits for a rank, or the job moved on")
            return SwapOutcome.NONE
        self._release(targets)
        spare = round_.workers[worker.spec.local_rank]
        self._telemetry.straggler(
            "swapped",
            rank,
            by="spare process",
            pid=worker.pid,
            spare_pid=spare.pid,
            swap_s=_r6(self._now() - started),
            **{**evidence, "round": round_.state.round},
        )
        self._done()
        return SwapOutcome.SWAPPED

    def _closed_at(self, pids: list[int]) -> int | None:
        """The step every one of ``pids`` is stopped after, once all are; None before.

        Ranks of one node commit the same steps, but not at the same instant: once one is stopped
        after step S, another that already committed S waits in step S+1's collectives for it and
        would never commit again, so it is stopped where it is (S is its newest commit)."""
        closed = [s for pid in pids if (s := self._fence.closed(pid)) is not None]
        if not closed:
            return None
        at = min(closed)
        for pid in pids:
            if self._fence.closed(pid) is None and (self._control.newest_step([pid]) or -1) >= at:
                self._fence.stop_now(pid, at)
        steps = [self._fence.closed(pid) for pid in pids]
        return None if any(s is None for s in steps) else min(s for s in steps if s is not None)

    def _release(self, workers: list[WorkerProcess]) -> None:
        """The stopped processes' places are taken: they go (a slow process is not kept as a spare)."""
        for worker in workers:
            self._fence.release(worker.pid, resume=False)
        self._processes.stop(workers, signal.SIGKILL, 0.0)
        for worker in workers:
            worker.finish_output()

    def _skip(self, rank: int, why: str) -> None:
        if self._asked is not None:
            for pid in self._asked[0]:
                self._fence.release(pid, resume=True)
        logger.warning("straggler rank %d not swapped: %s", rank, why)
        self._telemetry.straggler("swap_skipped", rank, reason=why)
        self._done()

    def _done(self) -> None:
        with self._lock:
            self._pending = None
            self._asked = None
