"""Worker side of tier 1: copy tracked tensors into the agent's node-memory slots, and back.

The training path pays one memcpy per step into pre-faulted, reused buffers, plus one small
message; checksums, replication and persistence happen later, in the agent. A step is committed
only after its bytes are complete (the commit message is the commit point), and it is always
written into the ring's slot after the newest committed step's (the oldest one).
"""

from __future__ import annotations

import contextlib
import os
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from resilrun.channel_protocol import (
    Alloc,
    Attach,
    Commit,
    Committed,
    Fetch,
    GatherRanges,
    Holdings,
    Inventory,
    Lend,
    Moved,
    Peek,
    Reply,
    Report,
    Request,
    RestoreInfo,
    TierSteps,
)
from resilrun.errors import CheckpointError
from resilrun.snapshot.dedup import Borrowed, borrowed_ranges, plan_owners, shared_ranges
from resilrun.snapshot.layout import DTYPES, TORCH_TO_CODE, Layout, build_layout, parse_header
from resilrun.snapshot.restore import world_of
from resilrun.snapshot.selection import Selection
from resilrun.snapshot.shm import SeqCounters, SharedBuffer
from resilrun.worker import _torch_compat
from resilrun.worker.agent_client import AgentClient

R = TypeVar("R", bound=Reply)


def dtype_code(tensor: torch.Tensor) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in TORCH_TO_CODE:
        raise TypeError(f"tensors of dtype {tensor.dtype} cannot be snapshotted")
    return TORCH_TO_CODE[name]


