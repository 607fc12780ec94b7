"""Node-memory buffers that outlive the worker and die with the agent.

Buffers are anonymous memfds created by the agent and handed to workers over the agent channel
(SCM_RIGHTS). Why memfd rather than files in /dev/shm: the kernel frees a memfd when the last
process holding it exits, so a SIGKILLed agent (and its workers) can never leak shared memory,
while a worker's death alone loses nothing because the agent still holds the fd.

Invariants: buffers are pre-faulted once by their creator (first touch of shared memory runs at a
quarter of memcpy speed here) and then reused every step; a buffer is unmapped only once no reader
holds a lease on it (``acquire``/``release``), so replacing a slot never pulls memory out from under
a copy in progress; a slot's sequence counter is odd while its owner writes it, which lets a reader
give up early on a copy it knows is torn, but an unchanged counter proves nothing on a weakly ordered
CPU (see ``SeqCounters``): the node-memory tier checks every copy against the crc32s of its commit.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_PAGE = mmap.PAGESIZE


class SharedBuffer:
    """A memfd of ``nbytes`` mapped into this process."""

    def __init__(self, fd: int, nbytes: int, *, owner: bool, populate: bool = True) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.owner = owner
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self._map = mmap.mmap(fd, max(nbytes, 1), flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._tensor: torch.Tensor | None = None
        self._state = threading.Lock()
        self._leases = 0
        self._retired = False  # close() was called: no new leases; unmapped when the last one ends
        self.closed = False

    @classmethod
    def create(cls, nbytes: int, name: str, *, populate: bool = True) -> SharedBuffer:
        """Create and pre-fault a buffer (agent side); ``populate`` False leaves it sparse: a page
        takes memory only once written (a partial snapshot, see ``NodeTiers.gather_ranges``)."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(nbytes, 1))  # EFBIG under a file-size limit, ENOSPC/ENOMEM when full
            buffer = cls(fd, nbytes, owner=True, populate=populate)
        except BaseException:
            os.close(fd)
            raise
        if populate:
            buffer.zero()  # allocate every page now, not on the training path
        return buffer

    @classmethod
    def attach(cls, fd: int, *, populate: bool = True) -> SharedBuffer:
        """Map a buffer received from the agent (worker side)."""
        return cls(fd, os.fstat(fd).st_size, owner=False, populate=populate)

    def view(self) -> memoryview:
        return memoryview(self._map)[: self.nbytes]

    @property
    def tensor(self) -> torch.Tensor:
        """The buffer as a uint8 tensor (workers copy state through it); made on first use, so the
        agent, which moves bytes only, never imports torch for it."""
        if self._tensor is None:
            if self.closed:
                raise ValueError("the buffer was unmapped")
            import torch

            self._tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=max(self.nbytes, 1))
        return self._tensor

    def zero(self) -> None:
        """Write zeros over the whole mapping, a chunk at a time (touches every page)."""
        view, chunk = memoryview(self._map), 1 << 24
        zeros = bytes(min(chunk, len(view)))
        try:
            for begin in range(0, len(view), chunk):
                end = min(begin + chunk, len(view))
                view[begin:end] = zeros[: end - begin]
        finally:
            view.release()

    def acquire(self) -> bool:
        """Take a lease: the buffer stays mapped until ``release``; False once it was closed.

        Why: agent threads (replicator, persister, peer server) copy a slot after letting go of the
        tier's lock, while the worker may have it reallocated; a lease defers the unmapping instead
        of making the worker wait for a copy (or a slow peer).
        """
        with self._state:
            if self._retired:
                return False
            self._leases += 1
            return True

    def release(self) -> None:
        """End a lease; the last one ends a buffer that was closed meanwhile."""
        with self._state:
            self._leases -= 1
            last = self._retired and self._leases == 0
        if last:
            self._unmap()

    def close(self) -> None:
        """Unmap now, or when the last lease ends (idempotent)."""
        with self._state:
            if self._retired:
                return
            self._retired = True
            idle = self._leases == 0
        if idle:
            self._unmap()

    def _unmap(self) -> None:
        self._tensor = None
        with contextlib.suppress(BufferError):  # a view is still alive; the mapping goes with the process
            self._map.close()
        os.close(self.fd)
        self.closed = True


class SeqCounters:
    """Per-slot sequence numbers in a small shared page (a seqlock without the lock).

    Writer: ``begin(slot)`` (counter becomes odd), copy, ``end(slot)`` (even). Reader: read the
    counter, copy, read again; a copy is torn when the two reads differ or are odd. Aligned 8-byte
    stores are atomic on every platform torch supports, but the converse does not hold: with no
    fences (none are reachable from Python), a weakly ordered CPU (aarch64) may make the copy's
    stores visible before ``begin``'s, or satisfy the reader's second counter load before its data
    loads, so equal even reads do not prove a clean copy. The counter is a cheap early exit; what
    proves a copy is the commit's crc32s (``resilrun.tiers.memory``).
    """

    def __init__(self, buffer: SharedBuffer) -> None:
        self.buffer = buffer

    def read(self, slot: int) -> int:
        return int(struct.unpack_from("<Q", self.buffer.view(), slot * 8)[0])

    def _bump(self, slot: int) -> None:
        struct.pack_into("<Q", self.buffer.view(), slot * 8, self.read(slot) + 1)

    def begin(self, slot: int) -> None:
        self._bump(slot)

    def end(self, slot: int) -> None:
        self._bump(slot)

    def is_stable(self, slot: int, before: int) -> bool:
        return before % 2 == 0 and self.read(slot) == before

    # The page's last word: the newest step the rank's worker finished, snapshotted or not (+1; 0:
    # none). One aligned store per step, no message: with --snapshot-every > 1 most steps send
    # nothing, yet the agent must know exactly how many steps a failure throws away.
    def mark_finished(self, step: int) -> None:
        struct.pack_into("<Q", self.buffer.view(), self.buffer.nbytes - 8, step + 1)

    def finished(self) -> int:
        """The newest finished step (-1: none yet)."""
        return int(struct.unpack_from("<Q", self.buffer.view(), self.buffer.nbytes - 8)[0]) - 1
