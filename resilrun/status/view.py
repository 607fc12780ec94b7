"""The job status document that ``resilrun status`` shows: read from the store, joined, judged.

Reading is separate from joining: :func:`read_raw` does the store reads (read-only, a handful per
node plus the recent history), and :func:`compose` is a pure function from those raw records to the
one stable document described in docs/status.md (unit-tested without a store).

Judgements made here, and why:
- a node is ``lost`` when an agent marked it so in a round at least as new as the node's own last
  document (a node that came back later publishes a newer round and is not lost any more);
- a node's heartbeat age is the smallest age any other agent reports for it (each agent watches its
  next nodes in rank order on its own clock);
- the job-wide snapshot steps are the newest step *every* rank holds in that tier (min over ranks
  and nodes), except persisted, which is job-wide already (max over nodes that saw it complete);
- a node document's age (``status_age_s``) is the reader's wall clock against the writer's, so it
  includes their skew: it is shown, as "stale" past ``stale_after_s``, never used to judge a node
  (heartbeat ages do that). It is what exposes an old document written back (a replay: its MAC
  still verifies) to a reader that reads once; one that reads again (``--watch``) also refuses a
  document older than one it saw (:class:`DocumentVersions`).
"""

from __future__ import annotations

from typing import Any

from resilrun import keys
from resilrun.rendezvous.api import RendezvousBackend
from resilrun.rendezvous.document import Documents
from resilrun.rendezvous.protocol import RdzvState
from resilrun.status import records as history
from resilrun.status.stragglers import stragglers

SCHEMA = 1
TERMINAL = ("succeeded", "failed", "stopped")
# A live agent rewrites its document every heartbeat interval and at every event; one this much
# older (and more than a few intervals) is shown as stale: its agent stopped writing, or it is a
# replay. Generous, since the age includes the two hosts' clock skew.
STALE_AFTER_S = 10.0
STALE_INTERVALS = 5


class DocumentVersions:
    """The replay guard of a reader that reads the job's documents more than once.

    Each agent orders its documents by (incarnation, seq) (agent/status.py): a document with a
    valid MAC that sorts before one this reader already saw from that node is an old one written
    back. It is refused, and the newest one seen is shown in its place. A reader that reads once
    cannot tell (a MAC cannot): the document's age says it there.
    """

    def __init__(self) -> None:
        self._newest: dict[str, tuple[tuple[str, int], dict[str, Any]]] = {}

    def admit(self, raw: dict[str, Any]) -> list[str]:
        """Replace, in :func:`read_raw`'s records, each node document older than one seen before;
        returns the status keys of those replaced."""
        replayed = []
        for entry in raw["nodes"]:
            doc, node_id = entry["doc"], entry["node_id"]
            version = _version(doc)
            if version is None:
                continue
            seen = self._newest.get(node_id)
            if seen is not None and version < seen[0]:
                entry["doc"] = seen[1]
                replayed.append(keys.node_status(raw["run_id"], node_id))
                continue
            self._newest[node_id] = (version, doc)
        return replayed


def _version(doc: Any) -> tuple[str, int] | None:
    if not isinstance(doc, dict):
        return None
    incarnation, seq = doc.get("incarnation"), doc.get("seq")
    if not isinstance(incarnation, str) or not isinstance(seq, int) or isinstance(seq, bool):
        return None
    return incarnation, seq


def read_raw(backend: RendezvousBackend, run_id: str, history_limit: int = 20) -> dict[str, Any]:
    """Every record the document is made of (raises StoreConnectionError when the store fails)."""
    rdzv_raw = backend.get(keys.rdzv_state(run_id))
    node_ids = history.node_ids(backend, run_id)
    nodes = []
    for node_id in node_ids:
        nodes.append(
            {
                "node_id": node_id,
                "doc": history.node_document(backend, run_id, node_id),
                "lost": history.lost_marker(backend, run_id, node_id),
            }
        )
    records = history.read_history(backend, run_id, history_limit)
    parts: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        if record.get("kind") in ("recovery", "restart") and isinstance(record.get("round"), int):
            count = int(record.get("nodes") or len(node_ids) or 1)
            parts[record["round"]] = history.read_parts(backend, run_id, record["round"], count)
    return {
        "run_id": run_id,
        "rdzv": Documents(backend, run_id).decode(rdzv_raw) if rdzv_raw is not None else None,
        "nodes": nodes,
        "history": records,
        "parts": parts,
    }


