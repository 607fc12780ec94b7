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


def rdzv_version(run_id: str) -> str:
    """Counter bumped after every successful write of the rendezvous state (a cheap change hint)."""
    return f"{_base(run_id)}/rdzv/version"


def node_heartbeat(run_id: str, node_id: str) -> str:
    """A counter the node's agent increments; observers judge staleness on their own clock."""
    return f"{_base(run_id)}/hb/{node_id}"


def round_master(run_id: str, round: int) -> str:
    """host:port of the worker store the round leader hosts for that round."""
    return f"{_base(run_id)}/round/{round}/master"


def round_done(run_id: str, round: int) -> str:
    """Counter of nodes whose workers all finished successfully in that round."""
    return f"{_base(run_id)}/round/{round}/done"


def round_left(run_id: str, round: int) -> str:
    """Counter of nodes that saw the round finish and are leaving (lets the store host exit)."""
    return f"{_base(run_id)}/round/{round}/left"


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


def job_lease(run_id: str) -> str:
    """The id of the etcd lease every key of the job is attached to (expires after the last agent)."""
    return f"{_base(run_id)}/lease"
