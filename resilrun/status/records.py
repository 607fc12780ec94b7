"""The job's status records in the rendezvous store: node registry, node documents, history, timelines.

Everything here is small JSON (hundreds of bytes to a few KB) written through the
:class:`RendezvousBackend` ABC, so any backend (TCPStore, etcd, memory) carries it.

Layout (keys in ``resilrun.keys``):

- node registry: a counter hands each agent an index once; ``status/nodes/<i>`` names its node id,
  so a reader lists every node that ever took part with ``count + 1`` reads and no key scan;
- node documents: one key per agent, rewritten only by that agent (no write contention);
- lost markers: set by the agent that judged a node lost;
- straggler verdicts: one key, written by the agent of node rank 0 only;
- history: a ring of ``HISTORY_SLOTS`` records. Appending is one counter increment (which gives the
  record its index) and one write to slot ``index % HISTORY_SLOTS``; each record carries its index,
  so a reader racing a writer skips a slot that was overwritten. Memory in the store stays bounded
  however long the job runs;
- recovery parts: each node's share of a recovery timeline, one key per (round, node rank), written
  by that node's agent as its workers report.

Invariant: writers never read-modify-write a shared key except through counters and compare-and-set.
"""

from __future__ import annotations

import json
from typing import Any

from resilrun import keys
from resilrun.rendezvous.api import RendezvousBackend, read_numbered

HISTORY_SLOTS = 64
SCHEMA = 1


def _dump(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def _load(raw: bytes | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


# -- writers ------------------------------------------------------------------------------------------
def register_node(backend: RendezvousBackend, run_id: str, node_id: str) -> int:
    """Add this node to the run's registry (once per agent) and mark the run as the store's newest."""
    index = backend.add(keys.status_node_count(run_id), 1)
    backend.set(keys.status_node_index(run_id, index), node_id.encode())
    backend.set(keys.latest_run(), run_id.encode())
    return index


def publish_node(backend: RendezvousBackend, run_id: str, node_id: str, document: dict[str, Any]) -> int:
    """Write this node's status document; returns its size in bytes (the cost the benchmark watches)."""
    raw = _dump(document)
    backend.set(keys.node_status(run_id, node_id), raw)
    return len(raw)


def publish_stragglers(backend: RendezvousBackend, run_id: str, verdicts: dict[str, Any]) -> None:
    backend.set(keys.stragglers(run_id), _dump(verdicts))


def mark_lost(backend: RendezvousBackend, run_id: str, node_id: str, marker: dict[str, Any]) -> None:
    backend.set(keys.node_lost(run_id, node_id), _dump(marker))


def claim(backend: RendezvousBackend, run_id: str, name: str, owner: str) -> bool:
    """True for exactly one caller per ``name`` (the one that writes the job-wide record)."""
    key = keys.history_claim(run_id, name)
    return backend.compare_set(key, None, owner.encode()) and backend.get(key) == owner.encode()


def append(backend: RendezvousBackend, run_id: str, record: dict[str, Any]) -> int:
    """Append ``record`` to the history ring; returns its index (1-based)."""
    index = backend.add(keys.history_count(run_id), 1)
    backend.set(keys.history_slot(run_id, index % HISTORY_SLOTS), _dump({**record, "index": index}))
    return index


def write_part(backend: RendezvousBackend, run_id: str, round: int, node_rank: int, part: dict[str, Any]) -> None:
    backend.set(keys.recovery_part(run_id, round, node_rank), _dump(part))


# -- readers ------------------------------------------------------------------------------------------
def latest_run(backend: RendezvousBackend) -> str | None:
    raw = backend.get(keys.latest_run())
    return raw.decode() if raw is not None else None


def node_ids(backend: RendezvousBackend, run_id: str) -> list[str]:
    """Every node that registered, in registration order, without duplicates."""
    count = backend.add(keys.status_node_count(run_id), 0)
    seen: list[str] = []
    for raw in read_numbered(backend, lambda i: keys.status_node_index(run_id, i), count):
        if raw.decode() not in seen:
            seen.append(raw.decode())
    return seen


def node_document(backend: RendezvousBackend, run_id: str, node_id: str) -> dict[str, Any] | None:
    document = _load(backend.get(keys.node_status(run_id, node_id)))
    return document if isinstance(document, dict) else None


def node_documents(backend: RendezvousBackend, run_id: str, node_ids: list[str]) -> list[dict[str, Any] | None]:
    """Several nodes' documents in one store call (the straggler watch reads every participant's)."""
    raws = backend.get_many([keys.node_status(run_id, node_id) for node_id in node_ids]) if node_ids else []
    return [doc if isinstance(doc := _load(raw), dict) else None for raw in raws]


def stragglers(backend: RendezvousBackend, run_id: str) -> dict[str, Any] | None:
    verdicts = _load(backend.get(keys.stragglers(run_id)))
    return verdicts if isinstance(verdicts, dict) else None


def lost_marker(backend: RendezvousBackend, run_id: str, node_id: str) -> dict[str, Any] | None:
    marker = _load(backend.get(keys.node_lost(run_id, node_id)))
    return marker if isinstance(marker, dict) else None


def read_history(backend: RendezvousBackend, run_id: str, limit: int = HISTORY_SLOTS) -> list[dict[str, Any]]:
    """The newest ``limit`` records, oldest first (records overwritten meanwhile are left out)."""
    count = backend.add(keys.history_count(run_id), 0)
    records = []
    for index in range(max(1, count - min(limit, HISTORY_SLOTS) + 1), count + 1):
        record = _load(backend.get(keys.history_slot(run_id, index % HISTORY_SLOTS)))
        if isinstance(record, dict) and record.get("index") == index:
            records.append(record)
    return records


def read_parts(backend: RendezvousBackend, run_id: str, round: int, nodes: int) -> list[dict[str, Any]]:
    """The parts that nodes ``0..nodes-1`` wrote for the recovery into ``round`` (missing ones skipped)."""
    parts = []
    for node_rank in range(nodes):
        part = _load(backend.get(keys.recovery_part(run_id, round, node_rank)))
        if isinstance(part, dict):
            parts.append(part)
    return parts
