"""The agent's Replicator: each local rank's newest committed snapshot, to the next k nodes.

Invariants: replication never delays a commit (the commit listener records "rank r has a new step"
and returns), and it bounds how far training runs ahead of it: the answer to a worker's commit of
step s waits (the commit gate) until s is on every target that keeps up, and a worker reads that
answer before it writes step s+1, so a replica lags at most one step behind its rank's newest
commit; the survivors of a node loss keep three steps (tiers/slots.py), which covers that lag.
This costs training time only when a push takes longer than a step; a target that fails is not
waited for until a push to it succeeds again, nor one that the gate gave up on because it was far
slower than its own usual pace (``GATE_FACTOR``: a lost segment, a cut link) until a push at that
pace lands: while either lasts its replicas may lag more than a step (``status``, the events'
``replica_behind``), so a node loss then may resume from an older step or tier. The Replicator sends
the newest commit of each rank, skipping steps only when it fell behind; the bytes it sends are
exactly one committed step, checked against the crc32s the commit recorded (a slot rewritten
meanwhile is aborted, never sent as complete; the sequence counter only ends such a push early) and
leased so a reallocation cannot unmap them mid-stream; a slow or dead peer makes replicas lag, each
peer on its own thread, and is logged once per change. At each peer, a rank is not pushed while it
is ahead there of another rank this node runs in the generation it follows (``_in_step``): a peer
keeps two steps per rank, so it then always holds one step of every such rank.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import timedelta

from resilrun.errors import CheckpointCorruptError
from resilrun.snapshot.shm import SharedBuffer
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer.client import DEFAULT_TIMEOUT, push_view
from resilrun.tiers.peer.wire import (
    Announce,
    Credential,
    Deadline,
    ReplicationError,
    check_secret,
    parse_address,
    snapshot_bounds,
)
from resilrun.tiers.priority import yield_to_training
from resilrun.tiers.slots import Committed, RankMemory, crcs_at

logger = logging.getLogger(__name__)

# A peer slower than this is treated as failing: at 50 MB/s a 256 MB replica already lags seconds.
_MIN_RATE_BYTES_S = 50e6


# -- the Replicator ---------------------------------------------------------------------------------
# After a failure, wait this long before trying the peer again, doubling up to the max: a dead peer
# costs one connection attempt every few seconds, and a recovered one is back within that time.
_RETRY_MIN_S = 0.1
_RETRY_MAX_S = 5.0
# A stream torn by the worker's next write means the peer is slower than about one step; the next
# pushes then go through a private copy (a memcpy, checked by the seqlock) that no write can tear.
_STAGED_PUSHES = 8
# Idle waits wake this often anyway (close() notifies; this is a backstop, not a poll).
_IDLE_WAIT_S = 1.0
# The commit gate waits this long at most for a deduplicated snapshot to become complete: it borrows
# bytes from local ranks that commit the same step within milliseconds unless they are failing.
_COMPLETE_WAIT_S = 1.0
# and this long at most in all: well inside the worker's channel timeout (worker/agent_client.py), so a
# push slower than this lets the replica fall behind by more than a step instead of failing the worker.
GATE_MAX_S = 30.0
# Once a few pushes have been timed, the gate waits for a peer at most this many times what the
# newest steps should take at the peer's usual pace (its median seconds per byte), and never less
# than the rank's usual commit period (about a step) nor GATE_MIN_S: a peer as slow as it always
# is keeps setting the pace (replicas then lag one step at most, as the user asked for), while one
# slower than itself (a lost segment, a lost SYN, a cut link) costs training about a step, not the
# push's deadline. The factor sits above the scatter of push times on a busy host.
GATE_FACTOR = 4.0
GATE_MIN_S = 0.02
_LEARN_AFTER = 4  # timed pushes before the gate trusts them
_HISTORY = 32  # pushes and commit periods remembered


@dataclass(frozen=True, slots=True)
class _Source:
    """A commit as the listener saw it: the slot's sequence counter then identifies its bytes."""

    rank: int
    committed: Committed
    seq: int
    generation: int  # per-rank count of commits, so a re-commit of an older step still counts as new


