"""The rendezvous document as the store holds it: a small head, and the member list apart.

Why: every decision (a generation for a lost node's spare, a spare registered, a node lost) is one
compare-and-set of the whole state, and every agent then reads (or is pushed) what was written:
with the O(N) member list inline, N agents x O(N) bytes per event. Here a large job's member list
(the participants: node ids, addresses, ranks) lives in an immutable, content-addressed blob
written *before* the head that names it, and the head (everything the protocol decides on: round,
flags, failure, spares, counters, seq) carries the blob's key and SHA-256 and, for a few members
changed since (a spare taking a lost node's place), those members alone. So a recovery rewrites a
head of O(1) bytes and agents fetch a blob only when the membership changes wholesale (a new round
of joins), once per blob: each keeps the blobs it read.

Invariants: the head is what compare-and-set compares, and its bytes are a function of the state
and of the blob it may reuse (the replaced head's), so racing writers compare the same bytes as
before. A blob is read only through a head that names it, and is refused unless its bytes hash to
the head's SHA-256 (a forged or swapped blob cannot change the members; the head itself is sealed
like every value). Small jobs (under ``BLOB_MIN`` members) keep the list inline: nothing changes
for them. ``from_bytes`` of a head whose blob is gone raises ``RendezvousError``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from resilrun import keys
from resilrun.errors import RendezvousError
from resilrun.rendezvous.api import RendezvousBackend
from resilrun.rendezvous.protocol import NodeInfo, RdzvState, node_columns, nodes_from

# Members at which the list moves out of the head: below, one document is smaller than two reads.
BLOB_MIN = 64
# Members a head may carry as changes to its blob before the next write starts a new blob.
MAX_CHANGES = 16
_CACHED_BLOBS = 4


class Documents:
    """Encodes the state into a head (writing a blob first when needed) and decodes heads, keeping
    the blobs it has read; one per rendezvous client."""

    def __init__(self, backend: RendezvousBackend, run_id: str, *, blob_min: int | None = None) -> None:
        self.backend = backend
        self.run_id = run_id
        self.blob_min = BLOB_MIN if blob_min is None else blob_min
        self._blobs: OrderedDict[str, tuple[NodeInfo, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.blobs_read = 0  # blobs fetched from the store (the rest came from the cache)

    def decode(self, head: bytes | None) -> RdzvState:
        """The state a head encodes (with its blob's members, changes applied).

        Raises:
            RendezvousError: the blob it names is gone or is not the one it names.
        """
        if head is None:
            return RdzvState()
        doc = json.loads(head)
        members = doc.get("participants")
        if isinstance(members, dict) and "blob" in members:
            doc["participants"] = self._members(members)
        return RdzvState.from_document(doc)

    def encode(self, state: RdzvState, replaced: bytes | None) -> bytes:
        """The head for ``state``; the members by reference to the replaced head's blob when few
        changed, else in a new blob written now (before the head: it must exist once named)."""
        doc = state.to_document()
        if len(state.participants) < self.blob_min:
            return _dump(doc)
        base = _reference(replaced)
        if base is not None:
            with self._lock:
                members = self._blobs.get(base[0])
            if members is not None and len(members) == len(state.participants):
                changed = [i for i, (a, b) in enumerate(zip(members, state.participants, strict=True)) if a != b]
                if len(changed) <= MAX_CHANGES:
                    doc["participants"] = {
                        "blob": base[0],
                        "sha256": base[1],
                        "set": [[i, list(state.participants[i])] for i in changed],
                    }
                    return _dump(doc)
        raw = _dump(node_columns(state.participants))
        digest = hashlib.sha256(raw).hexdigest()
        key = keys.rdzv_members(self.run_id, digest)
        self.backend.set(key, raw)
        self._keep(key, state.participants)
        doc["participants"] = {"blob": key, "sha256": digest, "set": []}
        return _dump(doc)

    def _members(self, ref: dict[str, Any]) -> tuple[NodeInfo, ...]:
        key, digest, changes = ref.get("blob"), ref.get("sha256"), ref.get("set", [])
        if not isinstance(key, str) or not isinstance(digest, str) or not isinstance(changes, list):
            raise RendezvousError("the rendezvous document names its members malformed")
        if key != keys.rdzv_members(self.run_id, digest):
            raise RendezvousError("the rendezvous document names a member list outside this job")
        with self._lock:
            members = self._blobs.get(key)
        if members is None:
            raw = self.backend.get(key)
            self.blobs_read += 1
            if raw is None or hashlib.sha256(raw).hexdigest() != digest:
                raise RendezvousError(
                    "the rendezvous document's member list is gone or not the one it names",
                    hint="someone with access to the store deleted or replaced it; restart the job",
                )
            members = nodes_from(json.loads(raw))
            self._keep(key, members)
        if not changes:
            return members
        updated = list(members)
        for change in changes:
            if not (isinstance(change, list) and len(change) == 2 and isinstance(change[0], int)):
                raise RendezvousError("the rendezvous document's member changes are malformed")
            index, fields = change
            if not 0 <= index < len(updated) or not isinstance(fields, list) or len(fields) != len(NodeInfo._fields):
                raise RendezvousError("the rendezvous document changes a member it does not have")
            updated[index] = NodeInfo(*fields)
        return tuple(updated)

    def _keep(self, key: str, members: tuple[NodeInfo, ...]) -> None:
        with self._lock:  # the agent's threads share one rendezvous client
            self._blobs[key] = members
            self._blobs.move_to_end(key)
            while len(self._blobs) > _CACHED_BLOBS:
                self._blobs.popitem(last=False)


def _reference(head: bytes | None) -> tuple[str, str] | None:
    """The (blob key, sha256) a head's members refer to, if they do."""
    if head is None:
        return None
    try:
        members = json.loads(head).get("participants")
    except (ValueError, AttributeError):
        return None
    if isinstance(members, dict) and isinstance(members.get("blob"), str) and isinstance(members.get("sha256"), str):
        return members["blob"], members["sha256"]
    return None


def _dump(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
