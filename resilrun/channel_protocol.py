"""The worker<->agent channel's operations: one frozen dataclass per request and per reply.

Both ends import this module (the worker's ``AgentClient``, the agent's ``AgentChannel``); neither
builds a message as a dict literal. A request names its operation (``op``) and the protocol
``VERSION`` on the wire; the agent parses it back with ``parse_request``, which refuses an
unknown operation, another version or a field of the wrong type in one place. Each request type
names its reply type (``Request.reply``, and its type parameter, so ``AgentClient.call`` is typed
per operation); the worker parses the answer with ``parse_reply`` the same way. A refusal is a
``Refused`` whatever the request.

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
from typing import Any, ClassVar, Generic, TypeVar

# 2: replies are typed (``Reply``), transfers report ``nbytes``.
VERSION = 2
# An answer from memory takes microseconds; allocating pre-faults a buffer (a fraction of a second
# per GiB). A minute means the agent is gone or wedged.
DEFAULT_DEADLINE_S = 60.0
# What a long poll's socket waits beyond the poll itself, and a transfer's beyond the agent's
# deadline for it: the trip, and the agent's scheduling on a busy node.
MARGIN_S = 10.0
# How long the agent may take to bring a rank's snapshot (or the ranges a resharded restore needs)
# from peers or storage, every source tried included: a multi-GB snapshot over a slow link. The
# worker waits this plus MARGIN_S, so the agent's answer ("not found": plan again) arrives first.
TRANSFER_S = 120.0


# -- replies -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Reply:
    """An answer the agent gives; subclasses add their fields (all JSON values)."""

    def to_message(self) -> dict[str, Any]:
        """The JSON message on the wire (shallow: a values tree is sent as it is)."""
        message: dict[str, Any] = {"ok": True}
        for spec in fields(self):
            message[spec.name] = getattr(self, spec.name)
        return message


@dataclass(frozen=True, slots=True)
class Ack(Reply):
    """Done; nothing to say."""


@dataclass(frozen=True, slots=True)
class Refused:
    """The agent refused a request: why, a hint, and the error class a restore tells apart
    ("gone": plan again; "refused": stop)."""

    error: str
    hint: str | None = None
    code: str | None = None

    def to_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"ok": False, "error": self.error}
        if self.hint is not None:
            message["hint"] = self.hint
        if self.code is not None:
            message["code"] = self.code
        return message


@dataclass(frozen=True, slots=True)
class Attached(Reply):
    """``rank``'s buffers: the ring's size, which slots exist (their descriptors follow the
    control page's, in this order), what is committed in each, and the slot the next goes to."""

    slots: int = 0
    present: list[int] = field(default_factory=list)
    committed: dict[str, Any] = field(default_factory=dict)
    next: int = 0


@dataclass(frozen=True, slots=True)
class Allocated(Reply):
    """The buffer (its descriptor), or none: the ring shrank to ``slots``."""

    slots: int | None = None


@dataclass(frozen=True, slots=True)
class Committed(Reply):
    """Recorded: whether the next snapshot must be written whole, and the slot it goes to."""

    whole: bool = False
    next: int = 0


@dataclass(frozen=True, slots=True)
class NewEnv(Reply):
    """A long poll's answer: the environment of the rank or generation waited for (None: none yet)."""

    env: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class TierSteps(Reply):
    """Steps each tier holds for a rank, and whether the newest were written at another world size."""

    memory: list[int] = field(default_factory=list)
    peer: list[int] = field(default_factory=list)
    persisted: int | None = None
    resized: bool = False


@dataclass(frozen=True, slots=True)
class Lent(Reply):
    """Borrowed ranges (owner, begin, end) and the owners whose buffers follow, in this order."""

    borrowed: list[list[int]] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Holdings(Reply):
    """Every [rank, step, world size] the node and its peers hold; the newest persisted [step, world size]."""

    entries: list[list[int]] = field(default_factory=list)
    persisted: list[int] | None = None


@dataclass(frozen=True, slots=True)
class Moved(Reply):
    """A transfer into node memory or a memfd: bytes moved, seconds, from which tier."""

    nbytes: int = 0
    seconds: float = 0.0
    tier: str = ""


@dataclass(frozen=True, slots=True)
class Peeked(Reply):
    """A snapshot's values tree, and whether node memory holds it (then it is read in place)."""

    values: Any = None
    memory: bool = False


R = TypeVar("R", bound=Reply)


# -- requests ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Request(Generic[R]):
    """One operation; subclasses set ``op``, ``reply`` (the type of its answer, also their type
    parameter) and their fields (all JSON values)."""

    op: ClassVar[str] = ""
    reply: ClassVar[type[Reply]] = Ack

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
class LongPoll(Request[R]):
    """A request the agent holds until something happens or ``timeout_s`` passed (then answers empty)."""

    timeout_s: float = 0.0

    @property
    def deadline_s(self) -> float:
        return self.timeout_s + MARGIN_S


@dataclass(frozen=True, slots=True)
class Transfer(Request[R]):
    """A request the agent answers by moving a snapshot's bytes from a peer or storage, within
    ``TRANSFER_S``."""

    @property
    def deadline_s(self) -> float:
        return TRANSFER_S + MARGIN_S


@dataclass(frozen=True, slots=True)
class Auth(Request[Ack]):
    """The first message of a connection: the token the agent gave only its own workers."""

    op: ClassVar[str] = "auth"
    reply: ClassVar[type[Reply]] = Ack
    token: str = ""


@dataclass(frozen=True, slots=True)
class Attach(Request[Attached]):
    """Map ``rank``'s buffers as node memory holds them (answered with their descriptors)."""

    op: ClassVar[str] = "attach"
    reply: ClassVar[type[Reply]] = Attached
    rank: int = 0


@dataclass(frozen=True, slots=True)
class Alloc(Request[Allocated]):
    """A buffer of ``nbytes`` for ``rank``'s ring ``slot`` (none when the ring had to shrink)."""

    op: ClassVar[str] = "alloc"
    reply: ClassVar[type[Reply]] = Allocated
    rank: int = 0
    slot: int = 0
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class Commit(Request[Committed]):
    """``rank``'s snapshot of ``step`` is complete in ``slot`` (posted: its answer is read later)."""

    op: ClassVar[str] = "commit"
    reply: ClassVar[type[Reply]] = Committed
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
    compute_s: float | None = None  # mean seconds per step to the rank's last gradient (stragglers)


@dataclass(frozen=True, slots=True)
class Report(Request[Ack]):
    """A recovery milestone of a worker (state restored, collectives rebuilt, first step done)."""

    op: ClassVar[str] = "report"
    reply: ClassVar[type[Reply]] = Ack
    pid: int = 0
    rank: int = 0
    event: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Finished(Request[Ack]):
    """The worker's script is done; its interpreter teardown may take seconds without a beat."""

    op: ClassVar[str] = "finished"
    reply: ClassVar[type[Reply]] = Ack
    pid: int = 0


@dataclass(frozen=True, slots=True)
class Beat(Request[Ack]):
    """A worker's heartbeat, with its newest finished step (-1: none yet)."""

    op: ClassVar[str] = "beat"
    reply: ClassVar[type[Reply]] = Ack
    pid: int = 0
    step: int = -1


@dataclass(frozen=True, slots=True)
class HelloApi(Request[Ack]):
    """The worker runs the three-call API (its steps and snapshots are the agent's to watch)."""

    op: ClassVar[str] = "hello_api"
    reply: ClassVar[type[Reply]] = Ack
    pid: int = 0


@dataclass(frozen=True, slots=True)
class HelloRerun(Request[Ack]):
    """A plain script's worker set up its process group (``--rerun-in-process``): it can re-run the
    script in-process after a failure, unless ``reason`` says what it holds that cannot be reset
    (then the job restarts the torchrun way, and the agent logs why)."""

    op: ClassVar[str] = "hello_rerun"
    reply: ClassVar[type[Reply]] = Ack
    pid: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class AwaitAssignment(LongPoll[NewEnv]):
    """A spare waits for a rank (answered with its environment, or empty after ``timeout_s``)."""

    op: ClassVar[str] = "await_assignment"
    reply: ClassVar[type[Reply]] = NewEnv
    pid: int = 0


@dataclass(frozen=True, slots=True)
class AwaitGeneration(LongPoll[NewEnv]):
    """A worker waits for a generation newer than ``round`` that still includes it."""

    op: ClassVar[str] = "await_generation"
    reply: ClassVar[type[Reply]] = NewEnv
    pid: int = 0
    round: int = 0
    raised: bool = False


@dataclass(frozen=True, slots=True)
class RestoreInfo(Request[TierSteps]):
    """Which steps each tier holds for ``rank`` at ``world_size``."""

    op: ClassVar[str] = "restore_info"
    reply: ClassVar[type[Reply]] = TierSteps
    rank: int = 0
    world_size: int = 0


@dataclass(frozen=True, slots=True)
class Lend(Request[Lent]):
    """The other local ranks' buffers holding the bytes ``rank``'s ``step`` borrowed."""

    op: ClassVar[str] = "lend"
    reply: ClassVar[type[Reply]] = Lent
    rank: int = 0
    step: int = 0


@dataclass(frozen=True, slots=True)
class Inventory(Request[Holdings]):
    """Every snapshot the node and its peers hold, and the newest persisted step."""

    op: ClassVar[str] = "inventory"
    reply: ClassVar[type[Reply]] = Holdings


@dataclass(frozen=True, slots=True)
class Fetch(Transfer[Moved]):
    """Bring ``rank``'s ``step`` from ``tier`` ("peer" or "persistent") into node memory."""

    op: ClassVar[str] = "fetch"
    reply: ClassVar[type[Reply]] = Moved
    rank: int = 0
    step: int = 0
    tier: str = ""


@dataclass(frozen=True, slots=True)
class Peek(Transfer[Peeked]):
    """The values of ``rank``'s snapshot of ``step`` (written at ``world_size``), and whether node memory holds it."""

    op: ClassVar[str] = "peek"
    reply: ClassVar[type[Reply]] = Peeked
    rank: int = 0
    step: int = 0
    world_size: int = 0


@dataclass(frozen=True, slots=True)
class GatherRanges(Transfer[Moved]):
    """Only the bytes ``select`` names of ``rank``'s ``step``, from wherever they are (a resharded restore)."""

    op: ClassVar[str] = "gather_ranges"
    reply: ClassVar[type[Reply]] = Moved
    rank: int = 0
    step: int = 0
    world_size: int = 0
    select: dict[str, Any] = field(default_factory=dict)


REQUESTS: dict[str, type[Request[Any]]] = {
    cls.op: cls
    for cls in (
        Auth, Attach, Alloc, Commit, Report, Finished, Beat, HelloApi, HelloRerun, AwaitAssignment, AwaitGeneration,
        RestoreInfo, Lend, Inventory, Fetch, Peek, GatherRanges,
    )
}  # fmt: skip

# How each field's wire value is checked and converted: JSON has one number type, and a message
# read off the socket is only as trusted as its sender.
_CONVERT: dict[str, Any] = {
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
}


def parse_request(message: Any) -> Request[Any]:
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
    return cls(**_fields(cls, message, op, {"op", "v"}))


def parse_reply(request: Request[R], message: Any) -> R | Refused:
    """The answer to ``request`` a message off the wire encodes: its reply type, or a refusal.

    Raises:
        ValueError: not an answer of this protocol, or a field of the wrong type.
    """
    if not isinstance(message, dict):
        raise ValueError("an answer is a JSON object")
    if not message.get("ok"):
        return Refused(
            str(message.get("error", "agent refused")),
            hint=_text_or_none(message.get("hint")),
            code=_text_or_none(message.get("code")),
        )
    cls = type(request).reply
    return cls(**_fields(cls, message, f"{request.op} answer", {"ok"}))  # type: ignore[return-value]


def _text_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def _fields(cls: type[Any], message: dict[str, Any], what: str, framing: set[str]) -> dict[str, Any]:
    """``cls``'s fields from ``message``, each checked and converted (JSON has one number type,
    and a message off the socket is only as trusted as its sender)."""
    values: dict[str, Any] = {}
    for spec in fields(cls):
        if spec.name not in message:
            continue
        value = message[spec.name]
        kind = str(spec.type).replace(" | None", "")
        convert = _CONVERT.get(kind)
        if value is not None and convert is not None:
            if isinstance(value, (dict, list)):
                raise ValueError(f"{what}: {spec.name} must be a {kind}")
            value = convert(value)
        elif value is not None and kind.startswith(("dict", "list")) and not isinstance(value, (dict, list)):
            raise ValueError(f"{what}: {spec.name} must be a {kind.split('[')[0]}")
        values[spec.name] = value
    unknown = set(message) - framing - {spec.name for spec in fields(cls)}
    if unknown:
        raise ValueError(f"{what}: unknown fields {sorted(unknown)}")
    return values
