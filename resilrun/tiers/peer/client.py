"""Tier 2 client calls: push a snapshot to a peer, fetch one back, ask what a peer holds, or whether it lives.

Each call opens one connection, authenticates both ways on the job secret (a client never sends
state to a peer that cannot prove the secret), makes one request under one total deadline, and
verifies every message's MAC, a received stream's GMAC and every crc32 of what it receives.
Protocol: ``resilrun.tiers.peer.wire``.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

from resilrun.errors import CheckpointCorruptError, CheckpointNotFoundError
from resilrun.snapshot.layout import parse_header
from resilrun.snapshot.selection import Selection, check_ranges
from resilrun.tiers.headroom import fits
from resilrun.tiers.peer.stream import receive_snapshot, send_snapshot, spans
from resilrun.tiers.peer.wire import (
    Announce,
    Credential,
    Deadline,
    ReplicationError,
    Session,
    check_secret,
    client_handshake,
    parse_address,
    parse_announce,
    snapshot_bounds,
    tune,
)

# Connecting, authenticating and the receiver allocating a fresh buffer take well under this on any
# network a training job runs on; the Replicator adds an allowance for the transfer itself.
DEFAULT_TIMEOUT = timedelta(seconds=10)


@contextlib.contextmanager
def connection(
    address: str,
    secret: Credential,
    deadline: Deadline,
    on_socket: Callable[[socket.socket | None], None] | None = None,
) -> Iterator[Session]:
    """An authenticated connection (its session); every OSError inside becomes a ReplicationError naming the peer.

    Args:
        on_socket: told the socket once it exists and None once it is closed, so that an owner
            shutting down can cut a transfer in flight.
    """
    check_secret(secret)
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=deadline.left())
    except OSError as exc:
        raise ReplicationError(f"could not reach peer {address}: {exc}") from exc
    try:
        if on_socket is not None:
            on_socket(sock)
        tune(sock)
        yield client_handshake(sock, secret, deadline)
    except OSError as exc:
        raise ReplicationError(f"connection to peer {address} failed: {exc}") from exc
    except ReplicationError as exc:
        raise ReplicationError(f"peer {address}: {exc.message}") from exc
    finally:
        if on_socket is not None:
            on_socket(None)
        sock.close()


def push_view(
    address: str,
    secret: Credential,
    announce: Announce,
    view: memoryview,
    deadline: Deadline,
    is_intact: Callable[[], bool] | None = None,
    on_socket: Callable[[socket.socket | None], None] | None = None,
    whole: Callable[[], memoryview | None] | None = None,
    expected_crcs: Sequence[int | None] | None = None,
    delay_s: float = 0.0,
) -> bool:
    """Send one snapshot; False when ``is_intact`` or ``expected_crcs`` said the source changed (ABORT was sent).

    Args:
        whole: when ``view`` is complete only in the announce's shared segments' absence (a
            deduplicated slot), what to send instead if the peer does not fill them itself: a
            private complete copy, or None when the source is gone (ABORT).
        expected_crcs: the source commit's crc32 per segment (see ``send_snapshot``).
        delay_s: a fault hook (``Replicator(push_delay_s=...)``): wait this long after the peer
            accepted the announce, before the bytes, as a slow link would.
    """
    with connection(address, secret, deadline, on_socket) as session:
        session.send({"op": "push", **announce.to_message()}, deadline)
        reply = session.recv(deadline)
        if reply.get("ok") is not True:
            raise ReplicationError(f"refused step {announce.step} of rank {announce.rank}: {reply.get('error')}")
        skip = announce.shared if reply.get("filled") is True else ()  # the peer holds those bytes itself
        if delay_s > 0:
            time.sleep(min(delay_s, max(0.0, deadline.left())))
        if not skip and whole is not None:
            complete = whole()
            view, is_intact = (complete, None) if complete is not None else (view, lambda: False)
        sent = send_snapshot(
            session, deadline, view, announce.bounds, is_intact, skip=skip, expected_crcs=expected_crcs
        )
        reply = session.recv(deadline)
        if not sent.committed:
            return False
        if reply.get("ok") is not True:
            raise ReplicationError(f"did not keep step {announce.step} of rank {announce.rank}: {reply.get('error')}")
        return True


def push(
    address: str,
    secret: Credential,
    rank: int,
    step: int,
    world_size: int | None,
    data: bytes | memoryview,
    values: Any,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Replicate one rank's snapshot to the peer at ``address``; it counts there once this returns.

    Args:
        world_size: recorded with the replica (None: unknown), so a restore can refuse a mismatch.
        data: a snapshot (safetensors bytes, as ``resilrun.snapshot.layout`` lays them out).
        values: any JSON; travels with the replica.
        timeout: the whole transfer's deadline.

    Raises:
        ReplicationError: unreachable, unauthenticated, refused, timed out, or checksums did not match.
        CheckpointCorruptError: ``data`` is not a snapshot.
        ValueError: rank, step or world size out of range; a secret too short.
    """
    if rank < 0 or step < 0 or (world_size is not None and not 0 <= rank < world_size):
        raise ValueError(f"rank {rank}, step {step}, world size {world_size} out of range")
    view = memoryview(data).cast("B")
    announce = Announce(rank, step, world_size, len(view), values, snapshot_bounds(view))
    push_view(address, secret, announce, view, Deadline.total(timeout.total_seconds()))