class Snapshotter:
    """This rank's slots in node memory (as many as the agent keeps) and what each of them holds."""

    def __init__(self, client: AgentClient, rank: int, group: Sequence[int] = (), round: int = -1) -> None:
        """``group``: the global ranks on this node, which may share replicated tensors (snapshot/dedup.py);
        ``round``: this generation (bytes are shared only between commits of one generation)."""
        self.client = client
        self.rank = rank
        self.round = round
        self.group = tuple(group)
        self.slots: list[SharedBuffer | None] = []
        self._layout: Layout | None = None
        self._specs: list[tuple[str, str, tuple[int, ...]]] | None = None  # what _layout was last found for
        self._layout_crc = 0
        self._plan: tuple[Layout, frozenset[str], frozenset[str], Borrowed, tuple[tuple[int, int], ...]] | None = None
        self._whole = False  # the agent asked for a snapshot without borrowed bytes next
        # (step, borrowed ranges, owner rank -> its slot) mapped by borrow() for the next load
        self._lent: tuple[int, Borrowed, dict[int, SharedBuffer]] | None = None
        self._pinned = False
        # Per slot: the typed views of its buffer that the tensors of ``layout`` are copied into,
        # and those of ``skipped`` left out. Made once per buffer and layout: slicing and viewing a
        # uint8 buffer per tensor per step cost more than the copies of a model's many small
        # tensors. Dropped before their buffer is closed (a live view keeps a mapping alive).
        self._targets: dict[int, _Targets] = {}
        self._next = 0  # the slot the agent said the next snapshot goes to
        self.attach()

    def attach(self) -> None:
        """(Re)map this rank's buffers as the agent holds them now (after a fetch from another tier)."""
        attached, fds = self._request(Attach(rank=self.rank))
        self._targets.clear()
        for buffer in [*self.slots, getattr(self, "ctl", None)]:
            if buffer is not None:
                buffer.close()
        self.ctl = SharedBuffer.attach(fds[0])
        self.seq = SeqCounters(self.ctl)
        self.slots = [None] * attached.slots
        for slot, fd in zip(attached.present, fds[1:], strict=True):
            self.slots[int(slot)] = SharedBuffer.attach(fd)
        # slot -> (step, values) of what is committed there
        self.held: dict[int, tuple[int, Any]] = {
            int(slot): (int(info["step"]), info["values"]) for slot, info in attached.committed.items()
        }
        self._next = attached.next

    def restore_info(self, world_size: int) -> TierSteps:
        """Steps each tier holds for this rank, newest first, and whether the newest snapshots
        were written at another world size."""
        steps, _ = self._request(RestoreInfo(rank=self.rank, world_size=world_size))
        return steps

    def fetch(self, step: int, tier: str) -> Moved:
        """Have the agent bring ``step`` from ``tier`` into node memory, then remap.

        Returns:
            The agent's account of the transfer (bytes moved, seconds).
        """
        moved, _ = self._request(Fetch(rank=self.rank, step=step, tier=tier))
        self.attach()
        return moved

    def borrow(self, step: int) -> None:
        """Map the other local ranks' slots that hold the bytes this rank's ``step`` borrowed.

        Raises:
            CheckpointError: a part of the step is gone (the restore plans again).
        """
        lent, fds = self._request(Lend(rank=self.rank, step=step))
        self.unborrow()
        buffers = {int(owner): SharedBuffer.attach(fd) for owner, fd in zip(lent.owners, fds, strict=True)}
        self._lent = (step, tuple((int(o), int(b), int(e)) for o, b, e in lent.borrowed), buffers)

    def unborrow(self) -> None:
        """Unmap what ``borrow`` mapped (once nothing refers to the loaded views any more)."""
        lent, self._lent = self._lent, None
        for buffer in lent[2].values() if lent else ():
            buffer.close()

    def report(self, event: str, **fields: Any) -> None:
        """Tell the agent about a recovery milestone (for the job's recovery timeline); best effort."""
        self._request(Report(pid=os.getpid(), rank=self.rank, event=event, detail=fields))

    # -- restore -------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps held for this rank, newest first."""
        return sorted((step for step, _ in self.held.values()), reverse=True)

    def load(self, step: int) -> tuple[dict[str, torch.Tensor], Any]:
        """Views of the tensors of ``step`` in node memory, and its values.

        Tensors the step borrowed (see ``borrow``) are views of the owners' slots. The views are
        valid only until the next commit overwrites a slot: copy what is kept.
        """
        slot = next(s for s, (held_step, _) in self.held.items() if held_step == step)
        buffer = self.slots[slot]
        if buffer is None:
            raise RuntimeError(f"slot {slot} holds step {step} but is not mapped")
        borrowed, owners = (self._lent[1], self._lent[2]) if self._lent and self._lent[0] == step else ((), {})
        return _views(buffer, borrowed, owners, step), self.held[slot][1]

    # -- another rank's snapshot (a restore at another world size) -------------------------------
    def inventory(self) -> Holdings:
        """Every snapshot the node and its peers hold, as [rank, step, world size], and the newest
        persisted [step, world size] (see ``snapshot.restore.plan_reshard``)."""
        holdings, _ = self._request(Inventory())
        return holdings

    def peek(self, rank: int, step: int, world_size: int) -> tuple[Any, bool]:
        """The values of ``rank``'s snapshot of ``step`` (written at ``world_size``) and whether
        node memory holds it (then ``open_rank`` views it in place).

        Raises:
            CheckpointError: no tier has it any more.
        """
        peeked, _ = self._request(Peek(rank=rank, step=step, world_size=world_size))
        return peeked.values, peeked.memory

    def open_part(
        self, rank: int, step: int, world_size: int, select: Selection
    ) -> tuple[dict[str, torch.Tensor], Moved, Callable[[], None]] | None:
        """Views of the tensors ``select`` names in ``rank``'s snapshot of ``step``, of which the
        agent brought in only those bytes (from a peer or storage), what it moved, and a callable
        that unmaps them; None when node memory holds the whole snapshot (``open_rank`` it). A
        tensor selected by rows is viewed whole: only those rows hold its data.

        Raises:
            CheckpointError: no tier has it any more.
        """
        moved, fds = self._request(
            GatherRanges(rank=rank, step=step, world_size=world_size, select=select.to_message())
        )
        if not fds:
            return None
        buffer = SharedBuffer.attach(fds[0], populate=False)
        try:
            views = _views(buffer, (), {}, step)
        except BaseException:
            buffer.close()
            raise
        wanted = {name: view for name, view in views.items() if name in select.rows or select.rest}
        return wanted, moved, buffer.close

    def open_rank(self, rank: int, step: int, world_size: int) -> tuple[dict[str, torch.Tensor], Any, Any]:
        """Views of ``rank``'s snapshot of ``step`` (written at ``world_size``) in node memory, its
        values, and a callable that unmaps them (after the views were copied from).

        Raises:
            CheckpointError: the snapshot is not complete in node memory.
        """
        attached, fds = self._request(Attach(rank=rank))
        committed = attached.committed
        slot = next(
            (
                int(key)
                for key, info in committed.items()
                if int(info["step"]) == step and info["complete"] and world_of(info["values"]) == world_size
            ),
            None,
        )
        mapped: list[SharedBuffer] = []
        try:
            present = [int(i) for i in attached.present]
            for index, fd in enumerate(fds):
                if index > 0 and present[index - 1] == slot:
                    mapped.append(SharedBuffer.attach(fd))
                else:
                    os.close(fd)
            if slot is None or not mapped:
                raise CheckpointError(f"step {step} of rank {rank} (world size {world_size}) is not in node memory")
            lent, owner_fds = self._request(Lend(rank=rank, step=step))
            owners = {int(o): SharedBuffer.attach(fd) for o, fd in zip(lent.owners, owner_fds, strict=True)}
            mapped.extend(owners.values())
            borrowed = tuple((int(o), int(b), int(e)) for o, b, e in lent.borrowed)
            views = _views(mapped[0], borrowed, owners, step)
        except BaseException:
            for buffer in mapped:
                buffer.close()
            raise

        def release() -> None:
            for buffer in mapped:
                buffer.close()

        return views, committed[str(slot)]["values"], release

    # -- commit --------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        values: Any,
        replicated: frozenset[str] = frozenset(),
        *,
        previous: int | None = None,
        replicate: bool | None = None,
        compute_s: float | None = None,
    ) -> None:
        """Copy ``tensors`` into the free slot, then commit ``step`` with ``values``.

        ``previous``: the step snapshotted before this one in this run (-1: none), the same on
        every rank: the agent's tiers pick the steps they copy by it (``--persist-every``,
        ``--replicate-every``) when snapshots are not evenly spaced (``--snapshot-every auto``).
        ``replicate``: whether the peers get this snapshot (``--replicate-every auto``: every rank
        says the same); None leaves it to the agent's ``--replicate-every N``. ``compute_s``: the
        rank's mean compute time per step since its previous commit (worker/_compute_probe.py).

        The commit message is posted, not awaited: its answer is read at the next request, so a
        refused commit raises one call later (``flush`` waits for it). Of the ``replicated``
        tensors (equal on every rank of the group) this rank copies only the ones it owns, and the
        commit says where the others are.
        """
        started = time.perf_counter()
        # The agent must have taken the previous commit before a slot is written again (the slot
        # about to be overwritten may still be counted as complete until then), and with replicas
        # its answer comes once that step is on the peers: this is where replication's lag is
        # bounded to one step (tiers/peer/replicator.py), at a cost only when a push outlasts a step.
        self._settle()
        layout = self._layout_for(tensors)
        skipped, borrowed, shared = self._borrowing(layout, replicated)
        slot, buffer = self._slot_for(layout.total_bytes)
        self.held.pop(slot, None)
        self.seq.begin(slot)
        targets = self._targets_for(slot, buffer, layout, skipped)
        targets.header.copy_(targets.header_bytes)
        asynchronous = False
        with torch.no_grad():  # a parameter is copied as it is; nothing of the copy is recorded
            for name, target in targets.views:
                source = tensors[name]
                non_blocking = self._pinned and source.is_cuda
                target.copy_(source, non_blocking=non_blocking)
                asynchronous = asynchronous or non_blocking
        copied = targets.nbytes
        if asynchronous:
            torch.cuda.current_stream().synchronize()
        self.seq.end(slot)
        copy_s = time.perf_counter() - started
        self.client.post(
            Commit(
                rank=self.rank,
                step=step,
                slot=slot,
                nbytes=layout.total_bytes,
                pid=os.getpid(),
                copy_s=round(copy_s, 6),
                copied=copied,
                values=values,
                borrowed=[list(r) for r in borrowed],
                shared=[list(r) for r in shared],
                round=self.round,
                layout=self._layout_crc,
                previous=previous,
                replicate=replicate,
                compute_s=None if compute_s is None else round(compute_s, 6),
            )
        )
        self.held[slot] = (step, values)

    def finished(self, step: int) -> None:
        """``step`` is done, snapshotted or not: the agent reads it from the control page (no message)."""
        self.seq.mark_finished(step)

    def flush(self) -> None:
        """Wait for the agent's answer to the last commit (it is read lazily, see ``save``).

        Raises:
            CheckpointError: the agent refused that commit.
        """
        self._settle()

    def _settle(self) -> None:
        reply = self.client.collect()
        if isinstance(reply, Committed):
            self._whole = reply.whole
            self._next = reply.next

    def _request(self, request: Request[R]) -> tuple[R, list[int]]:
        self._settle()
        return self.client.call(request)

    def close(self) -> None:
        """Unmap the slots and hang up (the agent keeps the memory)."""
        with contextlib.suppress(CheckpointError):
            self._settle()
        self.unborrow()
        self._targets.clear()
        for buffer in [*self.slots, self.ctl]:
            if buffer is not None:
                buffer.close()
        self.slots = [None] * len(self.slots)
        self.client.close()

    def _targets_for(self, slot: int, buffer: SharedBuffer, layout: Layout, skipped: frozenset[str]) -> _Targets:
        targets = self._targets.get(slot)
        if targets is None or not targets.holds(buffer, layout, skipped):
            targets = self._targets[slot] = _Targets.of(buffer, layout, skipped)
        return targets

    def _layout_for(self, tensors: dict[str, torch.Tensor]) -> Layout:
        specs = [(name, dtype_code(t), tuple(t.shape)) for name, t in tensors.items()]
        if specs == self._specs:  # the same state dicts as at the last commit, in the same order
            return self._layout  # type: ignore[return-value]  # set with _specs
        signature = tuple(sorted(specs))
        if self._layout is None or tuple(sorted(self._layout.signature())) != signature:
            self._layout = build_layout(specs)
            self._layout_crc = zlib.crc32(self._layout.header)  # once per layout, not per step
        self._specs = specs
        return self._layout

    def _borrowing(
        self, layout: Layout, replicated: frozenset[str]
    ) -> tuple[frozenset[str], Borrowed, tuple[tuple[int, int], ...]]:
        """Names this rank does not copy, the ranges its commit borrows, and the shared ranges.

        Cached per layout. Nothing is borrowed when the agent asked for a whole snapshot.
        """
        if not replicated:
            return frozenset(), (), ()
        plan = self._plan
        if plan is None or plan[0] is not layout or plan[1] != replicated:
            owners = plan_owners(layout, replicated, self.group)
            skipped = frozenset(name for name, owner in owners.items() if owner != self.rank)
            borrowed = borrowed_ranges(layout, owners, self.rank)
            plan = self._plan = (layout, replicated, skipped, borrowed, shared_ranges(layout, replicated))
        if self._whole:
            return frozenset(), (), plan[4]
        return plan[2], plan[3], plan[4]

    def _shrink(self, slots: int) -> None:
        """The agent keeps fewer slots for this rank now: forget the others."""
        for slot in range(slots, len(self.slots)):
            self._targets.pop(slot, None)
            buffer = self.slots[slot]
            if buffer is not None:
                buffer.close()
            self.held.pop(slot, None)
        self.slots = self.slots[:slots]

    def _free_slot(self) -> int:
        """The slot the agent named in its answer to the last commit (tiers/slots.py's ``next_slot``:
        which steps the ring keeps is the agent's to say); when the ring shrank since, the one not
        holding the newest step."""
        if self._next < len(self.slots):
            return self._next
        if not self.held:
            return 0
        newest = max(self.held, key=lambda s: self.held[s][0])
        return (newest + 1) % len(self.slots)

    def _slot_for(self, nbytes: int) -> tuple[int, SharedBuffer]:
        """The slot the next step goes to, (re)allocated to hold ``nbytes``."""
        while True:
            slot = self._free_slot()
            buffer = self.slots[slot]
            if buffer is not None and buffer.nbytes >= nbytes:
                return slot, buffer
            buffer = self._allocate(slot, nbytes)
            if buffer is not None:
                return slot, buffer
            # else the agent could not hold the ring's extra slot and shrank the ring: choose again

    def _allocate(self, slot: int, nbytes: int) -> SharedBuffer | None:
        allocated, fds = self._request(Alloc(rank=self.rank, slot=slot, nbytes=nbytes))
        if not fds:
            self._shrink(int(allocated.slots or 0))
            return None
        old = self.slots[slot]
        self._targets.pop(slot, None)
        self.slots[slot] = SharedBuffer.attach(fds[0])
        if old is not None:
            old.close()
        if torch.cuda.is_available():
            self._pinned = _pin(self.slots[slot])  # type: ignore[arg-type]  # set just above
        return self.slots[slot]  # type: ignore[return-value]


