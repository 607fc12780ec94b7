"""The agent's replica server: receives peers' snapshots and serves this node's to restoring peers.

A TCP listener on the address the job needs (loopback by default), one thread per connection,
one request per connection (protocol in ``resilrun.tiers.peer.wire``). Requests:

    | op    | does                                                                 | reply                  |
    |-------|----------------------------------------------------------------------|------------------------|
    | push  | receive a snapshot straight into the rank's free replica slot        | ok, or error (+ why)   |
    | fetch | stream a snapshot of (rank, step) from node memory or a replica, or  | the stream, not_found  |
    |       | only the bytes a ``select`` names (a rank resuming at another size)  |                        |
    | held  | list what this node holds: replicas and its own ranks' steps         | small JSON             |
    | alive | prove this agent is alive, to a watcher whose heartbeat reads stalled | this node's id         |

Invariants: a peer that has not proved the job secret gets nothing but a nonce and is cut off
after ``AUTH_TIMEOUT_S``; a replica becomes visible only after the sender's COMMIT and every
crc32 matched; no peer input can raise out of a connection thread or make the server allocate
more than a checked size.

Admission: a connection waits in a pre-auth stage of its own (``admission``: at most
``max_pending``, the oldest of the busiest source dropped to make room for a new one) until it
proved the secret, and only then takes one of ``max_connections`` service slots; so connections
without the secret never take the slots that peers' pushes and fetches need. ALIVE needs no slot
at all: a watcher's probe (``agent.node_loss``) is answered even when every slot is busy.

Fencing (``generation``): a sender following an older generation than this node's is refused at
its announce and again before its replica is published (the node may have followed a recovery
while the bytes came), and its transfer still in progress gives way at once to a push of the same
rank from a sender of a newer generation: a sender cut off mid-push leaves a silent connection
that would otherwise hold the rank's slot until ``io_timeout``, refusing the rank's new owner.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

from resilrun.errors import CheckpointCorruptError, CheckpointError
from resilrun.snapshot.crc import crc32
from resilrun.snapshot.layout import parse_header
from resilrun.snapshot.restore import world_of
from resilrun.snapshot.selection import Selection
from resilrun.tiers.captured.catalog import Catalog
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import files
from resilrun.tiers.peer.admission import PreAuthStage
from resilrun.tiers.peer.refs import LocalReferences
from resilrun.tiers.peer.store import LocalRef, Replica, ReplicaStore, Reservation
from resilrun.tiers.peer.stream import receive_snapshot, send_snapshot, spans
from resilrun.tiers.peer.wire import (
    Announce,
    Credential,
    Deadline,
    ReplicationError,
    Session,
    check_secret,
    format_address,
    parse_announce,
    server_handshake,
    snapshot_bounds,
    tune,
)
from resilrun.tiers.priority import yield_to_training

logger = logging.getLogger(__name__)

# The handshake is three small messages, one round trip and two HMACs on each end (milliseconds even
# across regions, on a busy agent): a peer holding a connection longer without proving the secret
# is a scanner or an attacker, and this bounds how long it can hold one of the pre-auth stage's places.
AUTH_TIMEOUT_S = 2.0
# After authentication, an operation (one recv_into, one sendall of a frame) that makes no progress
# for this long means the peer is gone; a legitimate transfer keeps moving.
IO_TIMEOUT = timedelta(seconds=30)
# Authenticated connections served at once. Replicas come from the next k nodes, fetches from
# restoring nodes; 64 covers both with room to spare.
MAX_CONNECTIONS = 64
# Connections still to prove the secret (see ``admission``): with MAX_CONNECTIONS, this caps the
# threads a connection flood can create. As many as the slots, so that a burst of honest
# handshakes (every restoring node asking what this node holds) fits as it did before the stage.
MAX_PENDING = 64
# Requests answered without a service slot: cheap, and what a watcher needs to tell a live node
# from a lost one.
_SLOTLESS_OPS = frozenset({"alive"})
# How long a push of a newer generation's sender waits for a cut-off transfer to give its slot back
# (its thread fails at its next recv, at once).
_SUPERSEDE_WAIT_S = 1.0
# How long a push with shared segments waits for this node's own commit of the same step before
# taking all the bytes over the network instead (ranks in lockstep commit within milliseconds).
_SHARED_WAIT_S = 1.0


class ReplicaServer:
    """Serves PUSH, FETCH and HELD on ``host`` (port chosen by the OS) to peers holding ``secret``."""

    def __init__(
        self,
        secret: Credential,
        replicas: ReplicaStore,
        memory: NodeMemoryTier,
        host: str = "127.0.0.1",
        *,
        io_timeout: timedelta = IO_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        max_pending: int = MAX_PENDING,
        generation: Callable[[], int] = lambda: -1,
        node_id: str = "",
        captured: Catalog | None = None,
    ) -> None:
        """Bind and start serving.

        ``captured``: this node's captured files (``--capture-dir``), served by the ``files`` ops.

        ``max_connections``: authenticated connections served at once; ``max_pending``: connections
        waiting to prove the secret (see ``admission``).

        ``node_id``: the agent's node id, the answer to ALIVE (a watcher checks it is the node it
        asked about, not another agent that took the address since).

        ``generation``: the newest generation this node follows. A push from a sender that follows
        an older one is refused: the sender was cut off and replaced (a partition that healed), and
        its replica must not take the place of the new owner's (the fence of the peer tier).

        Raises:
            ValueError: the secret is shorter than ``wire.MIN_SECRET_BYTES``.
            OSError: ``host`` cannot be bound.
        """
        check_secret(secret)
        self._secret = secret
        self.replicas = replicas
        self.memory = memory
        self.refs = LocalReferences(memory, replicas)
        self._generation = generation
        self._node_id = node_id
        self.captured = captured
        self._fenced: set[tuple[str, int]] = set()  # (sender host, generation) refused: logged once
        # rank -> (the sender's generation, its connection) of each transfer in progress
        self._receiving: dict[int, tuple[int, socket.socket]] = {}
        self._io_timeout = io_timeout.total_seconds()
        self._max_connections = max_connections
        self._max_pending = max_pending
        self._listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.bind((host, 0))
            self._listener.listen(max_connections + max_pending)
        except OSError:
            self._listener.close()
            raise
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._pending = PreAuthStage(max_pending)
        self._serving = 0  # service slots taken (authenticated connections)
        self._dropping_from: set[str] = set()  # sources whose waiting connections were dropped (warned once each)
        self._refused_hosts: set[str] = set()
        self._tampered_hosts: set[str] = set()
        self._closed = threading.Event()
        name = f"resilrun-peer-server-{self.port}"
        self._acceptor = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        """``host:port`` as peers dial it."""
        return format_address(self.host, self.port)

    # -- connections -------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.05)  # e.g. EMFILE: do not spin; the listener stays up
                continue
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    continue
                thread = threading.Thread(target=self._serve, args=(conn, peer[0]), daemon=True)
                self._connections[conn] = thread
            dropped = self._pending.admit(conn, peer[0])
            if dropped is not None:
                self._drop(*dropped)
            thread.start()

    def _drop(self, conn: socket.socket, source: str) -> None:
        """Cut a connection still waiting to prove the secret, to make room (see ``admission``)."""
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)  # its thread fails at its next recv and ends
        with self._lock:
            first = source not in self._dropping_from
            self._dropping_from.add(source)
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "more than %d connections to the replica server are waiting to prove the job secret: dropped the "
            "oldest from %s, the source holding the most (a scanner or a flood)",
            self._max_pending,
            source,
        )

    def _serve(self, conn: socket.socket, peer: str) -> None:
        slot = False
        try:
            tune(conn)
            try:
                session = server_handshake(conn, self._secret, Deadline.total(AUTH_TIMEOUT_S))
            finally:
                waited = self._pending.leave(conn)
            if session is None:
                self._note_refused(peer)
                return
            if not waited:
                return  # dropped to make room just as it proved the secret: its socket is shut
            deadline = Deadline.idle(self._io_timeout)
            request = session.recv(deadline)
            op = request.get("op")
            if op not in _SLOTLESS_OPS:
                slot = self._take_slot()
                if not slot:
                    busy = f"busy: {self._max_connections} transfers in progress, try again"
                    session.send({"ok": False, "error": busy}, deadline)
                    return
            if op == "push":
                yield_to_training()  # receiving a replica is background work; serving a fetch is not
                self._push(session, request, deadline, peer)
            elif op == "fetch":
                self._fetch(session, request, deadline)
            elif op == "held":
                session.send({"ok": True, **self.describe()}, deadline)
            elif op == "alive":
                session.send({"ok": True, "node": self._node_id}, deadline)
            elif op in files.FILE_OPS:
                files.serve(op, session, request, deadline, self.captured)
            else:
                session.send({"ok": False, "error": f"unknown op {str(op)[:40]!r}"}, deadline)
        except (OSError, CheckpointError) as exc:  # ReplicationError is a CheckpointError
            if not self._closed.is_set():
                self._note_ended(peer, exc)
        except Exception:  # a bug here must not take the agent down with it, but must be seen
            logger.exception("peer connection from %s failed unexpectedly", peer)
        finally:
            with self._lock:
                self._connections.pop(conn, None)
                self._serving -= slot
            conn.close()

    def _take_slot(self) -> bool:
        """One of the ``max_connections`` service slots for an authenticated request, if one is free."""
        with self._lock:
            if self._serving >= self._max_connections:
                return False
            self._serving += 1
            return True

    def _note_ended(self, peer: str, exc: Exception) -> None:
        """A connection that broke off; one whose message failed its MAC was tampered with on the
        way (or came from a bug): warned once per host, like a refused handshake."""
        message = exc.message if isinstance(exc, CheckpointError) else str(exc)
        if "failed its MAC" not in message:
            logger.debug("peer connection from %s ended: %s", peer, message)
            return
        with self._lock:
            first = peer not in self._tampered_hosts
            self._tampered_hosts.add(peer)
        logger.log(
            logging.WARNING if first else logging.DEBUG, "dropped a replica connection from %s: %s", peer, message
        )

    def _note_refused(self, peer: str) -> None:
        # Warn once per host: a scanner must not flood the agent's log, but a misconfigured node must be seen.
        with self._lock:
            first = peer not in self._refused_hosts
            self._refused_hosts.add(peer)
        level = logging.WARNING if first else logging.DEBUG
        logger.log(level, "refused a replica connection from %s: it did not prove the job secret", peer)

    # -- requests ----------------------------------------------------------------------------------
    def _push(self, session: Session, request: dict[str, Any], deadline: Deadline, peer: str) -> None:
        try:
            announce = parse_announce(request)
            self._check_generation(announce, peer)
            reservation = self._reserve(announce, session.sock, peer)
        except ReplicationError as exc:
            session.send({"ok": False, "error": exc.message}, deadline)
            return
        try:
            self._receive(session, announce, reservation, deadline, peer)
        finally:
            with self._lock:
                if self._receiving.get(announce.rank, (0, None))[1] is session.sock:
                    del self._receiving[announce.rank]

    def _reserve(self, announce: Announce, conn: socket.socket, peer: str) -> Reservation:
        """The rank's slot for this push; a stalled transfer of an older generation's sender gives way."""
        try:
            reservation = self.replicas.reserve(announce.rank, announce.nbytes)
        except ReplicationError:
            if not self._supersede(announce, peer):
                raise
            reservation = self.replicas.reserve(announce.rank, announce.nbytes)
        with self._lock:
            self._receiving[announce.rank] = (announce.generation, conn)
        return reservation

    def _supersede(self, announce: Announce, peer: str) -> bool:
        """Cut off the transfer of ``announce.rank`` in progress if its sender follows an older
        generation than this push's; whether its slot was given back (within a second)."""
        with self._lock:
            holder = self._receiving.get(announce.rank)
        if holder is None or announce.generation < 0 or not 0 <= holder[0] < announce.generation:
            return False
        logger.info(
            "cut off a transfer of rank %d from a sender of generation %d: %s pushes it for generation %d",
            announce.rank,
            holder[0],
            peer,
            announce.generation,
        )
        with contextlib.suppress(OSError):
            holder[1].shutdown(socket.SHUT_RDWR)  # its thread's next recv fails; it gives the slot back
        return self.replicas.wait_idle(announce.rank, _SUPERSEDE_WAIT_S)

    def _receive(
        self, session: Session, announce: Announce, reservation: Reservation, deadline: Deadline, peer: str
    ) -> None:
        token = self.refs.begin(announce.step, announce.round) if announce.shared else None
        try:
            local = self._shared_here(announce, token, reservation.view)
            session.send({"ok": True, "filled": True} if local else {"ok": True}, deadline)
            filled = announce.shared if local else ()
            received = receive_snapshot(session, deadline, reservation.view, announce.bounds, filled)
            problem = received.problem
            if problem is None:
                replica = Replica(
                    announce.rank,
                    announce.step,
                    announce.world_size,
                    announce.nbytes,
                    announce.values,
                    announce.bounds,
                    received.crcs,
                    local if isinstance(local, LocalRef) else None,
                )
                problem = self._superseded(announce) or self._publish(reservation, replica, token)
        except BaseException:
            self.replicas.release(reservation)
            raise
        finally:
            if token is not None:
                self.refs.end(token)
        # Published or released before replying, so that a sender told the outcome may push again at once.
        if problem is None:
            session.send({"ok": True}, deadline)
            return
        self.replicas.release(reservation)
        level = logging.DEBUG if received.aborted else logging.WARNING
        logger.log(
            level, "replica of rank %d step %d from %s not kept: %s", announce.rank, announce.step, peer, problem
        )
        session.send({"ok": False, "error": problem}, deadline)

    def _superseded(self, announce: Announce) -> str | None:
        """Why a received replica is not kept when this node followed a newer generation than its
        sender's while the bytes came (the sender lost the rank meanwhile)."""
        current = self._generation()
        if announce.generation < 0 or announce.generation >= current:
            return None
        return (
            f"step {announce.step} of rank {announce.rank} comes from generation {announce.generation}, "
            f"superseded by generation {current} while it was received"
        )

    def _check_generation(self, announce: Announce, peer: str) -> None:
        """Refuse a sender that follows a generation older than this node's (see ``generation`` in __init__)."""
        current = self._generation()
        if announce.generation < 0 or announce.generation >= current:
            return
        with self._lock:
            first = (peer, announce.generation) not in self._fenced
            self._fenced.add((peer, announce.generation))
        logger.log(
            logging.INFO if first else logging.DEBUG,
            "refused replicas from %s, which follows generation %d (rank %d step %d): this node follows "
            "generation %d (the sender was replaced, or has yet to follow a recovery)",
            peer,
            announce.generation,
            announce.rank,
            announce.step,
            current,
        )
        raise ReplicationError(
            f"step {announce.step} of rank {announce.rank} comes from generation {announce.generation}, "
            f"superseded by generation {current}"
        )

    def _shared_here(self, announce: Announce, token: int | None, into: memoryview) -> LocalRef | bool:
        """Whether this node holds the announce's shared segments itself: by reference (a LocalRef,
        with a token: see ``refs``), copied into ``into`` (True), or not (False).

        Under DDP this node's ranks hold the same parameters and optimizer state at the same step,
        so those bytes need not cross the network: only each rank's own bytes do. Waits a little
        for this node's commit of the step (in lockstep it lands about when the push does).
        """
        if not announce.shared:
            return False
        step, layout, round = announce.step, announce.layout, announce.round
        if token is None:  # the step's slot may be rewritten any time: copy the bytes while they last
            return self.memory.copy_shared(step, layout, round, announce.shared, into, _SHARED_WAIT_S)
        # (Not held within the wait: a copy would wait again for the same commit.)
        return (
            LocalRef(layout, round, announce.shared)
            if self.memory.holds(step, layout, round, _SHARED_WAIT_S)
            else False
        )

    def _publish(self, reservation: Reservation, replica: Replica, token: int | None) -> str | None:
        """Make a verified replica visible; why not, when its referenced bytes could not be kept."""
        if replica.local is None:
            self.replicas.publish(reservation, replica)
            return None
        if token is not None and self.refs.publish(token, lambda: self.replicas.publish(reservation, replica)):
            return None
        # The guard released the step while the push was in flight: copy the bytes in while they last.
        if self.refs.fill(replica.local, replica.step, reservation.view):
            self.replicas.publish(reservation, replace(replica, local=None))
            return None
        return "this node's copy of the shared segments was rewritten while the push was received"

    def _fetch(self, session: Session, request: dict[str, Any], deadline: Deadline) -> None:
        rank, step = request.get("rank"), request.get("step")
        if not isinstance(rank, int) or not isinstance(step, int):
            session.send({"ok": False, "error": "bad rank or step"}, deadline)
            return
        try:
            select = Selection.from_message(request["select"]) if "select" in request else None
        except ValueError as exc:
            session.send({"ok": False, "error": str(exc)}, deadline)
            return
        local = self.memory.read(rank, step)
        if local is not None:
            data, values = local
            view = memoryview(data)
            try:
                bounds = snapshot_bounds(view)
                ranges = None if select is None else select.ranges(parse_header(view, len(view)))
            except CheckpointCorruptError as exc:
                problem = f"this node's copy is not a snapshot: {exc.message}"
                session.send({"ok": False, "error": problem}, deadline)
                return
            announce = Announce(rank, step, None, len(view), values, bounds)
            session.send({"ok": True, **announce.to_message(), **_ranges_field(ranges)}, deadline)
            send_snapshot(session, deadline, view, announce.bounds, skip=_outside(len(view), ranges))
            return
        listed = self.replicas.replica(rank, step) is not None
        opened = self.replicas.open(rank, step) if self.refs.materialize(rank, step, checksum=False) else None
        if opened is None:
            # Listed but gone: its shared segments were rewritten here before they were copied in
            # (a defect, or a slot rewritten meanwhile); say so, so that the fetcher's log shows it.
            why = "its shared segments are no longer in this node's memory" if listed else "not held"
            if listed:
                logger.warning("replica of rank %d step %d could not be served: %s", rank, step, why)
            session.send({"ok": False, "not_found": True, "error": why}, deadline)
            return
        view, replica, is_current = opened
        ranges = None
        if select is not None:
            ranges = select.ranges(parse_header(view, len(view)))  # a replica's header was checked when received
            if not _intact_at_rest(view, replica.bounds, replica.crcs, ranges) and is_current():
                logger.error("replica of rank %d step %d is corrupt in this node's memory: dropped", rank, step)
                self.replicas.discard(rank, step)
                session.send({"ok": False, "not_found": True, "error": "corrupt in the peer's memory"}, deadline)
                return
        announce = Announce(rank, step, replica.world_size, replica.nbytes, replica.values, replica.bounds)
        session.send({"ok": True, **announce.to_message(), **_ranges_field(ranges)}, deadline)
        skip = _outside(len(view), ranges)
        sent = send_snapshot(session, deadline, view, replica.bounds, is_current, stored_crcs=replica.crcs, skip=skip)
        at_rest = [(now, kept) for now, kept in zip(sent.crcs, replica.crcs, strict=True) if kept is not None]
        if sent.committed and any(now != kept for now, kept in at_rest if now is not None) and is_current():
            logger.error("replica of rank %d step %d is corrupt in this node's memory: dropped", rank, step)
            self.replicas.discard(rank, step)

    def describe(self) -> dict[str, Any]:
        """What this node holds: peers' replicas and its own ranks' committed steps, newest first;
        and ``entries``: each of them as [rank, step, the world size that wrote it (-1: unknown)],
        which a restore at another world size plans from."""
        local = {}
        entries = set()
        for rank in self.memory.held_ranks():
            committed = [c for c in self.memory.describe(rank)["committed"].values() if c["complete"]]
            steps = sorted((int(c["step"]) for c in committed), reverse=True)
            if steps:
                local[str(rank)] = steps
            entries.update((rank, int(c["step"]), world_of(c["values"])) for c in committed)
        replicas = {str(rank): steps for rank, steps in self.replicas.held().items()}
        entries.update((rank, step, world_of(values)) for rank, step, values in self.replicas.entries())
        return {"replicas": replicas, "local": local, "entries": [list(e) for e in sorted(entries)]}

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Stop accepting, cut every connection (transfers in flight count for nothing), join the threads."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._listener.close()
        with self._lock:
            connections = list(self._connections.items())
        for conn, _ in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        end = time.monotonic() + timeout.total_seconds()
        for thread in [self._acceptor, *(t for _, t in connections)]:
            thread.join(max(0.0, end - time.monotonic()))
            if thread.is_alive():
                logger.warning("replica server thread %s did not stop within %s", thread.name, timeout)


def _ranges_field(ranges: list[tuple[int, int]] | None) -> dict[str, Any]:
    """A ranged fetch's reply names the bytes the stream carries (the fetcher checks them)."""
    return {} if ranges is None else {"ranges": [list(r) for r in ranges]}


def _outside(total: int, ranges: list[tuple[int, int]] | None) -> list[tuple[int, int]]:
    """What a ranged fetch leaves out of the stream (nothing for a whole one)."""
    return [] if ranges is None else spans(total, ranges)


def _intact_at_rest(
    view: memoryview, bounds: tuple[int, ...], crcs: tuple[int | None, ...], ranges: list[tuple[int, int]]
) -> bool:
    """Whether every segment a ranged fetch sends part of still hashes to the crc32 recorded when
    it was received: the stream's checks cover only what it sends, so a replica corrupted at rest
    is caught here (a local read of those segments) instead of reaching the fetcher."""
    for index, crc in enumerate(crcs):
        begin, end = bounds[index], bounds[index + 1]
        if crc is not None and any(b < end and begin < e for b, e in ranges) and crc32(view[begin:end]) != crc:
            return False
    return True