def fetch(
    address: str,
    secret: Credential,
    rank: int,
    step: int,
    timeout: timedelta = DEFAULT_TIMEOUT,
    *,
    select: Selection | None = None,
    into: Callable[[int], memoryview] | None = None,
) -> tuple[bytearray | memoryview, Any]:
    """A peer's copy of ``rank``'s snapshot of ``step`` (from its replicas or its own memory), verified.

    Args:
        select: only these bytes (and the header): the peer streams just them, at their offsets.
        into: given the snapshot's size, the buffer to receive into (else a new bytearray);
            with ``select``, a sparse one: the bytes not selected are left as they are.

    Returns:
        (bytes, values); the bytes come as a bytearray (received in place, not copied again), which
        ``NodeMemoryTier.install`` and every bytes-like consumer accept, or as ``into``'s buffer.

    Raises:
        CheckpointNotFoundError: the peer does not hold that step.
        CheckpointCorruptError: a crc32 did not match, or the bytes are not a snapshot.
        ReplicationError: unreachable, unauthenticated, timed out, the copy changed while sent,
            or the peer sent other bytes than ``select`` names.
    """
    deadline = Deadline.total(timeout.total_seconds())
    request: dict[str, Any] = {"op": "fetch", "rank": rank, "step": step}
    if select is not None:
        request["select"] = select.to_message()
    with connection(address, secret, deadline) as session:
        session.send(request, deadline)
        reply = session.recv(deadline)
        if reply.get("ok") is not True:
            if reply.get("not_found") is True:
                why = reply.get("error")
                detail = f" ({why})" if isinstance(why, str) and why != "not held" else ""
                raise CheckpointNotFoundError(f"peer {address} holds no step {step} of rank {rank}{detail}")
            raise ReplicationError(f"refused step {step} of rank {rank}: {reply.get('error')}")
        announce = parse_announce(reply)
        if (announce.rank, announce.step) != (rank, step):
            raise ReplicationError(f"sent step {announce.step} of rank {announce.rank} instead")
        ranges = [(0, announce.nbytes)]
        if select is not None:
            try:
                ranges = check_ranges(reply.get("ranges"), announce.nbytes)
            except ValueError as exc:
                raise ReplicationError(f"step {step} of rank {rank}: {exc}") from None
        if not fits(sum(e - b for b, e in ranges)):
            raise ReplicationError(f"node memory cannot hold a {announce.nbytes} byte snapshot")
        target = memoryview(bytearray(announce.nbytes)) if into is None else into(announce.nbytes)
        filled = spans(announce.nbytes, ranges)
        received = receive_snapshot(session, deadline, target, announce.bounds, filled)
        if received.aborted:
            raise ReplicationError(f"its copy of step {step} of rank {rank} changed while it was sent")
        if received.problem is not None:
            raise CheckpointCorruptError(f"step {step} of rank {rank} from peer {address}: {received.problem}")
        if select is not None and select.ranges(parse_header(target, announce.nbytes)) != ranges:
            raise ReplicationError(f"sent other bytes of step {step} of rank {rank} than were asked for")
        return (target.obj if into is None else target), announce.values  # type: ignore[return-value]


def _ask(address: str, secret: Credential, op: str, timeout: timedelta) -> dict[str, Any]:
    """One small request and its reply, on one authenticated connection, under one deadline."""
    deadline = Deadline.total(timeout.total_seconds())
    with connection(address, secret, deadline) as session:
        session.send({"op": op}, deadline)
        return session.recv(deadline)


def held(address: str, secret: Credential, timeout: timedelta = DEFAULT_TIMEOUT) -> dict[str, dict[int, list[int]]]:
    """What the peer holds: ``{"replicas": {rank: steps}, "local": {rank: steps}}``, newest step first.

    Raises:
        ReplicationError: unreachable, unauthenticated, timed out, or a malformed reply.
    """
    reply = _ask(address, secret, "held", timeout)
    try:
        return {
            kind: {int(rank): [int(step) for step in steps] for rank, steps in reply[kind].items()}
            for kind in ("replicas", "local")
        }
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ReplicationError(f"peer {address} sent a malformed HELD reply") from None


def inventory(address: str, secret: Credential, timeout: timedelta = DEFAULT_TIMEOUT) -> list[tuple[int, int, int]]:
    """Every snapshot the peer holds (its own ranks' and replicas) as (rank, step, world size).

    Raises:
        ReplicationError: unreachable, unauthenticated, timed out, or a malformed reply.
    """
    reply = _ask(address, secret, "held", timeout)
    try:
        return [(int(rank), int(step), int(world)) for rank, step, world in reply["entries"]]
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ReplicationError(f"peer {address} sent a malformed HELD reply") from None


def alive(address: str, secret: Credential, timeout: timedelta) -> str:
    """The node id of the agent serving at ``address``, proved on the job secret within ``timeout``.

    Why it exists: heartbeats are counters in the rendezvous store, which a party without the secret
    can write (pin a live node's counter and it looks lost). This answer cannot be forged or
    replayed: it comes over a session keyed on fresh nonces of both sides.

    Raises:
        ReplicationError: unreachable, unauthenticated, timed out, or a malformed reply.
    """
    reply = _ask(address, secret, "alive", timeout)
    node = reply.get("node")
    if reply.get("ok") is not True or not isinstance(node, str):
        raise ReplicationError(f"peer {address} sent a malformed ALIVE reply")
    return node
