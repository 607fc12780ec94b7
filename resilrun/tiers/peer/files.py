"""Captured files between peers (issue 45): list, push, fetch and drop, on the replica server.

The same connection, handshake and stream as a snapshot (``wire``, ``stream``): a file's bytes
travel as data frames under the session's GMAC (encrypted under ``--peer-encryption``), one
crc32 per segment of ``SEGMENT_BYTES``; the receiver then checks they hash to the SHA-256 the
announce named, so what a peer keeps or a restore writes is the version it was told of, byte for
byte. The announce is a ``FileVersion`` (``tiers.captured.catalog``), its path checked before
anything is allocated.

Requests:

- ``{"op": "files"}`` -> every version the peer holds;
- ``{"op": "put_file", version}`` -> ok, then the stream (or ok and ``newer``: the peer holds a
  newer version of the path, nothing is sent);
- ``{"op": "get_file", "path", "sha256"}`` -> the version, then the stream;
- ``{"op": "drop_file", version}`` -> the peer forgets that version of the path (or an older one).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from resilrun.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from resilrun.tiers.captured.catalog import Catalog, FileVersion, check_path, digest
from resilrun.tiers.headroom import fits
from resilrun.tiers.peer.client import connection
from resilrun.tiers.peer.stream import receive_snapshot, send_snapshot
from resilrun.tiers.peer.wire import Credential, Deadline, ReplicationError, Session

logger = logging.getLogger(__name__)

FILE_OPS = frozenset({"files", "put_file", "get_file", "drop_file"})
# crc32 granularity of a file stream (a mismatch names the segment); a file has no inner layout.
SEGMENT_BYTES = 64 * 1024 * 1024


def segment_bounds(size: int) -> list[int]:
    return [*range(0, size, SEGMENT_BYTES), size] if size else [0]


def _sha256_check(expected: str) -> Any:
    def check(view: memoryview) -> None:
        if digest(view) != expected:
            raise CheckpointCorruptError("the bytes do not hash to the announced sha256")

    return check


def _receive(session: Session, deadline: Deadline, version: FileVersion) -> tuple[bytes, str | None]:
    """The stream of ``version``'s bytes, checked (crc32s, the session's MAC, its SHA-256); the
    problem when they do not count."""
    target = bytearray(version.size)
    received = receive_snapshot(
        session,
        deadline,
        memoryview(target),
        segment_bounds(version.size),
        check=_sha256_check(version.sha256),
        what="the announced file",
    )
    return bytes(target), received.problem


# -- client -------------------------------------------------------------------------------------
def list_files(address: str, secret: Credential, timeout: timedelta) -> list[FileVersion]:
    """Every captured version the peer holds (its own captures and the replicas it keeps).

    Raises:
        ReplicationError: unreachable, unauthenticated, timed out, or a malformed reply.
    """
    deadline = Deadline.total(timeout.total_seconds())
    with connection(address, secret, deadline) as session:
        session.send({"op": "files"}, deadline)
        reply = session.recv(deadline)
    if reply.get("ok") is not True or not isinstance(reply.get("files"), list):
        raise ReplicationError(f"peer {address} sent a malformed FILES reply")
    try:
        return [FileVersion.from_message(item) for item in reply["files"]]
    except CheckpointError as exc:
        raise ReplicationError(f"peer {address} listed a bad captured file: {exc.message}") from None


def push_file(address: str, secret: Credential, version: FileVersion, data: bytes, timeout: timedelta) -> None:
    """Send one captured file; the peer holds it once this returns.

    Raises:
        ReplicationError: unreachable, unauthenticated, refused (e.g. no memory), or timed out.
    """
    deadline = Deadline.total(timeout.total_seconds())
    with connection(address, secret, deadline) as session:
        session.send({"op": "put_file", **version.to_message()}, deadline)
        reply = session.recv(deadline)
        if reply.get("ok") is not True:
            raise ReplicationError(f"refused captured file {version.path}: {reply.get('error')}")
        if reply.get("newer") is True:
            return  # the peer holds a newer version of the path (its own node wrote one): nothing to send
        send_snapshot(session, deadline, memoryview(data), segment_bounds(len(data)))
        reply = session.recv(deadline)
        if reply.get("ok") is not True:
            raise ReplicationError(f"did not keep captured file {version.path}: {reply.get('error')}")


def fetch_file(address: str, secret: Credential, version: FileVersion, timeout: timedelta) -> bytes:
    """The bytes of ``version`` from the peer, checked against its sha256.

    Raises:
        CheckpointNotFoundError: the peer does not hold that version (or no longer keeps its bytes).
        CheckpointCorruptError: the bytes do not match.
        ReplicationError: unreachable, unauthenticated, timed out.
    """
    deadline = Deadline.total(timeout.total_seconds())
    with connection(address, secret, deadline) as session:
        session.send({"op": "get_file", "path": version.path, "sha256": version.sha256}, deadline)
        reply = session.recv(deadline)
        if reply.get("ok") is not True:
            if reply.get("not_found") is True:
                raise CheckpointNotFoundError(f"peer {address} does not hold {version.path} ({version.sha256[:12]})")
            raise ReplicationError(f"refused captured file {version.path}: {reply.get('error')}")
        try:
            sent = FileVersion.from_message(reply.get("version"))
        except CheckpointError as exc:
            raise ReplicationError(f"peer {address}: {exc.message}") from None
        if (sent.path, sent.sha256, sent.size) != (version.path, version.sha256, version.size):
            raise ReplicationError(f"peer {address} sent another version of {version.path}")
        if not fits(sent.size):
            raise ReplicationError(f"node memory cannot hold the {sent.size} byte captured file {sent.path}")
        data, problem = _receive(session, deadline, sent)
    if problem is not None:
        raise CheckpointCorruptError(f"captured file {version.path} from peer {address}: {problem}")
    return data


def drop_file(address: str, secret: Credential, version: FileVersion, timeout: timedelta) -> None:
    """Tell the peer the script deleted ``version`` (it forgets that version or an older one).

    Raises:
        ReplicationError: unreachable, unauthenticated, timed out.
    """
    deadline = Deadline.total(timeout.total_seconds())
    with connection(address, secret, deadline) as session:
        session.send({"op": "drop_file", **version.to_message()}, deadline)
        session.recv(deadline)


# -- server -------------------------------------------------------------------------------------
def serve(op: str, session: Session, request: dict[str, Any], deadline: Deadline, catalog: Catalog | None) -> None:
    """Answer one file request on the replica server (``op`` is one of ``FILE_OPS``)."""
    if catalog is None:
        session.send({"ok": False, "error": "this node captures no folder (no --capture-dir)"}, deadline)
        return
    if op == "files":
        session.send({"ok": True, "files": [v.to_message() for v in catalog.versions()]}, deadline)
        return
    if op == "get_file":
        _serve_get(session, request, deadline, catalog)
        return
    try:
        version = FileVersion.from_message({k: v for k, v in request.items() if k != "op"})
    except CheckpointError as exc:
        session.send({"ok": False, "error": exc.message}, deadline)
        return
    if op == "drop_file":
        catalog.remove(version.path, upto=version.order)
        session.send({"ok": True}, deadline)
        return
    _serve_put(session, version, deadline, catalog)


def _serve_put(session: Session, version: FileVersion, deadline: Deadline, catalog: Catalog) -> None:
    held = catalog.newest(version.path)
    if held is not None and held.order >= version.order:
        session.send({"ok": True, "newer": True}, deadline)  # not an error: both nodes saved the path
        return
    if not fits(version.size):
        session.send({"ok": False, "error": f"no memory for {version.size} bytes on this node"}, deadline)
        return
    session.send({"ok": True}, deadline)
    data, problem = _receive(session, deadline, version)
    if problem is not None:
        logger.warning("a captured file %s pushed by a peer was not kept: %s", version.path, problem)
        session.send({"ok": False, "error": problem}, deadline)
        return
    catalog.put(version, data, own=False)
    session.send({"ok": True}, deadline)


def _serve_get(session: Session, request: dict[str, Any], deadline: Deadline, catalog: Catalog) -> None:
    path, sha256 = request.get("path"), request.get("sha256")
    try:
        check_path(path)
    except CheckpointError as exc:
        session.send({"ok": False, "error": exc.message}, deadline)
        return
    found = catalog.read(path, sha256 if isinstance(sha256, str) else None)
    if found is None:
        session.send({"ok": False, "not_found": True, "error": "not held"}, deadline)
        return
    version, data = found
    if digest(data) != version.sha256:  # corrupted at rest: never serve it, forget it
        logger.error("captured file %s is corrupt in this node's memory: dropped", version.path)
        catalog.remove(version.path, upto=version.order)
        session.send({"ok": False, "not_found": True, "error": "corrupt in the peer's memory"}, deadline)
        return
    session.send({"ok": True, "version": version.to_message()}, deadline)
    send_snapshot(session, deadline, memoryview(data), segment_bounds(len(data)))
