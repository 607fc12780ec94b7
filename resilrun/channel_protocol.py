"""The worker<->agent channel's operations: one frozen dataclass per request, with its deadline.

Both ends import this module (the worker's ``AgentClient``, the agent's ``AgentChannel``); neither
builds a request as a dict literal. A request names its operation (``op``) and the protocol
``VERSION`` on the wire; the agent parses it back with ``parse_request``, which refuses an
unknown operation, another version or a field of the wrong type in one place.

Deadlines compose: every operation has its own (``Request.deadline_s``). Most are answered from
node memory in microseconds, so a generous default says "the agent is gone or wedged, not busy".
The long polls (a spare waiting for a rank, a worker waiting for the next generation) ask the
agent to wait ``timeout_s`` and answer empty after it; the client's socket waits that long plus
``MARGIN_S``, so the agent's empty answer always arrives before the client gives up. (With one
socket timeout for every request, a poll as long as the timeout raced the agent's own deadline: a
spare raised out of its stand-by, a survivor's generation watchdog stopped.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

VERSION = 1
# An answer from memory takes microseconds; allocating pre-faults a buffer (a fraction of a second
# per GiB); a fetch from a peer or storage moves a rank's snapshot. A minute means the agent is
# gone or wedged. (A fetch is bounded by the agent's own transfer deadlines, well under this.)
DEFAULT_DEADLINE_S = 60.0
# What a long poll's socket waits beyond the poll itself: the trip, and the agent's scheduling
# on a busy node.
MARGIN_S = 10.0


@dataclass(frozen=True, slots=True)
class Request:
    """One operation; subclasses set ``op`` and their fields (all JSON values)."""

    op: ClassVar[str] = ""

    @property
    def deadline_s(self) -> float:
        """How long the client waits for the answer."""
        return DEFAULT_DEADLINE_S

    def to_message(self) -> dict[str, Any]:
        """The JSON message on the wire (fields left at None are not sent). Shallow, not
        ``dataclasses.asdict``: that deep-copies the values tree of every commit, half a
        millisecond of the training thread's step for a typical one."""
        message: dict[str, Any] = {"op": self.op, "v": VERSION}
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value is not None:
                message[spec.name] = value
        return message


@dataclass(frozen=True, slots=True)
class LongPoll(Request):
    """A request the agent holds until something happens or ``timeout_s`` passed (then answers empty)."""

    timeout_s: float = 0.0

    @property
    def deadline_s(self) -> float:
        return self.timeout_s + MARGIN_S


@dataclass(frozen=True, slots=True)
class Auth(Request):
    """The first message of a connection: the token the agent gave only its own workers."""

    op: ClassVar[str] = "auth"
    token: str = ""


@dataclass(frozen=True, slots=True)
class Attach(Request):
    """Map ``rank``'s buffers as node memory holds them (answered with their descriptors)."""

    op: ClassVar[str] = "attach"
    rank: int = 0


@dataclass(frozen=True, slots=True)
class Alloc(Request):
    """A buffer of ``nbytes`` for ``rank``'s ring ``slot`` (none when the ring had to shrink)."""

    op: ClassVar[str] = "alloc"
    rank: int = 0
    slot: int = 0
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class Commit(Request):
    """``rank``'s snapshot of ``step`` is complete in ``slot`` (posted: its answer is read later)."""

    op: ClassVar[str] = "commit"
    rank: int = 0
    step: int = 0
    slot: int = 0
    nbytes: int = 0
    pid: int | None = None
    copy_s: float | None = None
    copied: int | None = None  # less than nbytes when the snapshot borrows
    values: Any = None
    borrowed: list[list[int]] = field(default_factory=list)
    shared: list[list[int]] = field(default_factory=list)
    round: int = -1
    layout: int = 0
    previous: int | None = None
    replicate: bool | None = None


@dataclass(frozen=True, slots=True)
class Report(Request):
    """A recovery milestone of a worker (state restored, collectives rebuilt, first step done)."""

    op: ClassVar[str] = "report"
    pid: int = 0
    rank: int = 0
    event: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Finished(Request):
    """The worker's script is done; its interpreter teardown may take seconds without a beat."""

    op: ClassVar[str] = "finished"
    pid: int = 0


@dataclass(frozen=True, slots=True)
class Beat(Request):
    """A worker's heartbeat, with its newest finished step (-1: none yet)."""

    op: ClassVar[str] = "beat"
    pid: int = 0
    step: int = -1


