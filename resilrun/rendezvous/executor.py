"""Applies the pure rendezvous decisions against a backend, with deadlines.

Optimistic concurrency: read the state, decide, compare-and-set; a node that loses a race simply
reads the newer state and decides again. Every loop is bounded by the join deadline.

Reading at scale: the state is one document whose size grows with the node count, and every agent
polls it every monitor interval, so N agents re-reading it costs O(N^2) bytes per interval. With
``refresh_s`` set, a client polls a tiny version counter instead (bumped after every successful
write, always *after* the compare-and-set) and re-reads the document only when the counter moved,
or when ``refresh_s`` has passed: the safety net for a writer that died between its write and its
bump. A reader can therefore never keep a stale document past a bump it has seen. Where the store
can push the document itself (etcd's watch: ``RendezvousBackend.watch_key``) neither the poll nor
the safety net is needed: every write reaches the reader as it lands (with the O(N) bytes it
would have read anyway), a dead writer's included; the reader decodes a pushed document once,
and polls only while the watch is not current. A pushed document older than one this node has
read or written is the push lagging (its own write is on its way) or a replay: the reader then
asks the store, which tells the two apart (``_fresh``).

Joining at scale (the arrivals lane): N nodes each compare-and-setting themselves into the one
document race, and every lost race re-reads O(N) bytes: O(N^2) retries of O(N) bytes while a
large job forms. Instead a node joining an open round takes an index from a counter and writes
its NodeInfo under that index (O(1) each), and the first node not yet admitted reads every
arrival so far and admits them all in one write (``protocol.admit``), then raises the
``admitted`` hint; the others poll that hint (a few bytes) until it covers their index, and only
then read the document, which decides as before. Where the store pushes keys (etcd), a waiting
node follows the hint, and then the phase, by watch instead (``Joining``): N nodes polling them
asked the store about 2,000 reads per second, most of an etcd's CPU while a 1,024-node job
formed. Nothing depends on the lane for correctness: a
node the hint passes over without admitting it (a spare before its grace, an index whose value
was not written yet) writes itself as before, and a pending node whose admitter is gone admits
itself and everyone before it after ``_ADMIT_GRACE_S``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

from resilrun import keys
from resilrun.clock import Clock, SystemClock
from resilrun.errors import RendezvousClosedError, RendezvousTimeoutError
from resilrun.rendezvous import protocol
from resilrun.rendezvous.api import KeyView, RendezvousBackend
from resilrun.rendezvous.document import Documents
from resilrun.rendezvous.protocol import NodeInfo, RdzvState, Verdict

logger = logging.getLogger(__name__)

# Poll period while waiting for other nodes: short enough that a restart re-forms in well under a
# second, long enough that 1,000 waiting nodes do not flood the store.
_POLL_S = 0.05
# How long a spare node lets the previous round's nodes rejoin a newly opened round before it
# competes for a place: they poll every _POLL_S, so a second is plenty.
_SPARE_GRACE_S = 1.0
# How long a node waits in the arrivals lane for the first pending node to admit it before doing
# so itself (that node may have died between taking its index and admitting).
_ADMIT_GRACE_S = 1.0
# Arrivals one write admits at most (bounds one read; the rest go in the next write).
_ADMIT_BATCH = 4096
_HINT_ATTEMPTS = 16
# A node waiting on the lane or in an open round polls a few bytes; at scale it polls less often,
# so all N together ask the store for at most about 1/_POLL_PER_NODE_S operations per second
# until N passes _POLL_MAX_S/_POLL_PER_NODE_S (noticing the write it waits for up to that late).
_POLL_PER_NODE_S = 0.0005
_POLL_MAX_S = 0.5


def scaled_poll(nodes: int) -> float:
    """The poll period of a node waiting among ``nodes`` others."""
    return min(_POLL_MAX_S, max(_POLL_S, nodes * _POLL_PER_NODE_S))


class RendezvousClient:
    """One node's view of the job's rendezvous."""

    def __init__(
        self,
        backend: RendezvousBackend,
        run_id: str,
        me: NodeInfo,
        *,
        min_nodes: int,
        max_nodes: int,
        join_timeout: timedelta,
        last_call_timeout: timedelta,
        clock: Clock | None = None,
        refresh_s: float | None = None,
        arrivals: bool = True,
    ) -> None:
        """See the module docstring for ``refresh_s`` (None: read the whole document every time)
        and ``arrivals`` (the arrivals lane; False: every node compare-and-sets itself in)."""
        self.backend = backend
        self.run_id = run_id
        self.me = me
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.join_timeout = join_timeout
        self.last_call_timeout = last_call_timeout
        self.clock = clock or SystemClock()
        self._key = keys.rdzv_state(run_id)
        self.documents = Documents(backend, run_id)  # the head and its member lists (document.py)
        self._version_key = keys.rdzv_version(run_id)
        self.refresh_s = refresh_s
        self._watch: KeyView | None = None  # the document pushed, asked for at the first gated read
        self._watch_asked = False
        # (version, state, raw document, when it was read) of the last full read, when gated.
        self._cached: tuple[int, RdzvState, bytes | None, float] | None = None
        # (the pushed document it came from, state, raw document) of the last pushed read.
        self._pushed: tuple[bytes | None, RdzvState, bytes | None] | None = None
        # The newest document read or written (by seq) and its raw bytes: what a replayed older one
        # is replaced with.
        self._newest: tuple[RdzvState, bytes] | None = None
        self.replayed = 0  # replayed documents refused
        # Names the job in the document if this node writes it first (``RdzvState.job``).
        self._job = os.urandom(8).hex()
        self.arrivals = arrivals
        self._arrivals_key = keys.rdzv_arrivals(run_id)
        self._admitted_key = keys.rdzv_admitted(run_id)
        self._phase_key = keys.rdzv_phase(run_id)

    def prefer_rank(self, node_rank: int) -> None:
        """Ask for ``node_rank`` in the rounds this node joins from now on (the place it holds now:
        a restart then keeps each node where its state is)."""
        self.me = self.me._replace(preferred_rank=node_rank)

    # -- reads ----------------------------------------------------------------------------------
    def read(self, *, watch: bool = True) -> tuple[RdzvState, bytes | None]:
        """The current state and its raw bytes (the compare-and-set's expected value).

        ``watch``: where the store can push the document, open that watch at this read if not
        yet open. Joins pass False: N nodes forming a round would otherwise open N streams (and
        receive each admission's document) while the store is busiest; the watch opens at the
        first read after."""
        if self.refresh_s is None:
            return self._fresh(self.backend.get(self._key))
        pushed = self._pushed_document(watch)
        if pushed is not None:
            return self._from_push(pushed[0])
        version = self.backend.add(self._version_key, 0)
        now = self.clock.monotonic()
        cached = self._cached
        if cached is not None and cached[0] == version and now - cached[3] < self.refresh_s:
            return cached[1], cached[2]
        state, raw = self._fresh(self.backend.get(self._key))
        self._cached = (version, state, raw, now)
        return state, raw

    def _pushed_document(self, watch: bool) -> tuple[bytes | None, float] | None:
        if watch and self._watch is None and not self._watch_asked:
            self._watch_asked = True
            self._watch = self.backend.watch_key(self._key)
        return self._watch.seen() if self._watch is not None else None

    def _from_push(self, document: bytes | None) -> tuple[RdzvState, bytes | None]:
        last = self._pushed
        if last is not None and (last[0] is document or last[0] == document):
            return last[1], last[2]
        state = self.documents.decode(document)
        newest = self._newest
        if newest is not None and (state.seq < newest[0].seq or state.job != newest[0].job):
            state, raw = self._fresh(self.backend.get(self._key))  # lagging, or replayed: ask
        else:
            state, raw = self._fresh(document, state)
        self._pushed = (document, state, raw)
        return state, raw

    @property
    def document_watched(self) -> bool:
        """Whether the store pushes this client's document (once it was first read)."""
        return self._watch is not None

    def _fresh(self, raw: bytes | None, state: RdzvState | None = None) -> tuple[RdzvState, bytes | None]:
        """The document read (``state``: already decoded), unless it is older than one this node
        saw (every write bumps ``seq``) or names another job (an earlier run under this id and
        secret): a replay, which is refused, said, and replaced in the store by the newest one."""
        if state is None:
            state = self.documents.decode(raw)
        newest = self._newest
        if newest is None or (state.seq >= newest[0].seq and state.job == newest[0].job):
            if raw is not None:
                self._newest = (state, raw)
            return state, raw
        self.replayed += 1
        if raw is None:  # deleted, or forged (the sealed store reads a forgery as absent)
            logger.warning(
                "the rendezvous document is gone or forged: putting back the newest one this node read (seq %d)",
                newest[0].seq,
            )
        elif state.job != newest[0].job:
            logger.warning(
                "refused a rendezvous document of another job under this --rdzv-id (seq %d, round %d%s): "
                "someone with access to the store wrote back one of an earlier run",
                state.seq,
                state.round,
                f", closed: {state.outcome}" if state.closed else "",
            )
        else:
            logger.warning(
                "refused a replayed rendezvous document (seq %d, round %d): this node has read seq %d (round %d); "
                "someone with access to the store wrote back an old one",
                state.seq,
                state.round,
                newest[0].seq,
                newest[0].round,
            )
        if self.backend.compare_set(self._key, raw, newest[1]) and self.refresh_s is not None:
            self.backend.add(self._version_key, 1)
            self.backend.add(self._phase_key, 1)
        return newest[0], newest[1]

    def _write(self, raw: bytes | None, proposed: RdzvState) -> bool:
        """Compare-and-set the document (its ``seq`` one past the one replaced); on success bump
        the version so gated readers re-read it, and the phase when a node waiting in an open
        round must look again (``Joining``: it reads the document only then)."""
        replaced = self._newest[0] if self._newest is not None and self._newest[1] == raw else None
        if replaced is None:
            replaced = self.documents.decode(raw)
        proposed = replace(proposed, seq=replaced.seq + 1, job=replaced.job or self._job)
        document = self.documents.encode(proposed, raw)
        written = self.backend.compare_set(self._key, raw, document)
        if written:
            self._newest = (proposed, document)
        if self.refresh_s is not None:
            self._cached = self._pushed = None  # ours or a newer one: read it afresh either way
            if written:
                self.backend.add(self._version_key, 1)
                if self._phase_moved(replaced, proposed):
                    self.backend.add(self._phase_key, 1)
        return written

    def _phase_moved(self, before: RdzvState, after: RdzvState) -> bool:
        """What a participant waiting in an open round acts on: the round, its completion or
        close, a node gone from it, and the participants reaching the minimum (its last call)."""
        if (before.round, before.complete, before.closed) != (after.round, after.complete, after.closed):
            return True
        if len(after.participants) < len(before.participants):
            return True
        return len(before.participants) < self.min_nodes <= len(after.participants)

    def _phase(self) -> int:
        return self.backend.add(self._phase_key, 0)

    def state(self) -> RdzvState:
        return self.read()[0]

    # -- writes ---------------------------------------------------------------------------------
    def _update(self, decide: Callable[[RdzvState], RdzvState | None]) -> RdzvState:
        """Apply ``decide`` until it returns None or our write lands; returns the final state."""
        while True:
            state, raw = self.read()
            proposed = decide(state)
            if proposed is None:
                return state
            if self._write(raw, proposed):
                assert self._newest is not None
                return self._newest[0]  # as written: its seq bumped

    def join(self, on_wait: Callable[[], None] | None = None) -> RdzvState:
        """Block until this node is a participant of a complete round, or a spare node of a full one.

        Args:
            on_wait: called on every poll (e.g. to check for a shutdown request).

        Raises:
            RendezvousClosedError: the job was closed while waiting.
            RendezvousTimeoutError: not enough nodes joined before the join deadline.
        """
        attempt = Joining(self)
        try:
            while True:
                state = attempt.step()
                if state is not None:
                    return state
                if attempt.waits:
                    if on_wait is not None:
                        on_wait()
                    self.clock.sleep(attempt.poll_s)
        finally:
            attempt.close()

    # -- the arrivals lane (see the module docstring) ----------------------------------------------
    def _arrive(self) -> int:
        """Take an index in the lane and publish this node under it; returns the index."""
        index = self.backend.add(self._arrivals_key, 1)
        self.backend.set(keys.rdzv_arrival(self.run_id, index), json.dumps(self.me._asdict()).encode())
        return index

    def _admitted(self) -> int:
        raw = self.backend.get(self._admitted_key)
        try:
            return int(raw) if raw is not None else 0
        except ValueError:
            return 0

    def _admit(self, admitted: int) -> None:
        """Admit every arrival after ``admitted`` (the hint; the document's own count when further)
        in one write, recording how far it went, then raise the hint past them."""
        state, raw = self._fresh(self.backend.get(self._key))
        admitted = max(admitted, state.admitted)
        count = min(self.backend.add(self._arrivals_key, 0), admitted + _ADMIT_BATCH)
        if count <= admitted:
            self._raise_hint(admitted)
            return
        arrivals = []
        wanted = [keys.rdzv_arrival(self.run_id, i) for i in range(admitted + 1, count + 1)]
        for value in self.backend.get_many(wanted):
            if value is None:
                continue  # not written yet (or forged): that node writes itself in once passed over
            try:
                arrivals.append(NodeInfo(**json.loads(value)))
            except (ValueError, TypeError):
                continue
        proposed = protocol.admit(state, arrivals, min_nodes=self.min_nodes, max_nodes=self.max_nodes)
        if proposed is not None and not self._write(raw, replace(proposed, admitted=count)):
            return  # the document moved meanwhile: the next pass admits against the newer one
        self._raise_hint(count)

    def _raise_hint(self, count: int) -> None:
        for _ in range(_HINT_ATTEMPTS):  # bounded: a party rewriting the hint only delays (grace)
            current = self.backend.get(self._admitted_key)
            try:
                if current is not None and int(current) >= count:
                    return
            except ValueError:
                pass
            if self.backend.compare_set(self._admitted_key, current, str(count).encode()):
                return

    def next_round(self, observed_round: int, *, failure: dict[str, Any] | None, max_restarts: int) -> RdzvState:
        """Open the next round (or close the job as failed when no restart is left).

        Every arrival taken so far was for an earlier round: the new round's document says so, so
        no admitter reads them again (the ``admitted`` hint alone can be wiped by anyone)."""
        lane = self.backend.add(self._arrivals_key, 0) if self.arrivals else 0

        def decide(state: RdzvState) -> RdzvState | None:
            opened = protocol.decide_next_round(state, observed_round, failure=failure, max_restarts=max_restarts)
            return opened if opened is None or opened.closed else replace(opened, admitted=max(opened.admitted, lane))

        return self._update(decide)

    def recover(self, observed_round: int, *, failure: dict[str, Any] | None, newest_step: int = -1) -> RdzvState:
        """Open the next generation for an in-process recovery (no-op if the job moved on, or if the
        in-process budget is spent: ``protocol.recovery_budget_spent``)."""
        return self._update(lambda s: protocol.decide_recover(s, observed_round, failure, newest_step))

    def replace_nodes(
        self, observed_round: int, lost: tuple[str, ...], *, failure: dict[str, Any] | None, newest_step: int = -1
    ) -> RdzvState:
        """Open the next generation with spare nodes in place of ``lost`` (no-op if impossible)."""
        return self._update(lambda s: protocol.decide_replace(s, observed_round, lost, failure, newest_step))

    def drop_spares(self, gone: tuple[str, ...]) -> RdzvState:
        return self._update(lambda s: protocol.decide_drop_spares(s, gone))

    def leave(self) -> RdzvState:
        """Stop waiting or standing by (a participant of a complete round is unaffected)."""
        return self._update(lambda s: protocol.decide_leave(s, self.me.node_id))

    def close(self, outcome: str, failure: dict[str, Any] | None = None) -> RdzvState:
        return self._update(lambda s: protocol.decide_close(s, outcome, failure))

    def ack_closed(self) -> int:
        return self.backend.add(keys.job_closed_ack(self.run_id), 1)

    def closed_acks(self) -> int:
        return self.backend.add(keys.job_closed_ack(self.run_id), 0)


class Joining:
    """One node's attempt to join, one step at a time: ``join`` loops over it, and a simulator of
    many nodes (benchmarks/control_plane_scale.py) schedules the steps of thousands on a few threads."""

    def __init__(self, client: RendezvousClient) -> None:
        self.client = client
        self.deadline = client.clock.monotonic() + client.join_timeout.total_seconds()
        self.min_seen: tuple[int, float] | None = None  # (round, when MIN nodes were first seen)
        self.open_seen: tuple[int, float] | None = None  # (round, when it was first seen open)
        self.arrival: tuple[int, float] | None = None  # (index in the arrivals lane, when taken) while pending
        self.lane_used = False  # once admitted or passed over, this attempt writes itself in as before
        self.waits = False  # whether the last step asks to poll again after ``poll_s`` (else at once)
        self.poll_s = _POLL_S
        # (phase, when read, state, raw) while this node waits as a participant of an open round:
        # the document is read again only when the phase moves (or refresh_s passed).
        self.settled: tuple[int, float, RdzvState, bytes | None] | None = None
        # The counter this node waits on, as the store pushes it (key, its view; the view None
        # where the store pushes nothing): the admitted hint in the lane, then the phase.
        self._followed: tuple[str, KeyView | None] | None = None

    def close(self) -> None:
        """Stop following the counter waited on (``step`` follows it again if called again)."""
        followed, self._followed = self._followed, None
        if followed is not None and followed[1] is not None:
            followed[1].close()

    def _count(self, key: str, read: Callable[[], int], watch: Callable[[str], KeyView | None]) -> int:
        """The number at ``key``: as pushed (``watch``) while the push is current, else ``read``
        from the store. One key is followed at a time: the hint is let go once the phase is waited on."""
        if self._followed is None or self._followed[0] != key:
            self.close()
            self._followed = (key, watch(key))
        view = self._followed[1]
        seen = view.seen() if view is not None else None
        if seen is None:
            return read()
        try:
            return int(seen[0]) if seen[0] is not None else 0
        except ValueError:
            return read()

    def step(self) -> RdzvState | None:
        """The state once joined (a participant of a complete round, or a spare node of a full
        one), else None: call again, after ``poll_s`` when ``waits``.

        Raises:
            RendezvousClosedError: the job was closed while waiting.
            RendezvousTimeoutError: not enough nodes joined before the join deadline.
        """
        rdzv = self.client
        self.waits, self.poll_s = False, _POLL_S
        if self.arrival is not None:
            now = rdzv.clock.monotonic()
            admitted = self._count(rdzv._admitted_key, rdzv._admitted, rdzv.backend.watch_key)  # sealed
            if self.arrival[0] - admitted > _ADMIT_BATCH:
                # No admit pass (one batch) could reach it: the counter was bumped by someone at
                # the store, or the hint wiped. The lane only saves writes: join as without it.
                self.arrival = None
            elif admitted < self.arrival[0] and now < self.deadline:
                if self.arrival[0] == admitted + 1 or now - self.arrival[1] >= _ADMIT_GRACE_S:
                    rdzv._admit(admitted)
                else:
                    self.waits, self.poll_s = True, scaled_poll(self.arrival[0])
                return None
            self.arrival = None
        elif rdzv.arrivals and not self.lane_used:
            # Straight into the lane, without reading the document first: the admitter makes the
            # move this node would (a place, the wait list, the spares), and at 1,024 nodes a read
            # here was a third of the document decodes of a rendezvous.
            self.lane_used = True
            self.arrival = (rdzv._arrive(), rdzv.clock.monotonic())
            return None
        phase, state, raw = self._read()
        now = rdzv.clock.monotonic()
        if protocol.has_reached_min(state, rdzv.me.node_id, rdzv.min_nodes):
            if self.min_seen is None or self.min_seen[0] != state.round:
                self.min_seen = (state.round, now)
        else:
            self.min_seen = None
        elapsed = self.min_seen is not None and now - self.min_seen[1] >= rdzv.last_call_timeout.total_seconds()
        if not state.complete and (self.open_seen is None or self.open_seen[0] != state.round):
            self.open_seen = (state.round, now)
        grace = self.open_seen is not None and now - self.open_seen[1] >= _SPARE_GRACE_S
        decision = protocol.decide_join(
            state,
            rdzv.me,
            min_nodes=rdzv.min_nodes,
            max_nodes=rdzv.max_nodes,
            last_call_elapsed=elapsed,
            spare_grace_elapsed=grace,
        )
        if decision.verdict in (Verdict.FINISH, Verdict.SPARE):
            return state
        if decision.verdict is Verdict.CLOSED:
            raise closed_error(state)
        before, self.settled = self.settled, None
        if decision.verdict is Verdict.UPDATE and decision.state is not None:
            rdzv._write(raw, decision.state)
            return None
        if phase is not None and not state.complete and state.has_participant(rdzv.me.node_id):
            read_at = before[1] if before is not None and before[2] is state else now
            self.settled = (phase, read_at, state, raw)
            self.poll_s = scaled_poll(len(state.participants))
        if now >= self.deadline:
            rdzv._update(lambda s: protocol.decide_leave(s, rdzv.me.node_id))
            joined = len(state.participants)
            raise RendezvousTimeoutError(
                f"only {joined} of {rdzv.min_nodes} required nodes joined round {state.round} "
                f"within {rdzv.join_timeout.total_seconds():g} s",
                hint="start resilrun on every node with the same --rdzv-endpoint and --rdzv-id, "
                "or raise --rdzv-conf join_timeout=SECONDS",
            )
        self.waits = True
        return None

    def _read(self) -> tuple[int | None, RdzvState, bytes | None]:
        """The phase (None: ungated) and the document: the one read before while the phase has
        not moved since and this node waits in an open round, else a fresh one."""
        rdzv = self.client
        if rdzv.refresh_s is None:
            return None, *rdzv.read(watch=False)
        # Before the document: a write after this read moves it again.
        phase = self._count(rdzv._phase_key, rdzv._phase, rdzv.backend.watch_counter)
        settled = self.settled
        if settled is not None and settled[0] == phase and rdzv.clock.monotonic() - settled[1] < rdzv.refresh_s:
            return phase, settled[2], settled[3]
        return phase, *rdzv.read(watch=False)


def closed_error(state: RdzvState) -> RendezvousClosedError:
    outcome = state.outcome or "stopped"
    return RendezvousClosedError(f"the job was closed by another node ({outcome})", outcome=outcome)