class _Target:
    """Replication to one peer, on its own thread so that a slow peer delays no other."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.acked: dict[int, int] = {}  # rank -> newest step the peer confirmed
        self.acked_at: dict[int, tuple[int, int]] = {}  # rank -> (generation trained in, step) of it
        self.done: dict[int, int] = {}  # rank -> generation last handled (replicated or skipped)
        self.healthy: bool | None = None
        # Slower than its usual pace: the gate gave up on it; not waited for until a push at its
        # usual pace lands (an outage shorter than a failure, which ``healthy`` records).
        self.lagging = False
        self.stopped = False
        self.retry_at = 0.0
        self.failures = 0
        self.staged = 0
        self.staging = bytearray()
        self.last_rank = -1
        self.sock: socket.socket | None = None
        self.thread: threading.Thread | None = None


def _position(target: _Target, rank: int) -> tuple[int, int, int]:
    """How far ``rank``'s replicas at ``target`` are (ordered; lowest while it confirmed none)."""
    at = target.acked_at.get(rank)
    return (0, 0, 0) if at is None else (1, *at)


def _keeps_up(target: _Target) -> bool:
    """Whether the commit gate waits for ``target`` (what the health reports tell)."""
    return target.healthy is not False and not target.lagging


class Replicator:
    """Replicates every local rank's newest committed step to the peers ``targets()`` names."""

    def __init__(
        self,
        memory: NodeMemoryTier,
        secret: Credential,
        targets: Callable[[], list[str]],
        *,
        world_size: Callable[[], int | None] | None = None,
        generation: Callable[[], int] | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        refresh: timedelta = timedelta(seconds=1),
        on_replicated: Callable[[int, int, int, float], None] | None = None,
        push_delay_s: float = 0.0,
        every: int = 1,
        on_health: Callable[[str, bool, str], None] | None = None,
        on_dropped: Callable[[str], None] | None = None,
        local_ranks: Callable[[], Collection[int]] | None = None,
    ) -> None:
        """Start replicating what ``on_commit`` is given (node memory's announcements, wired by
        whoever composes them: the agent's commit pipeline); ``hold_commit`` is the commit gate
        that bounds the replicas' lag (see the module), for the same owner to install.

        Args:
            targets: peer addresses (``host:port``), asked every ``refresh``; the lead's "next k nodes".
            world_size: recorded with each replica; None sends "unknown".
            generation: the generation this node follows, sent with each push as its fencing token
                (see ``ReplicaServer``); None sends "unknown".
            timeout: per push, on top of the transfer's allowance at 50 MB/s.
            on_replicated: ``(rank, step, bytes, seconds)`` after each confirmed push (metrics).
            on_health: ``(peer, keeps_up, why)`` when a peer starts failing (its replicas fall
                behind and the commit gate stops waiting for it) and when it catches up again
                (the events); called outside the replicator's lock.
            on_dropped: ``(peer)`` when a peer told behind stops being a target (the peers were
                chosen again: a lost node's replacement), so that it is not reported behind for
                ever; called outside the replicator's lock.
            local_ranks: the global ranks this node runs in the generation it follows (a rank that
                left it holds no other back: ``_in_step``); None: every rank that committed here.
            push_delay_s: a fault hook for tests: each push waits this long before its bytes.
            every: replicate the first snapshot at or past each multiple of this many steps
                (``--replicate-every``; ``Committed.crosses``), the same steps on every node; a
                commit that says whether to replicate (``--replicate-every auto``) is obeyed instead.
        """
        check_secret(secret)
        self._memory = memory
        self._secret = secret
        self._targets_fn = targets
        self._world_size = world_size
        self._generation = generation
        self._timeout = timeout.total_seconds()
        self._refresh = refresh.total_seconds()
        self._on_replicated = on_replicated
        self._on_health = on_health
        self._on_dropped = on_dropped
        self._local_ranks = local_ranks
        self._cond = threading.Condition()
        # Health and drop reports go out one at a time, outside the condition: a target's thread
        # that decided to report a failure just before its peer was dropped must not report it
        # after the drop (the peer would then stay "behind" until the job ends).
        self._tell_lock = threading.Lock()
        self._latest: dict[int, _Source] = {}
        self._rank_memory: dict[int, RankMemory] = {}
        self._targets: dict[str, _Target] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._targets_broken = False
        self._push_delay_s = push_delay_s
        self._held_s: dict[int, float] = {}  # rank -> seconds its commits waited at the gate
        self._every = max(1, every)
        self._skipped: dict[int, int] = {}  # rank -> its newest step left out by ``every``
        self._pace: deque[float] = deque(maxlen=_HISTORY)  # seconds per byte of recent pushes
        self._periods: dict[int, deque[float]] = {}  # rank -> seconds between its recent commits
        self._gated_at: dict[int, float] = {}  # rank -> when its newest commit reached the gate
        self._manager = threading.Thread(target=self._manage, name="resilrun-replicator", daemon=True)
        self._manager.start()

    def on_commit(self, rank: int, committed: Committed) -> None:
        """Node memory's announcement of a complete snapshot (the commit pipeline registers it)."""
        # On the worker's commit, before its ack: the slot's counter is stable now and stays so until
        # the worker writes this slot again, so it identifies these bytes. O(1), no I/O, brief lock.
        if self._closed:
            return
        if not committed.replicated(self._every):
            with self._cond:
                self._skipped[rank] = committed.step  # its commit gate opens at once
                self._cond.notify_all()
            return
        rank_memory = self._rank_memory.get(rank)
        if rank_memory is None:
            rank_memory = self._rank_memory[rank] = self._memory.rank(rank)
        seq = rank_memory.seq.read(committed.slot)
        with self._cond:
            previous = self._latest.get(rank)
            generation = 1 if previous is None else previous.generation + 1
            self._latest[rank] = _Source(rank, committed, seq, generation)
            self._cond.notify_all()

    def hold_commit(self, rank: int, step: int) -> float:
        """The commit gate: wait until ``rank``'s ``step`` is on every target that keeps up.

        Returns the seconds waited. Not waited for: a target failing (until a push to it succeeds)
        or lagging (until a push at its usual pace lands), stopped (the round moved on), or a step
        that did not become complete (a failing owner). Bounded by the time pushing every local
        rank's newest step may take: learned from the pushes timed so far (see GATE_FACTOR), a
        target still pushing at the end then counting as lagging; before that, the push deadline.
        """
        started = time.monotonic()
        slowed: list[tuple[_Target, str]] = []
        with self._cond:
            self._note_period(rank, started)
            total = sum(s.committed.nbytes for s in self._latest.values())
            budget = min(self._timeout + total / _MIN_RATE_BYTES_S, GATE_MAX_S)
            learned = self._learned_budget(rank, total)
            if learned is not None:
                budget = min(budget, learned)
            end, complete_by = started + budget, started + _COMPLETE_WAIT_S
            while not self._closed:
                now = time.monotonic()
                source = self._latest.get(rank)
                if self._skipped.get(rank) == step:
                    break  # a step the replica interval leaves out: nothing to wait for
                pushing = None
                if source is None or source.committed.step < step:
                    wait_until = min(end, complete_by)
                elif any(self._holds_back(t, source, now) for t in self._targets.values()):
                    wait_until, pushing = end, source
                else:
                    break
                if now >= wait_until:
                    if pushing is not None and learned is not None:
                        slowed = self._lagging(pushing, now, budget)
                    break
                self._cond.wait(wait_until - now)
            waited = time.monotonic() - started
            self._held_s[rank] = self._held_s.get(rank, 0.0) + waited
        for target, why in slowed:
            self._tell_health(target, False, why)
        return waited

    def _note_period(self, rank: int, now: float) -> None:
        """Time this rank's commits (cond held): the gate's floor is about one of its steps."""
        previous = self._gated_at.get(rank)
        self._gated_at[rank] = now
        if previous is not None:
            self._periods.setdefault(rank, deque(maxlen=_HISTORY)).append(now - previous)

    def _learned_budget(self, rank: int, total_bytes: int) -> float | None:
        """How long the gate waits for ``rank``'s step, from the pushes timed so far (cond held);
        None until there are enough of them."""
        if len(self._pace) < _LEARN_AFTER:
            return None
        usual = GATE_FACTOR * statistics.median(self._pace) * total_bytes
        periods = self._periods.get(rank)
        period = statistics.median(periods) if periods else 0.0
        return max(usual, period, GATE_MIN_S)

    def _lagging(self, source: _Source, now: float, budget: float) -> list[tuple[_Target, str]]:
        """Mark the targets the gate gave up on as lagging (cond held); those newly behind, with why."""
        newly = []
        for target in self._targets.values():
            # A push held back for another local rank's late commit (``_in_step``) is not the peer's doing.
            if self._holds_back(target, source, now) and self._in_step(target, source):
                target.lagging = True
                step = source.committed.step
                why = f"slower than training: rank {source.rank}'s step {step} not there after {budget * 1000:.0f} ms"
                logger.info(
                    "replication to %s %s; the commit gate stops waiting for it until it keeps up", target.address, why
                )
                newly.append((target, why))
        return newly

    @staticmethod
    def _holds_back(target: _Target, source: _Source, now: float) -> bool:
        """Whether ``target`` has yet to handle ``source`` and is one that training waits for (cond held)."""
        if target.stopped or target.healthy is False or target.lagging or target.retry_at > now:
            return False
        return target.done.get(source.rank, 0) < source.generation

    # -- targets ------------------------------------------------------------------------------------
    def _manage(self) -> None:
        while True:
            wanted = self._wanted_targets()
            with self._cond:
                if self._closed:
                    return
                dropped = self._reconcile(wanted) if wanted is not None else []
                until = time.monotonic() + self._refresh
            for address in dropped:
                self._tell_dropped(address)
            with self._cond:
                while not self._closed and (left := until - time.monotonic()) > 0:
                    self._cond.wait(left)

    def _wanted_targets(self) -> list[str] | None:
        try:
            wanted = list(dict.fromkeys(self._targets_fn()))
            for address in wanted:
                parse_address(address)
        except Exception as exc:  # the lead's callable: whatever it raises, keep the replicas we have going
            if not self._targets_broken:
                logger.warning("replica targets unavailable (%s); keeping the current ones", exc)
            self._targets_broken = True
            return None
        self._targets_broken = False
        return wanted

    def _reconcile(self, wanted: list[str]) -> list[str]:
        """Start replicating to the new targets and stop the others; returns the stopped ones that
        had been told behind (they are to be told dropped, outside the lock)."""
        dropped = []
        for address in [a for a in self._targets if a not in wanted]:
            target = self._targets.pop(address)
            target.stopped = True
            if not _keeps_up(target):
                dropped.append(address)
        for address in wanted:
            if address not in self._targets:
                target = _Target(address)
                target.thread = threading.Thread(
                    target=self._run_target, args=(target,), name=f"resilrun-replicate-{address}", daemon=True
                )
                self._targets[address] = target
                self._threads.append(target.thread)
                target.thread.start()
        self._cond.notify_all()
        return dropped

    # -- one target's loop --------------------------------------------------------------------------
    def _run_target(self, target: _Target) -> None:
        yield_to_training()
        while True:
            with self._cond:
                source = self._next_source(target)
                while source is None:
                    if self._closed or target.stopped:
                        return
                    wait = _IDLE_WAIT_S if target.retry_at <= time.monotonic() else target.retry_at - time.monotonic()
                    self._cond.wait(min(_IDLE_WAIT_S, max(wait, 0.0)))
                    source = self._next_source(target)
            try:
                started = time.monotonic()
                replicated = self._replicate(target, source)
                seconds = time.monotonic() - started
                if replicated and self._on_replicated is not None:
                    self._on_replicated(source.rank, source.committed.step, source.committed.nbytes, seconds)
            except ReplicationError as exc:
                self._failed(target, exc.message)
                continue
            except Exception as exc:  # a bug must not end this peer's replication silently
                logger.exception("replication of rank %d to %s failed unexpectedly", source.rank, target.address)
                self._failed(target, repr(exc))
                continue
            with self._cond:
                was_keeping_up = _keeps_up(target)
                target.done[source.rank] = source.generation
                nbytes = source.committed.nbytes
                if replicated:
                    target.acked[source.rank] = source.committed.step
                    target.acked_at[source.rank] = (source.committed.round, source.committed.step)
                    if target.lagging and self._at_usual_pace(seconds, nbytes):
                        target.lagging = False
                    if nbytes > 0:
                        self._pace.append(seconds / nbytes)
                target.failures, target.retry_at = 0, 0.0
                if target.healthy is False:
                    logger.info("replication to %s recovered", target.address)
                target.healthy = True
                caught_up = not was_keeping_up and _keeps_up(target)
                self._cond.notify_all()  # the commit gate
            if caught_up:
                self._tell_health(target, True, "")

    def _next_source(self, target: _Target) -> _Source | None:
        """The next rank (round robin) whose newest commit this target has not handled and that is not
        ahead of another local rank there (``_in_step``); None to wait."""
        if self._closed or target.stopped or time.monotonic() < target.retry_at:
            return None
        pending = [
            s
            for r, s in sorted(self._latest.items())
            if target.done.get(r) != s.generation and self._in_step(target, s)
        ]
        if not pending:
            return None
        source = next((s for s in pending if s.rank > target.last_rank), pending[0])
        target.last_rank = source.rank
        return source

    def _in_step(self, target: _Target, source: _Source) -> bool:
        """Whether ``source``'s rank holds no newer step at ``target`` than any other rank this node
        runs (cond held).

        A peer keeps two steps per rank and a push overwrites the older one as it starts, so a rank
        pushed while ahead of another (its commit reached this agent first: a late worker message
        on a loaded node, or the first commits of a new generation) would leave the peer holding no
        step of both: a node lost then could not be resumed from its replicas. Pushing the ranks
        furthest behind first keeps a common step there at every moment, and in lockstep training
        costs nothing (a rank's next commit is never more than a step ahead). The furthest behind
        is always free to go once it commits again; while it does not (a failing rank, until the
        recovery), the others' replicas wait, and the commit gate does not blame the peer for it
        (``_lagging``).
        """
        mine = _position(target, source.rank)
        ranks = self._local_ranks() if self._local_ranks is not None else None
        return all(
            _position(target, rank) >= mine
            for rank in self._latest
            if rank != source.rank and (ranks is None or rank in ranks)
        )

    def _at_usual_pace(self, seconds: float, nbytes: int) -> bool:
        """Whether a push took no longer than the gate allows one of its size (cond held)."""
        return not self._pace or seconds <= max(GATE_FACTOR * statistics.median(self._pace) * nbytes, GATE_MIN_S)

    def _failed(self, target: _Target, why: str) -> None:
        with self._cond:
            target.failures += 1
            target.retry_at = time.monotonic() + min(_RETRY_MAX_S, _RETRY_MIN_S * 2 ** (target.failures - 1))
            newly = target.healthy is not False and not self._closed
            if newly:
                logger.warning("replication to %s failing, replicas will lag: %s", target.address, why)
            tell = _keeps_up(target) and not self._closed and not target.stopped
            target.healthy = False
            self._cond.notify_all()  # the commit gate no longer waits for this target
        if tell:
            self._tell_health(target, False, why)

    def _tell_dropped(self, address: str) -> None:
        if self._on_dropped is None:
            return
        with self._tell_lock:
            try:
                self._on_dropped(address)
            except Exception:  # noqa: BLE001 - reporting must never stop replication
                logger.exception("reporting that %s is no longer a replica target failed", address)

    def _tell_health(self, target: _Target, keeps_up: bool, why: str) -> None:
        if self._on_health is None:
            return
        with self._tell_lock:
            if target.stopped:  # dropped since the change was seen: its drop was (or will be) told
                return
            try:
                self._on_health(target.address, keeps_up, why)
            except Exception:  # noqa: BLE001 - reporting must never stop a peer's replication
                logger.exception("reporting replication health for %s failed", target.address)

    def _replicate(self, target: _Target, source: _Source) -> bool:
        """Push ``source`` to ``target``; False when it was overwritten first (nothing to retry).

        Raises:
            ReplicationError: the peer failed; the caller backs off and retries the newest step.
        """
        # Leased: a reallocation of the slot meanwhile unmaps it only once this push let go of it.
        with self._memory.leased(source.rank, source.committed) as buffer:
            return buffer is not None and self._push(target, source, buffer)

    def _push(self, target: _Target, source: _Source, buffer: SharedBuffer) -> bool:
        rank_memory = self._rank_memory[source.rank]
        slot, committed = source.committed.slot, source.committed

        def is_intact() -> bool:
            return rank_memory.seq.read(slot) == source.seq and rank_memory.committed.get(slot) is committed

        if not is_intact():
            return False
        view = buffer.view()[: committed.nbytes]
        whole: Callable[[], memoryview | None] | None = None
        if committed.borrowed:
            # Deduplicated: the slot's own bytes suffice when the peer fills the shared segments
            # (borrowed ones are among them); otherwise the push sends a copy assembled from the
            # owners' slots.
            def whole() -> memoryview | None:
                assembled = self._memory.read(source.rank, committed.step)
                return memoryview(assembled[0]) if assembled is not None and is_intact() else None

            check = is_intact
        elif target.staged > 0:
            if len(target.staging) < committed.nbytes:
                target.staging = bytearray(committed.nbytes)
            staged = memoryview(target.staging)[: committed.nbytes]
            staged[:] = view
            if not is_intact():
                return False
            view, check = staged, None
        else:
            check = is_intact
        try:
            bounds = snapshot_bounds(view)
        except CheckpointCorruptError as exc:
            if is_intact():
                logger.error("rank %d step %d in node memory is not a snapshot: %s", source.rank, committed.step, exc)
            return False
        world_size = self._world_size() if self._world_size is not None else None
        announce = Announce(
            source.rank,
            committed.step,
            world_size,
            committed.nbytes,
            committed.values,
            bounds,
            committed.shared,
            committed.layout,
            committed.round,
            self._generation() if self._generation is not None else -1,
        )
        deadline = Deadline.total(self._timeout + committed.nbytes / _MIN_RATE_BYTES_S)

        def on_socket(sock: socket.socket | None) -> None:
            target.sock = sock
            # close() sets _closed before it looks at target.sock, so a socket registered after that
            # look sees _closed here: one side or the other always cuts it.
            if sock is not None and self._closed:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        # The commit's crc32s, not the counter, prove the bytes sent (see tiers/_segments.py).
        expected = crcs_at(committed, bounds)
        address, delay = target.address, self._push_delay_s
        sent = push_view(address, self._secret, announce, view, deadline, check, on_socket, whole, expected, delay)
        if not committed.borrowed:  # staging applies to plain slots only (a borrowed one has ``whole``)
            if check is None:
                target.staged -= 1
            elif not sent:
                target.staged = _STAGED_PUSHES
        return sent

    # -- status and shutdown ------------------------------------------------------------------------
    def status(self) -> dict[int, dict[str, int | float | None]]:
        """Per local rank: newest committed step, newest step every current target confirmed, the gap,
        and the seconds its commits waited at the commit gate in all (``held_s``).

        ``replicated`` and ``lag_steps`` are None while some target has confirmed nothing (or there is
        no target).
        """
        with self._cond:
            targets = list(self._targets.values())
            result: dict[int, dict[str, int | float | None]] = {}
            for rank, source in sorted(self._latest.items()):
                acked = [t.acked.get(rank) for t in targets]
                replicated = None if not acked or None in acked else min(a for a in acked if a is not None)
                step = source.committed.step
                lag = None if replicated is None else max(0, step - replicated)
                held = round(self._held_s.get(rank, 0.0), 3)
                result[rank] = {"committed": step, "replicated": replicated, "lag_steps": lag, "held_s": held}
            return result

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Stop replicating: cut transfers in flight (they count for nothing) and join every thread."""
        with self._cond:
            self._closed = True
            targets = list(self._targets.values())
            threads = [self._manager, *self._threads]
            self._cond.notify_all()
        for target in targets:
            sock = target.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        end = time.monotonic() + timeout.total_seconds()
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))
            if thread.is_alive():
                logger.warning("replicator thread %s did not stop within %s", thread.name, timeout)