@dataclass(frozen=True, slots=True)
class HelloApi(Request):
    """The worker runs the three-call API (its steps and snapshots are the agent's to watch)."""

    op: ClassVar[str] = "hello_api"
    pid: int = 0


@dataclass(frozen=True, slots=True)
class AwaitAssignment(LongPoll):
    """A spare waits for a rank (answered with its environment, or empty after ``timeout_s``)."""

    op: ClassVar[str] = "await_assignment"
    pid: int = 0


@dataclass(frozen=True, slots=True)
class AwaitGeneration(LongPoll):
    """A worker waits for a generation newer than ``round`` that still includes it."""

    op: ClassVar[str] = "await_generation"
    pid: int = 0
    round: int = 0
    raised: bool = False


@dataclass(frozen=True, slots=True)
class RestoreInfo(Request):
    """Which steps each tier holds for ``rank`` at ``world_size``."""

    op: ClassVar[str] = "restore_info"
    rank: int = 0
    world_size: int = 0


@dataclass(frozen=True, slots=True)
class Lend(Request):
    """The other local ranks' buffers holding the bytes ``rank``'s ``step`` borrowed."""

    op: ClassVar[str] = "lend"
    rank: int = 0
    step: int = 0


@dataclass(frozen=True, slots=True)
class Inventory(Request):
    """Every snapshot the node and its peers hold, and the newest persisted step."""

    op: ClassVar[str] = "inventory"


@dataclass(frozen=True, slots=True)
class Fetch(Request):
    """Bring ``rank``'s ``step`` from ``tier`` ("peer" or "persistent") into node memory."""

    op: ClassVar[str] = "fetch"
    rank: int = 0
    step: int = 0
    tier: str = ""


@dataclass(frozen=True, slots=True)
class Peek(Request):
    """The values of ``rank``'s snapshot of ``step`` (written at ``world_size``), and whether node memory holds it."""

    op: ClassVar[str] = "peek"
    rank: int = 0
    step: int = 0
    world_size: int = 0


@dataclass(frozen=True, slots=True)
class GatherRanges(Request):
    """Only the bytes ``select`` names of ``rank``'s ``step``, from wherever they are (a resharded restore)."""

    op: ClassVar[str] = "gather_ranges"
    rank: int = 0
    step: int = 0
    world_size: int = 0
    select: dict[str, Any] = field(default_factory=dict)


REQUESTS: dict[str, type[Request]] = {
    cls.op: cls
    for cls in (
        Auth, Attach, Alloc, Commit, Report, Finished, Beat, HelloApi, AwaitAssignment, AwaitGeneration,
        RestoreInfo, Lend, Inventory, Fetch, Peek, GatherRanges,
    )
}  # fmt: skip

# How each field's wire value is checked and converted: JSON has one number type, and a request
# read off the socket is only as trusted as the worker that sent it.
_CONVERT: dict[str, Any] = {
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
}


def parse_request(message: Any) -> Request:
    """The request a message off the wire encodes.

    Raises:
        ValueError: not a request of this protocol version, an unknown operation, or a field of
            the wrong type (the agent answers "bad request").
    """
    if not isinstance(message, dict):
        raise ValueError("a request is a JSON object")
    op = message.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ValueError(f"unknown op {op!r}")
    if message.get("v") != VERSION:
        raise ValueError(f"protocol version {message.get('v')!r}, this agent speaks {VERSION}")
    values: dict[str, Any] = {}
    for spec in fields(cls):
        if spec.name not in message:
            continue
        value = message[spec.name]
        kind = str(spec.type).replace(" | None", "")
        convert = _CONVERT.get(kind)
        if value is not None and convert is not None:
            if isinstance(value, (dict, list)):
                raise ValueError(f"{op}: {spec.name} must be a {kind}")
            value = convert(value)
        elif value is not None and kind.startswith(("dict", "list")) and not isinstance(value, (dict, list)):
            raise ValueError(f"{op}: {spec.name} must be a {kind.split('[')[0]}")
        values[spec.name] = value
    unknown = set(message) - {"op", "v"} - {spec.name for spec in fields(cls)}
    if unknown:
        raise ValueError(f"{op}: unknown fields {sorted(unknown)}")
    return cls(**values)