def compose(
    raw: dict[str, Any],
    *,
    endpoint: str = "",
    backend: str = "",
    store: dict[str, Any] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The job status document from :func:`read_raw`'s records (pure).

    ``store``: whether the records were verified with the job secret, and the keys whose documents
    were refused (rendezvous/sealed.py) or replayed; unverified when not given. ``now``: the
    reader's wall clock, for each node document's age (None: not given)."""
    rdzv: RdzvState | None = raw["rdzv"]
    participants = [p.node_id for p in rdzv.participants] if rdzv is not None else []
    waiting = set(rdzv.waiting) if rdzv is not None else set()
    spare_nodes = {n.node_id for n in rdzv.spares} if rdzv is not None else set()
    ages = _peer_ages(raw["nodes"])
    nodes = []
    for entry in raw["nodes"]:
        doc = entry["doc"] or {}
        node_id = entry["node_id"]
        state = str(doc.get("state") or "joining")
        lost = entry["lost"]
        if lost is not None and state not in TERMINAL and int(lost.get("round", -1)) >= int(doc.get("round") or -1):
            state = "lost"
        elif state in ("active", "joining", "spare") and node_id in spare_nodes:
            state = "spare"
        elif state in ("active", "joining") and node_id in waiting:
            state = "waiting"
        nodes.append(
            {
                "node_id": node_id,
                "host": doc.get("host") or (lost or {}).get("host"),
                "agent_pid": doc.get("agent_pid"),
                "node_rank": doc.get("node_rank") if state != "lost" else (lost or {}).get("node_rank"),
                "state": state,
                "round": doc.get("round"),
                "heartbeat_age_s": ages.get(node_id),
                "uptime_s": doc.get("uptime_s"),
                **_age(doc, now, live=state not in TERMINAL and state != "lost"),
                "ranks": [r["rank"] for r in doc.get("ranks", [])],
                "spares": {**doc.get("spares", {}), "exited": int((doc.get("counts") or {}).get("spares_exited", 0))},
                "tiers": doc.get("tiers", {}),
                # --capture-dir: the script's own checkpoint files and their tiers (null: none captured)
                "captured": doc.get("captured"),
                "lost": lost,
            }
        )
    nodes.sort(key=lambda n: (n["state"] == "lost", n["node_rank"] if n["node_rank"] is not None else 1 << 30))
    live = {e["node_id"]: e["doc"] or {} for e in raw["nodes"]}
    ranks = []
    for node in nodes:
        if node["state"] in ("active",) or (node["state"] in TERMINAL and node["node_id"] in participants):
            for rank in live[node["node_id"]].get("ranks", []):
                ranks.append({**rank, "node_rank": node["node_rank"], "host": node["host"]})
    ranks.sort(key=lambda r: r["rank"])
    job = _job(rdzv, nodes, ranks)
    return {
        "schema": SCHEMA,
        "run_id": raw["run_id"],
        "endpoint": endpoint,
        "backend": backend,
        "store": store if store is not None else {"verified": False, "refused": [], "replayed": []},
        "job": job,
        "nodes": nodes,
        "ranks": ranks,
        "spares": {
            "processes_ready": sum(int(n["spares"].get("ready") or 0) for n in nodes if n["state"] == "active"),
            "processes_alive": sum(int(n["spares"].get("alive") or 0) for n in nodes if n["state"] == "active"),
            "nodes": len([n for n in nodes if n["state"] in ("waiting", "spare")]),
            # Spares that died while they waited for a rank (each one was logged and started again).
            "processes_exited": sum(int(n["spares"].get("exited") or 0) for n in nodes),
        },
        "stragglers": _stragglers(ranks),
        "snapshots": _snapshots(nodes, ranks),
        "snapshot_policy": _policy([live[n["node_id"]] for n in nodes if n["state"] != "lost"]),
        "history": [_entry(record, raw["parts"].get(record.get("round"), [])) for record in raw["history"]],
    }


def _age(doc: dict[str, Any], now: float | None, *, live: bool) -> dict[str, Any]:
    """``status_age_s`` (None unknown) and ``status_stale``: a live node's document past the bound."""
    written = doc.get("written_at")
    if now is None or not isinstance(written, (int, float)) or isinstance(written, bool):
        return {"status_age_s": None, "status_stale": False}
    age = round(now - float(written), 1)
    interval = doc.get("heartbeat_interval_s")
    bound = STALE_AFTER_S
    if isinstance(interval, (int, float)):
        bound = max(bound, STALE_INTERVALS * float(interval))
    return {"status_age_s": age, "status_stale": live and age > bound}


def _peer_ages(entries: list[dict[str, Any]]) -> dict[str, float]:
    ages: dict[str, float] = {}
    for entry in entries:
        for node_id, age in ((entry["doc"] or {}).get("peer_ages") or {}).items():
            if age is not None and (node_id not in ages or age < ages[node_id]):
                ages[node_id] = float(age)
    return ages


def _job(rdzv: RdzvState | None, nodes: list[dict[str, Any]], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    if rdzv is None:
        state = "unknown"
    elif rdzv.closed:
        state = rdzv.outcome or "stopped"
    elif any(n["state"] == "lost" and (n["lost"] or {}).get("round", -1) >= rdzv.round for n in nodes):
        state = "degraded"
    elif not rdzv.complete:
        state = "forming" if rdzv.round == 0 and not rdzv.restarts else "restarting"
    elif rdzv.recovering and any(r["state"] in ("starting", "failed") for r in ranks):
        state = "recovering"
    else:
        state = "running"
    steps = [r["step"] for r in ranks if r.get("step") is not None]
    return {
        "state": state,
        "round": rdzv.round if rdzv is not None else None,
        "restarts": rdzv.restarts if rdzv is not None else 0,
        "recoveries": rdzv.recoveries if rdzv is not None else 0,
        "nodes": len(rdzv.participants) if rdzv is not None else 0,
        "world_size": sum(p.local_world_size for p in rdzv.participants) if rdzv is not None else 0,
        "step": min(steps) if steps and len(steps) == len(ranks) else None,
        "newest_step": max(steps) if steps else None,
    }


def _stragglers(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The running ranks the others wait for (status/stragglers.py), with the evidence."""
    compute = {r["rank"]: float(r["compute_s"]) for r in ranks if r["state"] == "running" and r.get("compute_s")}
    where = {r["rank"]: r for r in ranks}
    return [
        {
            "rank": s.rank,
            "node_rank": where[s.rank].get("node_rank"),
            "host": where[s.rank].get("host"),
            "compute_s": round(s.compute_s, 6),
            "others_median_s": round(s.others_median_s, 6),
            "ratio": round(s.ratio, 2),
        }
        for s in stragglers(compute)
    ]


def _snapshots(nodes: list[dict[str, Any]], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    active = [n for n in nodes if n["state"] == "active" or n["state"] in TERMINAL]
    newest = max((r["step"] for r in ranks if r.get("step") is not None), default=None)

    def every(tier: str) -> int | None:
        steps = [n["tiers"].get(tier, {}).get("step") for n in active if tier in n["tiers"]]
        return None if not steps or None in steps else min(steps)

    # A persisted step counts once its COMPLETE.json exists; the agent that wrote it says so.
    persisted = [n["tiers"]["persistent"].get("complete_step") for n in nodes if "persistent" in n["tiers"]]
    tiers = {
        "memory": every("memory"),
        "peer": every("peer"),
        "persistent": max((s for s in persisted if s is not None), default=None),
    }
    configured = {"memory": True, "peer": any("peer" in n["tiers"] for n in active), "persistent": bool(persisted)}
    return {
        tier: {
            "step": step,
            "lag_steps": None if step is None or newest is None else max(0, newest - step),
            # finished steps a failure now would redo restoring from this tier (None held: all)
            "at_risk_steps": None if newest is None else max(0, newest - (-1 if step is None else step)),
        }
        for tier, step in tiers.items()
        if configured[tier]
    }


def _policy(docs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How often snapshots are taken: the nodes' settings, and the newest ``auto`` decision any
    node heard of (rank 0's node reports each one; the others show the setting only)."""
    policies = [d["snapshots"] for d in docs if isinstance(d.get("snapshots"), dict)]
    if not policies:
        return None
    return max(policies, key=lambda p: -1 if p.get("decided_at_step") is None else int(p["decided_at_step"]))


def _entry(record: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A history record for display; recoveries and restarts get their timeline."""
    entry = {k: v for k, v in record.items() if k not in ("exit_codes",)}
    if record.get("kind") in ("recovery", "restart"):
        entry["timeline"], entry["duration_s"], entry["steps_redone"], entry["complete"] = timeline(record, parts)
    return entry


def timeline(
    record: dict[str, Any], parts: list[dict[str, Any]]
) -> tuple[dict[str, Any], float | None, int | None, bool]:
    """(milestones as seconds after the failure, total seconds, steps redone, complete) of one recovery.

    Milestones, in the order they happen: ``detected`` (0: the agent saw the worker exit, or judged
    the node lost), ``replacement_chosen`` (the recovery or restart decision), ``collectives_rebuilt``
    (the last rank's new process group), ``state_transferred`` (the last rank's restore, with the bytes
    of all ranks and the slowest transfer) and ``first_step_done`` (the last rank's). A milestone that
    not every rank reached yet is None.
    """
    start = float(record.get("detected_at") or 0.0)
    ranks = [info for part in parts for info in (part.get("ranks") or {}).values()]

    def last(field: str) -> float | None:
        values = [float(r[field]) for r in ranks if r.get(field) is not None]
        return round(max(values) - start, 3) if values and len(values) == len(ranks) else None

    decided = record.get("decided_at")
    tiers = sorted({str(r["tier"]) for r in ranks if r.get("tier")})
    first_step = last("first_step_at")
    line: dict[str, Any] = {
        "detected": 0.0,
        "replacement_chosen": round(float(decided) - start, 3) if decided is not None else None,
        "collectives_rebuilt": last("collectives_at"),
        "state_transferred": last("restored_at"),
        "state_bytes": sum(int(r.get("bytes") or 0) for r in ranks),
        "state_tiers": tiers,
        "transfer_s": max((float(r["transfer_s"]) for r in ranks if r.get("transfer_s") is not None), default=None),
        "first_step_done": first_step,
    }
    redone = [int(p["steps_redone"]) for p in parts if p.get("steps_redone") is not None]
    complete = bool(parts) and all(p.get("complete") for p in parts)
    return line, first_step if complete else None, max(redone) if redone else None, complete
