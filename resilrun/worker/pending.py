"""A hot spare that runs the script's set-up before it has a rank (the head start).

Why: a spare that waits before the script's first line leaves the whole set-up (building the model,
loading weights, a tokenizer, indexing a dataset) on the critical path of every recovery it takes
part in. A spare with a head start runs the script from the top at once, and the first read of
anything that depends on the rank it will be given waits until the agent gives it one:

- the environment variables the assignment sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``MASTER_PORT``, ... and a whole-environment read such as ``dict(os.environ)``): ``os.environ``
  is replaced by a view of the same variables whose reads of those keys wait;
- torch.distributed's default group (``dist.get_rank()``, ``dist.is_initialized()``, ``DDP(model)``,
  a ``DistributedSampler``, a ``DeviceMesh``): torch reads it in one place, which waits
  (``_torch_compat.wait_on_default_group``);
- the rank-dependent members of the ``Job`` that ``resilrun.init()`` returned (``job.rank``,
  ``job.device``, ``job.steps()``): that Job joins its generation when first asked.

So everything rank-independent that a script does before its first such read runs ahead, and a
script that reads ``RANK`` at its first line simply gets no head start: it is never wrong.

Invariant: before the seat is taken, no read of a rank-dependent value returns; after it, the
process is exactly a spare given its rank the old way (environment applied, hooks gone).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from resilrun.env import read_after_start

# Keys resilrun itself reads while the spare is still waiting (its agent's socket, the options the
# workers inherit); they are the same before and after the assignment.
_OWN_PREFIX = "RESILRUN_"
_OWN_PER_ASSIGNMENT = frozenset({"RESILRUN_ROUND", "RESILRUN_ATTEMPT"})


def waits_for_seat(key: str) -> bool:
    """Whether reading ``key`` must wait for the assignment: the agent sets or changes it then."""
    if key.startswith(_OWN_PREFIX):
        return key in _OWN_PER_ASSIGNMENT
    return read_after_start(key)


class PendingEnviron(os._Environ):  # type: ignore[misc,name-defined]  # os.environ's own class
    """``os.environ`` of a spare running ahead: the same variables (it shares their storage, so
    writes reach the process environment as ever), but a read of a per-assignment key, or of the
    whole environment, first waits for the seat."""

    def __init__(self, environ: Any, take_seat: Callable[[], None], seated: Callable[[], bool]) -> None:
        super().__init__(environ._data, environ.encodekey, environ.decodekey, environ.encodevalue, environ.decodevalue)
        self._take_seat = take_seat
        self._seated = seated

    def __getitem__(self, key: str) -> str:
        if not self._seated() and waits_for_seat(key):
            self._take_seat()
        return super().__getitem__(key)

    def __iter__(self) -> Iterator[str]:
        if not self._seated():
            self._take_seat()  # a copy of the whole environment must be the rank's
        return super().__iter__()

    def __len__(self) -> int:
        if not self._seated():
            self._take_seat()
        return super().__len__()


class HeadStart:
    """One per spare process: the seat it waits for and what runs when it is taken.

    ``await_assignment`` blocks until the agent gives this process a rank and returns that rank's
    environment. It runs on a thread of its own from ``install()`` on, so that the agent sees the
    spare waiting (ready to be given a rank) while the script's set-up still runs: a failure in
    that time assigns it at once, and the set-up's rest is what the new rank waits for (as it would
    after the assignment without the head start). The first thread that needs the rank applies the
    assignment (others wait on the lock); ``on_seat`` callbacks (a ``Job`` from ``resilrun.init()``
    joining its generation) run right after, before any waiting read returns.
    """

    def __init__(
        self,
        await_assignment: Callable[[], Mapping[str, str]],
        apply: Callable[[Mapping[str, str]], None],
        hold_default_group: Callable[[Callable[[], None], Callable[[], bool]], Callable[[], None] | None],
    ) -> None:
        self._await_assignment = await_assignment
        self._apply = apply
        self._hold_default_group = hold_default_group
        self._lock = threading.RLock()
        self._seated = False
        self._taking = False
        self._callbacks: list[Callable[[], None]] = []
        self._original: Any = None
        self._release_group: Callable[[], None] | None = None
        self._assigned = threading.Event()
        self._assignment: Mapping[str, str] | None = None
        self._error: BaseException | None = None

    def seated(self) -> bool:
        return self._seated

    def install(self) -> None:
        """From here on, rank-dependent reads wait for the seat; the assignment is awaited now."""
        threading.Thread(target=self._receive, name="resilrun-spare-assignment", daemon=True).start()
        self._original = os.environ
        # Not a new environment: a view of the same variables (the point is not to clear it).
        os.environ = PendingEnviron(self._original, self.take_seat, self._no_wait)  # noqa: B003
        self._release_group = self._hold_default_group(self.take_seat, self._no_wait)
        os.register_at_fork(after_in_child=self._forget_in_child)

    def _forget_in_child(self) -> None:
        """A process forked while the seat is awaited (a DataLoader worker started during the set-up)
        has no thread to receive the assignment: it reads the spare's variables as they are rather
        than wait forever."""
        if not self._seated:
            self._seated = True
            self._uninstall()

    def _receive(self) -> None:
        try:
            self._assignment = self._await_assignment()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that needs the rank
            self._error = exc
        self._assigned.set()

    def _no_wait(self) -> bool:
        # True once seated, and for the thread taking the seat while it takes it (the assignment is
        # applied and the generation joined through the very reads that would otherwise wait).
        return self._seated or (self._taking and self._lock._is_owned())  # type: ignore[attr-defined]

    def on_seat(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the seat is taken (now, if it was)."""
        with self._lock:
            if not self._seated:
                self._callbacks.append(callback)
                return
        callback()

    def take_seat(self) -> None:
        """Wait for the assignment and adopt it (once; later calls return at once).

        Raises:
            whatever ended the wait for the assignment (the agent gone): the spare then fails.
        """
        with self._lock:
            if self._seated or self._taking:
                return
            self._taking = True
            try:
                self._assigned.wait()
                if self._error is not None:
                    raise self._error
                assert self._assignment is not None
                self._apply(self._assignment)
                self._uninstall()
                self._seated = True
            finally:
                self._taking = False
            callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                callback()

    def _uninstall(self) -> None:
        if self._original is not None and isinstance(os.environ, PendingEnviron):
            os.environ = self._original  # noqa: B003 - the same variables, no longer held
        if self._release_group is not None:
            self._release_group()
            self._release_group = None


_HEAD_START: HeadStart | None = None


def start(head_start: HeadStart) -> None:
    """Make ``head_start`` this process's (the worker bootstrap, in a spare, before the script)."""
    global _HEAD_START
    _HEAD_START = head_start
    head_start.install()


def current() -> HeadStart | None:
    """This process's head start while its seat is still to be taken; None otherwise."""
    return _HEAD_START if _HEAD_START is not None and not _HEAD_START.seated() else None


def ever_started() -> bool:
    """Whether this process ran its script ahead as a spare (seated since, or not)."""
    return _HEAD_START is not None
