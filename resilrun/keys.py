"""Every rendezvous-store key resilrun uses, built under one versioned prefix.

No other module writes key strings: renaming or versioning the layout happens here only.
"""

from __future__ import annotations

PREFIX = "resilrun/v1"


def _base(run_id: str) -> str:
    return f"{PREFIX}/{run_id}"


def rdzv_state(run_id: str) -> str:
    """The JSON rendezvous state, updated only by compare-and-set."""
    return f"{_base(run_id)}/rdzv/state"


def rdzv_members(run_id: str, digest: str) -> str:
    """An immutable member list of the rendezvous state, named by its SHA-256 (rendezvous/document.py)."""
    return f"{_base(run_id)}/rdzv/members/{digest}"


def rdzv_version(run_id: str) -> str:
    """Counter bumped after every successful write of the rendezvous state (a cheap change hint)."""
    return f"{_base(run_id)}/rdzv/version"


def rdzv_phase(run_id: str) -> str:
    """Counter bumped after a write that changes what a node waiting in an open round decides on."""
    return f"{_base(run_id)}/rdzv/phase"


def rdzv_arrivals(run_id: str) -> str:
    """Counter handing each joining node its index in the arrivals lane (rendezvous/executor.py)."""
    return f"{_base(run_id)}/rdzv/arrivals"


def rdzv_arrival(run_id: str, index: int) -> str:
    """The NodeInfo of the node that took arrival ``index``, for the node that admits it."""
    return f"{_base(run_id)}/rdzv/arrival/{index}"


def rdzv_admitted(run_id: str) -> str:
    """The highest arrival index handled so far (a hint: the state document decides)."""
    return f"{_base(run_id)}/rdzv/admitted"


def node_heartbeat(run_id: str, node_id: str) -> str:
    """A counter the node's agent increments; observers judge staleness on their own clock."""
    return f"{_base(run_id)}/hb/{node_id}"


def node_alive(run_id: str, node_id: str) -> str:
    """Present while the node's agent renews its liveness lease (stores with leases: etcd)."""
    return f"{_base(run_id)}/alive/{node_id}"


def round_master(run_id: str, round: int) -> str:
    """host:port of the worker store the round leader hosts for that round."""
    return f"{_base(run_id)}/round/{round}/master"


def round_done(run_id: str, round: int, node_id: str) -> str:
    """Set (once, idempotently) by a node whose workers all finished successfully in that round.

    One key per node, never a counter: a store may apply a counter update twice (etcd retries), and
    a node counted twice would close the job while another node's workers still run.
    """
    return f"{_base(run_id)}/round/{round}/done/{node_id}"


def job_closed_ack(run_id: str) -> str:
    """Counter of nodes that saw the job closed (lets the store host exit last)."""
    return f"{_base(run_id)}/closed_ack"


def round_failure_count(run_id: str, round: int) -> str:
    """Counter of failure records written in that round (also their index)."""
    return f"{_base(run_id)}/round/{round}/failures/count"


def round_failure(run_id: str, round: int, index: int) -> str:
    """One JSON failure record of that round (a few hundred bytes)."""
    return f"{_base(run_id)}/round/{round}/failures/{index}"


def persist_count(run_id: str, step: int) -> str:
    """Counter of ranks whose snapshot of ``step`` is in persistent storage (the last commits it)."""
    return f"{_base(run_id)}/persist/{step}"


def job_secret(run_id: str) -> str:
    """The per-job secret peers prove to each other (set once, by the first agent)."""
    return f"{_base(run_id)}/secret"


def secret_check(run_id: str) -> str:
    """A constant sealed under the job's store key by the first agent: a node given another secret
    finds it does not verify and stops at once (instead of fighting over every document)."""
    return f"{_base(run_id)}/secret_check"


def job_lease(run_id: str) -> str:
    """The id of the etcd lease every key of the job is attached to (expires after the last agent)."""
    return f"{_base(run_id)}/lease"


# -- status, history and recovery timelines (resilrun status; small JSON documents only) --------------
def latest_run() -> str:
    """The run id of the newest job that registered with this store (``resilrun status`` without an id)."""
    return f"{PREFIX}/_latest_run"


def status_node_count(run_id: str) -> str:
    """Counter of agents that ever published a status document (also their registry index)."""
    return f"{_base(run_id)}/status/nodes/count"


def status_node_index(run_id: str, index: int) -> str:
    """The node id registered at ``index`` (1-based), so readers can list every node without a scan."""
    return f"{_base(run_id)}/status/nodes/{index}"


def node_status(run_id: str, node_id: str) -> str:
    """One agent's status document, rewritten by that agent only (no contention between nodes)."""
    return f"{_base(run_id)}/status/node/{node_id}"


def stragglers(run_id: str) -> str:
    """The leader's straggler verdicts and swap orders (agent/supervision/stragglers.py), JSON,
    rewritten by the agent of node rank 0 only when they change."""
    return f"{_base(run_id)}/status/stragglers"


def node_lost(run_id: str, node_id: str) -> str:
    """Set by the agent that judged ``node_id`` lost: JSON with the round and heartbeat age."""
    return f"{_base(run_id)}/status/lost/{node_id}"


def history_count(run_id: str) -> str:
    """Counter of job history records ever appended (failures, recoveries, restarts, node losses)."""
    return f"{_base(run_id)}/history/count"


def history_slot(run_id: str, slot: int) -> str:
    """One slot of the bounded history ring; a record carries its index, so readers skip stale slots."""
    return f"{_base(run_id)}/history/slot/{slot}"


def history_claim(run_id: str, name: str) -> str:
    """Claimed once by compare-and-set, so a job-wide record (a restart, a recovery) is written once."""
    return f"{_base(run_id)}/history/claim/{name}"


def recovery_part(run_id: str, round: int, node_rank: int) -> str:
    """One node's share of the timeline of the recovery into ``round`` (what its workers reported)."""
    return f"{_base(run_id)}/history/round/{round}/node/{node_rank}"