def _views(
    buffer: SharedBuffer, borrowed: Borrowed, owners: dict[int, SharedBuffer], step: int
) -> dict[str, torch.Tensor]:
    """Typed views of every tensor of the snapshot in ``buffer``, borrowed ranges from their owners' slots."""
    layout = parse_header(buffer.view(), buffer.nbytes)
    tensors = {}
    for entry in layout.entries:
        begin, end = layout.data_start + entry.begin, layout.data_start + entry.end
        source = buffer
        for owner, lent_begin, lent_end in borrowed:
            if lent_begin < end and begin < lent_end:
                if not lent_begin <= begin <= end <= lent_end:
                    raise CheckpointError(f"tensor '{entry.name}' of step {step} is only partly borrowed")
                source = owners[owner]
        raw = source.tensor[begin:end]
        dtype = getattr(torch, DTYPES[entry.dtype][0])
        tensors[entry.name] = raw.view(dtype).view(entry.shape)
    return tensors


@dataclass(frozen=True, eq=False)
class _Targets:
    """Where one slot's buffer takes a snapshot of one layout: its header and each copied tensor's
    typed view, in the layout's order; ``nbytes``: the bytes a commit of it writes."""

    buffer: SharedBuffer
    layout: Layout
    skipped: frozenset[str]
    header: torch.Tensor
    header_bytes: torch.Tensor
    views: tuple[tuple[str, torch.Tensor], ...]
    nbytes: int

    def holds(self, buffer: SharedBuffer, layout: Layout, skipped: frozenset[str]) -> bool:
        return self.buffer is buffer and self.layout is layout and (self.skipped is skipped or self.skipped == skipped)

    @classmethod
    def of(cls, buffer: SharedBuffer, layout: Layout, skipped: frozenset[str]) -> _Targets:
        base, whole = layout.data_start, buffer.tensor
        views, nbytes = [], layout.data_start
        for entry in layout.entries:
            if entry.name in skipped:
                continue
            dtype = getattr(torch, DTYPES[entry.dtype][0])
            views.append((entry.name, whole[base + entry.begin : base + entry.end].view(dtype).view(entry.shape)))
            nbytes += entry.nbytes
        header_bytes = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
        return cls(buffer, layout, skipped, whole[:base], header_bytes, tuple(views), nbytes)


def _pin(buffer: SharedBuffer) -> bool:
    """Page-lock the mapping so device-to-host copies can be asynchronous (best effort)."""
    try:
        return _torch_compat.pin_host_memory(buffer.tensor.data_ptr(), buffer.nbytes)
    except Exception:  # noqa: BLE001 - pinning is an optimisation; pageable copies still work
        return False
