"""Applies the pure rendezvous decisions against a backend, with deadlines.

Optimistic concurrency: read the state, decide, compare-and-set; a node that loses a race simply
reads the newer state and decides again. Every loop is bounded by the join deadline.

Reading at scale: the state is one document whose size grows with the node count, and every agent
polls it every monitor interval, so N agents re-reading it costs O(N^2) bytes per interval. With
``refresh_s`` set, a client polls a tiny version counter instead (bumped after every successful
write, always *after* the compare-and-set) and re-reads the document only when the counter moved,
or when ``refresh_s`` has passed: the safety net for a writer that died between its write and its
bump. A reader can therefore never keep a stale document past a bump it has seen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

from resilrun import keys
from resilrun.clock import Clock, SystemClock
from resilrun.errors import RendezvousClosedError, RendezvousTimeoutError
from resilrun.rendezvous import protocol
from resilrun.rendezvous.api import RendezvousBackend
from resilrun.rendezvous.protocol import NodeInfo, RdzvState, Verdict

logger = logging.getLogger(__name__)

# Poll period while waiting for other nodes: short enough that a restart re-forms in well under a
# second, long enough that 1,000 waiting nodes do not flood the store.
_POLL_S = 0.05
# How long a spare node lets the previous round's nodes rejoin a newly opened round before it
# competes for a place: they poll every _POLL_S, so a second is plenty.
_SPARE_GRACE_S = 1.0


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
    ) -> None:
        """See the module docstring for ``refresh_s`` (None: read the whole document every time)."""
        self.backend = backend
        self.run_id = run_id
        self.me = me
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.join_timeout = join_timeout
        self.last_call_timeout = last_call_timeout
        self.clock = clock or SystemClock()
        self._key = keys.rdzv_state(run_id)
        self._version_key = keys.rdzv_version(run_id)
        self.refresh_s = refresh_s
        # (version, state, raw document, when it was read) of the last full read, when gated.
        self._cached: tuple[int, RdzvState, bytes | None, float] | None = None
        # The newest document read or written (by seq) and its raw bytes: what a replayed older one
        # is replaced with.
        self._newest: tuple[RdzvState, bytes] | None = None
        self.replayed = 0  # replayed documents refused

    # -- reads ----------------------------------------------------------------------------------
    def read(self) -> tuple[RdzvState, bytes | None]:
        """The current state and its raw bytes (the compare-and-set's expected value)."""
        if self.refresh_s is None:
            return self._fresh(self.backend.get(self._key))
        version = self.backend.add(self._version_key, 0)
        now = self.clock.monotonic()
        cached = self._cached
        if cached is not None and cached[0] == version and now - cached[3] < self.refresh_s:
            return cached[1], cached[2]
        state, raw = self._fresh(self.backend.get(self._key))
        self._cached = (version, state, raw, now)
        return state, raw

    def _fresh(self, raw: bytes | None) -> tuple[RdzvState, bytes | None]:
        """The document read, unless it is older than one this node saw: a replay (every write
        bumps ``seq``), which is refused, said, and replaced in the store by the newest one."""
        state = RdzvState.from_bytes(raw)
        newest = self._newest
        if newest is None or state.seq >= newest[0].seq:
            if raw is not None:
                self._newest = (state, raw)
            return state, raw
        self.replayed += 1
        if raw is None:  # deleted, or forged (the sealed store reads a forgery as absent)
            logger.warning(
                "the rendezvous document is gone or forged: putting back the newest one this node read (seq %d)",
                newest[0].seq,
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
        return newest[0], newest[1]

    def _write(self, raw: bytes | None, proposed: RdzvState) -> bool:
        """Compare-and-set the document (its ``seq`` one past the one replaced); on success bump
        the version so gated readers re-read it."""
        current = self._newest[0].seq if self._newest is not None and self._newest[1] == raw else None
        if current is None:
            current = RdzvState.from_bytes(raw).seq
        proposed = replace(proposed, seq=current + 1)
        document = proposed.to_bytes()
        written = self.backend.compare_set(self._key, raw, document)
        if written:
            self._newest = (proposed, document)
        if self.refresh_s is not None:
            self._cached = None  # ours or a newer one: read it afresh either way
            if written:
                self.backend.add(self._version_key, 1)
        return written

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
        deadline = self.clock.monotonic() + self.join_timeout.total_seconds()
        min_seen: tuple[int, float] | None = None  # (round, when MIN nodes were first seen)
        open_seen: tuple[int, float] | None = None  # (round, when it was first seen open)
        while True:
            state, raw = self.read()
            now = self.clock.monotonic()
            if protocol.has_reached_min(state, self.me.node_id, self.min_nodes):
                if min_seen is None or min_seen[0] != state.round:
                    min_seen = (state.round, now)
            else:
                min_seen = None
            elapsed = min_seen is not None and now - min_seen[1] >= self.last_call_timeout.total_seconds()
            if not state.complete and (open_seen is None or open_seen[0] != state.round):
                open_seen = (state.round, now)
            grace = open_seen is not None and now - open_seen[1] >= _SPARE_GRACE_S
            decision = protocol.decide_join(
                state,
                self.me,
                min_nodes=self.min_nodes,
                max_nodes=self.max_nodes,
                last_call_elapsed=elapsed,
                spare_grace_elapsed=grace,
            )
            if decision.verdict in (Verdict.FINISH, Verdict.SPARE):
                return state
            if decision.verdict is Verdict.CLOSED:
                raise closed_error(state)
            if decision.verdict is Verdict.UPDATE and decision.state is not None:
                self._write(raw, decision.state)
                continue
            if now >= deadline:
                self._update(lambda s: protocol.decide_leave(s, self.me.node_id))
                joined = len(state.participants)
                raise RendezvousTimeoutError(
                    f"only {joined} of {self.min_nodes} required nodes joined round {state.round} "
                    f"within {self.join_timeout.total_seconds():g} s",
                    hint="start resilrun on every node with the same --rdzv-endpoint and --rdzv-id, "
                    "or raise --rdzv-conf join_timeout=SECONDS",
                )
            if on_wait is not None:
                on_wait()
            self.clock.sleep(_POLL_S)

    def next_round(self, observed_round: int, *, failure: dict[str, Any] | None, max_restarts: int) -> RdzvState:
        """Open the next round (or close the job as failed when no restart is left)."""
        return self._update(
            lambda s: protocol.decide_next_round(s, observed_round, failure=failure, max_restarts=max_restarts)
        )

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


def closed_error(state: RdzvState) -> RendezvousClosedError:
    outcome = state.outcome or "stopped"
    return RendezvousClosedError(f"the job was closed by another node ({outcome})", outcome=outcome)
