"""Pure rendezvous decisions: (state, this node, observations) -> action.

The shared state is one JSON document updated by compare-and-set; every function here is pure, so
the whole protocol is table-tested without a store. Transitions of one round:

    (open, incomplete) --MAX joined, or MIN joined and last call elapsed--> (complete)
    (complete) --failure / membership change--> round+1 (open, incomplete, empty)
    any --close--> closed (outcome: succeeded | failed | stopped)

Node ranks: a node that asked for a rank (``--node-rank``) gets it; a node keeps its previous
round's rank when that rank is free; the others fill the free ranks in the order they joined.
No cross-machine timestamps: the last-call window is judged by each
node on its own monotonic clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any, NamedTuple

from resilrun.errors import RendezvousError

# In-process recoveries (hot spares, spare nodes) the job may decide in a row without a newer step
# committed anywhere between them. Failures alternating between ranks at the same step would
# otherwise recover forever without touching --max-restarts; past this many, a failure takes the
# restart path, which --max-restarts bounds. A few are legitimate (a second node lost while the
# first one's generation forms, a failure during the recovery itself), so it is not one.
MAX_RECOVERIES_WITHOUT_PROGRESS = 3


class NodeInfo(NamedTuple):
    """What a node tells the others about itself when it joins.

    A named tuple rather than a frozen dataclass: every agent builds one per node each time it
    reads the rendezvous document, and at 1,024 nodes a frozen dataclass's ``__init__`` (one
    ``object.__setattr__`` per field) was three quarters of the decode."""

    node_id: str
    addr: str
    local_world_size: int
    requested_rank: int | None = None
    hostname: str = ""
    # The rank this node had in the previous round: kept when free, so a node's ranks (and the
    # snapshots its memory holds for them) stay put across restarts.
    preferred_rank: int | None = None
    # host:port of this node's replica server (tier 2), "" when replication is off.
    peer_addr: str = ""


@dataclass(frozen=True, slots=True)
class RdzvState:
    """The rendezvous document. ``participants`` is in node-rank order once ``complete``."""

    round: int = 0
    complete: bool = False
    participants: tuple[NodeInfo, ...] = ()
    waiting: tuple[str, ...] = ()
    closed: bool = False
    outcome: str | None = None
    restarts: int = 0
    failure: dict[str, Any] | None = field(default=None, compare=True)
    # Set on a round opened by an in-process recovery: same nodes, complete at once, and the
    # running workers are kept (they move to the new generation instead of being restarted).
    recovering: bool = False
    recoveries: int = 0
    # Standby nodes: they arrived when the round was full and wait, warm, to replace a lost node.
    spares: tuple[NodeInfo, ...] = ()
    # The in-process recovery budget, job-wide: the newest committed step known when the last
    # recovery was decided, and how many were decided in a row without a newer one.
    progress_step: int = -1
    stalled_recoveries: int = 0
    # Bumped by every write (rendezvous/executor.py): a reader that saw seq n refuses a document of
    # seq < n, so replaying an old (validly sealed) document cannot roll the job back.
    seq: int = 0
    # The arrivals lane's index handled so far (rendezvous/executor.py), kept across rounds: the
    # ``admitted`` hint is only a hint anyone at the store can wipe, and an admitter going by it
    # alone would read the lane from its start and admit nodes that arrived for earlier rounds.
    admitted: int = 0
    # Which job this is: a nonce the document's first writer drew (rendezvous/executor.py). A rerun
    # under the same --rdzv-id and secret seals alike, so a node that read this job's document
    # refuses one naming another job, whatever its seq (an earlier run's "closed, succeeded").
    job: str = ""

    def to_bytes(self) -> bytes:
        """The document's JSON, canonical (sorted keys, no spaces: compare-and-set compares bytes).

        The node lists are written column by column (``{"node_id": [...], "addr": [...], ...}``):
        every agent decodes the whole document at least once per round, and at 1,024 nodes a list
        of one object per node took ~4 ms to decode (the keys parsed again for every node, and each
        node built from keywords), the columns ~1 ms, in half the bytes."""
        return json.dumps(self.to_document(), sort_keys=True, separators=(",", ":")).encode()

    def to_document(self) -> dict[str, Any]:
        """The document as JSON-ready values (``rendezvous/document.py`` may move the members out)."""
        doc = {name: getattr(self, name) for name in _STATE_FIELDS}
        doc["participants"] = node_columns(self.participants)
        doc["spares"] = node_columns(self.spares)
        return doc

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> RdzvState:
        """The state a document encodes (columns, or the one-object-per-node lists of earlier
        versions); an absent document is the initial state."""
        return cls() if raw is None else cls.from_document(json.loads(raw))

    @classmethod
    def from_document(cls, data: dict[str, Any]) -> RdzvState:
        """The state of a parsed document (its members possibly already decoded)."""
        members = data["participants"]
        data["participants"] = members if isinstance(members, tuple) else nodes_from(members)
        data["waiting"] = tuple(data["waiting"])
        data["spares"] = nodes_from(data.get("spares", []))
        return cls(**data)

    def node_rank(self, node_id: str) -> int | None:
        for rank, node in enumerate(self.participants):
            if node.node_id == node_id:
                return rank
        return None

    def has_participant(self, node_id: str) -> bool:
        return self.node_rank(node_id) is not None

    def is_spare(self, node_id: str) -> bool:
        return any(node.node_id == node_id for node in self.spares)


_STATE_FIELDS = tuple(f.name for f in fields(RdzvState))
_NODE_FIELDS = NodeInfo._fields
_NODE_DEFAULTS = NodeInfo._field_defaults
_REQUIRED_NODE_FIELDS = tuple(name for name in _NODE_FIELDS if name not in _NODE_DEFAULTS)


def node_columns(nodes: tuple[NodeInfo, ...]) -> dict[str, list[Any]]:
    return {name: [getattr(node, name) for node in nodes] for name in _NODE_FIELDS}


def nodes_from(encoded: dict[str, list[Any]] | list[dict[str, Any]]) -> tuple[NodeInfo, ...]:
    """Nodes from their columns (a column missing: its default), or from a list of objects."""
    if isinstance(encoded, list):
        return tuple(NodeInfo(**node) for node in encoded)  # type: ignore[arg-type]
    if not encoded:
        return ()
    unknown = set(encoded) - set(_NODE_FIELDS)
    missing = {name for name in _REQUIRED_NODE_FIELDS if name not in encoded}
    if unknown or missing:
        raise TypeError(f"the rendezvous document's node columns are not NodeInfo's: {sorted(unknown | missing)}")
    count = len(encoded["node_id"])
    columns = [encoded[name] if name in encoded else [_NODE_DEFAULTS[name]] * count for name in _NODE_FIELDS]
    if any(len(column) != count for column in columns):
        raise ValueError("the rendezvous document's node columns differ in length")
    return tuple(map(NodeInfo._make, zip(*columns, strict=True)))


class Verdict(Enum):
    """What a joining node does next."""

    FINISH = "finish"  # I am in a complete round
    SPARE = "spare"  # the round is full: I stand by as a spare node
    UPDATE = "update"  # try to write the proposed state, then decide again
    WAIT = "wait"  # poll again later
    CLOSED = "closed"  # the job is over


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    state: RdzvState | None = None


def assign_ranks(nodes: tuple[NodeInfo, ...]) -> tuple[NodeInfo, ...]:
    """Order nodes by rank: requested ranks are honoured, the rest fill gaps in join order.

    Raises:
        RendezvousError: two nodes asked for the same rank, or a rank outside the round.
    """
    size = len(nodes)
    slots: list[NodeInfo | None] = [None] * size
    for node in nodes:
        if node.requested_rank is None:
            continue
        if not 0 <= node.requested_rank < size:
            raise RendezvousError(
                f"node {node.hostname or node.node_id} asked for --node-rank {node.requested_rank}, "
                f"but the round has {size} nodes"
            )
        if slots[node.requested_rank] is not None:
            raise RendezvousError(
                f"--node-rank {node.requested_rank} was given to two nodes",
                hint="give every node a distinct --node-rank, or none to assign them automatically",
            )
        slots[node.requested_rank] = node
    rest = [n for n in nodes if n.requested_rank is None]
    unplaced = []
    for node in rest:
        want = node.preferred_rank
        if want is not None and want < size and slots[want] is None:
            slots[want] = node
        else:
            unplaced.append(node)
    free = iter(unplaced)
    return tuple(slot if slot is not None else next(free) for slot in slots)


def decide_join(
    state: RdzvState,
    me: NodeInfo,
    *,
    min_nodes: int,
    max_nodes: int,
    last_call_elapsed: bool,
    spare_grace_elapsed: bool = True,
) -> Decision:
    """One step of a node joining the current round.

    A node that finds the round complete and full stands by as a spare node. A spare joins a newly
    opened round only after ``spare_grace_elapsed``, so the nodes that ran the previous round get
    their places (and the snapshots in their memory stay useful) before a spare takes one.
    """
    if state.closed:
        return Decision(Verdict.CLOSED)
    joined = state.has_participant(me.node_id)
    if state.complete:
        if joined:
            return Decision(Verdict.FINISH)
        if len(state.participants) < max_nodes:
            if me.node_id in state.waiting:
                return Decision(Verdict.WAIT)
            # Asking to join makes the running nodes open a new round (a membership change).
            return Decision(Verdict.UPDATE, replace(state, waiting=(*state.waiting, me.node_id)))
        if state.is_spare(me.node_id):
            return Decision(Verdict.SPARE)
        return Decision(Verdict.UPDATE, replace(state, spares=(*state.spares, me)))
    if not joined:
        if len(state.participants) >= max_nodes:
            return Decision(Verdict.WAIT)
        if state.is_spare(me.node_id) and not spare_grace_elapsed:
            return Decision(Verdict.WAIT)
        participants = (*state.participants, me)
        spares = tuple(n for n in state.spares if n.node_id != me.node_id)
        if len(participants) == max_nodes:
            return Decision(Verdict.UPDATE, _complete(replace(state, spares=spares), participants))
        return Decision(Verdict.UPDATE, replace(state, participants=participants, spares=spares))
    if len(state.participants) >= min_nodes and last_call_elapsed:
        return Decision(Verdict.UPDATE, _complete(state, state.participants))
    return Decision(Verdict.WAIT)


def admit(state: RdzvState, arrivals: list[NodeInfo], *, min_nodes: int, max_nodes: int) -> RdzvState | None:
    """The state once every node of ``arrivals`` (in arrival order) joined as it would itself, or
    None when none of them changes it. Only the moves that need no observation of time are made
    for another node: a place in an open round (completing it when it is full), the wait list or
    the spares of a complete one. A node left out (a spare before its grace, a rank clash) decides
    for itself afterwards, as before."""
    current = state
    for arrival in arrivals:
        try:
            decision = decide_join(
                current,
                arrival,
                min_nodes=min_nodes,
                max_nodes=max_nodes,
                last_call_elapsed=False,
                spare_grace_elapsed=False,
            )
        except RendezvousError:
            continue  # e.g. two nodes asked for one rank: the asker hears it from its own write
        if decision.verdict is Verdict.UPDATE and decision.state is not None:
            current = decision.state
    return None if current == state else current


def _complete(state: RdzvState, participants: tuple[NodeInfo, ...]) -> RdzvState:
    waiting = tuple(w for w in state.waiting if w not in {p.node_id for p in participants})
    return replace(state, participants=assign_ranks(participants), complete=True, waiting=waiting)


def has_reached_min(state: RdzvState, me: str, min_nodes: int) -> bool:
    """Whether this node should start (or keep) its last-call timer."""
    return not state.complete and state.has_participant(me) and len(state.participants) >= min_nodes


def decide_leave(state: RdzvState, me: str) -> RdzvState | None:
    """Remove a node that gives up joining (timed out, or stopped); None when nothing changes.

    It leaves the wait list of a complete round (else the running nodes would keep opening
    rounds for it), or the participants of an incomplete one.
    """
    if state.closed:
        return None
    if me in state.waiting:
        return replace(state, waiting=tuple(w for w in state.waiting if w != me))
    if state.is_spare(me):
        return replace(state, spares=tuple(n for n in state.spares if n.node_id != me))
    if state.complete or not state.has_participant(me):
        return None
    return replace(state, participants=tuple(p for p in state.participants if p.node_id != me))


def decide_next_round(
    state: RdzvState,
    observed_round: int,
    *,
    failure: dict[str, Any] | None,
    max_restarts: int,
) -> RdzvState | None:
    """Open the next round after a failure (counts a restart) or a membership change (free).

    When the restart budget is spent the job is closed as failed instead. Returns None when
    another node already moved the job on (the caller then follows the state it reads).
    """
    if state.closed or state.round != observed_round:
        return None
    if failure is not None and state.restarts >= max_restarts:
        return replace(state, closed=True, outcome="failed", failure=failure)
    # The wait list is not carried over: waiting nodes join the open round like everyone else, and
    # one that died while waiting must not make every later round restart for it.
    return RdzvState(
        round=state.round + 1,
        restarts=state.restarts + (1 if failure is not None else 0),
        failure=failure if failure is not None else state.failure,
        recoveries=state.recoveries,
        spares=state.spares,
        # A restart does not refill the in-process budget: only a new step does.
        progress_step=state.progress_step,
        stalled_recoveries=state.stalled_recoveries,
        admitted=state.admitted,
        job=state.job,
    )


def recovery_budget_spent(state: RdzvState, newest_step: int) -> bool:
    """Whether one more in-process recovery would exceed MAX_RECOVERIES_WITHOUT_PROGRESS.

    ``newest_step`` is the newest step the deciding node's workers committed; any newer than the one
    recorded at the last recovery is progress and starts the count again.
    """
    return newest_step <= state.progress_step and state.stalled_recoveries >= MAX_RECOVERIES_WITHOUT_PROGRESS


def _counted(state: RdzvState, newest_step: int) -> dict[str, int]:
    progressed = newest_step > state.progress_step
    return {
        "progress_step": max(newest_step, state.progress_step),
        "stalled_recoveries": 1 if progressed else state.stalled_recoveries + 1,
    }


def decide_recover(
    state: RdzvState, observed_round: int, failure: dict[str, Any] | None, newest_step: int = -1
) -> RdzvState | None:
    """Open the next generation of the same complete round, for an in-process recovery.

    Returns None when another node already moved the job on (the caller follows what it reads), or
    when the in-process budget is spent (``recovery_budget_spent``: the caller restarts instead).
    """
    if state.closed or state.round != observed_round or not state.complete:
        return None
    if recovery_budget_spent(state, newest_step):
        return None
    return replace(
        state,
        round=state.round + 1,
        recovering=True,
        recoveries=state.recoveries + 1,
        failure=failure,
        waiting=(),
        **_counted(state, newest_step),
    )


def decide_replace(
    state: RdzvState,
    observed_round: int,
    lost: tuple[str, ...],
    failure: dict[str, Any] | None,
    newest_step: int = -1,
) -> RdzvState | None:
    """The next generation with spare nodes in the places of ``lost`` nodes (same node ranks).

    Returns None when that cannot be done: the job moved on, a lost node is not a participant,
    there are fewer spares of the right size than lost nodes, or the in-process budget is spent
    (the caller restarts instead).
    """
    if state.closed or state.round != observed_round or not state.complete:
        return None
    if recovery_budget_spent(state, newest_step):
        return None
    participants = list(state.participants)
    spares = list(state.spares)
    for node_id in lost:
        rank = state.node_rank(node_id)
        if rank is None:
            return None
        fit = next((n for n in spares if n.local_world_size == participants[rank].local_world_size), None)
        if fit is None:
            return None
        spares.remove(fit)
        participants[rank] = fit._replace(preferred_rank=rank)
    return replace(
        state,
        round=state.round + 1,
        participants=tuple(participants),
        spares=tuple(spares),
        recovering=True,
        recoveries=state.recoveries + 1,
        failure=failure,
        waiting=(),
        **_counted(state, newest_step),
    )


def decide_drop_spares(state: RdzvState, gone: tuple[str, ...]) -> RdzvState | None:
    """Forget spare nodes that stopped heartbeating (None when none of them is listed)."""
    if state.closed or not any(state.is_spare(node_id) for node_id in gone):
        return None
    return replace(state, spares=tuple(n for n in state.spares if n.node_id not in gone))


def decide_close(state: RdzvState, outcome: str, failure: dict[str, Any] | None = None) -> RdzvState | None:
    """Close the job for every node; the first close wins."""
    if state.closed:
        return None
    return replace(state, closed=True, outcome=outcome, failure=failure or state.failure)
