"""Getting a survivor out of a collective that will never finish.

When a peer dies, a rank blocked receiving from a *live* peer that has already left the broken
generation waits forever: gloo closes its connections only when its context is destroyed, and
neither ``abort()`` nor ``destroy_process_group()`` does that while a collective is in flight
(measured with torch 2.13). So each generation remembers the TCP connections its process group
opened, and a watchdog thread shuts them down when the agent announces the next generation: the
blocked collective then fails at once, and the bootstrap moves the process to the new generation.
With NCCL the communicators' own ``abort()`` does this job.

A rank can also be stuck before its process group exists: blocked in ``init_process_group`` of a
generation that was superseded while it set up (a node lost while the previous loss's generation
forms; a spare node that took its place late). No watchdog exists yet then, and the blocked wait
is for a rank that will never come (or, when node rank 0 already dropped that generation's store,
a connect that retries until the process group timeout, 30 minutes). ``SetupGuard`` covers that
window: once the generation is superseded it shuts down every TCP connection the setup opens, so
the wait fails at once, and a setup still stuck after ``SUPERSEDED_SETUP_GRACE_S`` (the refused
connect, which opens no lasting socket) ends the process, whose place a fresh one then takes.

Subgroups (a DeviceMesh's dimensions for HSDP or tensor parallel, ``new_group``) open their
connections later, while the script builds its model. A rank blocked in one of those (an HSDP
all-reduce across replicas) is reached too: at abort time every TCP connection opened since the
generation began whose far end is a host the default group talks to is shut down as well. A script's
own connection to another host (a metrics service, a hub) is left alone; one to a job host opened
during the generation would be cut along with the collectives, which only happens as the process
moves to the next generation.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


def tcp_sockets() -> dict[int, int]:
    """This process's TCP sockets (listeners excluded): file descriptor -> socket inode."""
    found: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with probe:
            is_tcp = probe.family in (socket.AF_INET, socket.AF_INET6) and probe.type == socket.SOCK_STREAM
            # Never a listening socket: gloo's listener thread terminates the process if its
            # accept() fails, and a listener carries no collective anyway.
            if is_tcp and not probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                found[fd] = os.fstat(probe.fileno()).st_ino
    return found


def peer_hosts(sockets: dict[int, int]) -> set[str]:
    """The far-end addresses of the given connected sockets."""
    hosts: set[str] = set()
    for fd, inode in sockets.items():
        with contextlib.suppress(OSError):
            probe = socket.socket(fileno=os.dup(fd))
            with probe:
                if os.fstat(probe.fileno()).st_ino == inode:
                    hosts.add(str(probe.getpeername()[0]))
    return hosts


def opened_since(before: dict[int, int], hosts: set[str]) -> dict[int, int]:
    """TCP connections opened since ``before`` was taken whose far end is one of ``hosts``."""
    return {
        fd: inode for fd, inode in tcp_sockets().items() if before.get(fd) != inode and peer_hosts({fd: inode}) & hosts
    }


def shut_down(sockets: dict[int, int]) -> int:
    """Shut down (both directions) the given sockets; blocked reads on them fail immediately.

    A descriptor number may have been closed and reused since it was recorded (gloo closes a
    failed pair's socket), so each one is checked against the recorded inode first: never shut
    down a socket that is not the one the process group opened.
    """
    count = 0
    for fd, inode in sockets.items():
        with contextlib.suppress(OSError):
            probe = socket.socket(fileno=os.dup(fd))
            with probe:
                if os.fstat(probe.fileno()).st_ino != inode:
                    continue
                probe.shutdown(socket.SHUT_RDWR)
                count += 1
    return count


class GenerationWatchdog(threading.Thread):
    """Waits (through the agent) for the next generation, then aborts this one's collectives.

    Armed for exactly one generation: ``abort`` must act on what that generation opened (its process
    group, its sockets), never on whatever is current when the news arrives, because the process may
    already be building the next generation's group by then. ``disarm`` (the process leaves the
    generation) and the abort exclude each other: once ``disarm`` returns, no abort can follow, and
    the thread is gone (its blocking wait is interrupted), so none is left behind per generation.
    """

    def __init__(
        self,
        wait_for_next: Callable[[], bool],
        abort: Callable[[], None],
        interrupt: Callable[[], None],
        release: Callable[[], None] = lambda: None,
    ) -> None:
        """``interrupt`` makes a blocked ``wait_for_next`` fail; ``release`` runs when the thread ends."""
        super().__init__(name="resilrun-generation-watchdog", daemon=True)
        self._wait_for_next = wait_for_next
        self._abort = abort
        self._interrupt = interrupt
        self._release = release
        self._lock = threading.Lock()
        self._armed = True

    def run(self) -> None:
        try:
            self._watch()
        finally:
            self._release()

    def _watch(self) -> None:
        while self._is_armed():
            try:
                moved_on = self._wait_for_next()
            except Exception as exc:  # noqa: BLE001 - the agent went away or we were disarmed: stop watching
                logger.debug("generation watchdog stops: %s", exc)
                return
            if moved_on:
                with self._lock:
                    if self._armed:
                        self._armed = False
                        self._abort()
                return

    def _is_armed(self) -> bool:
        with self._lock:
            return self._armed

    def disarm(self, join_timeout_s: float = 5.0) -> None:
        """Stop watching: no abort after this returns, and the thread ends (waited for, bounded)."""
        with self._lock:
            self._armed = False
        self._interrupt()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(join_timeout_s)


# How long a process may stay in a superseded generation's process-group setup once every
# connection it opened was shut down: that fails a blocked store wait within milliseconds, so
# only a connect retrying against a store that is gone outlasts it.
SUPERSEDED_SETUP_GRACE_S = 5.0
# A process stuck in a superseded generation's setup exits with this code (docs/recovery.md).
SUPERSEDED_SETUP_EXIT_CODE = 75
_DRAIN_EVERY_S = 0.05


class SetupGuard(threading.Thread):
    """Watches for the next generation while this process builds its default process group.

    Once the generation is superseded, every TCP connection opened since ``before`` is shut down
    as soon as it exists (the store's, gloo's pairs: the setup then fails and the bootstrap moves
    to the new generation), until ``finish``; a setup still running after ``grace_s`` ends the
    process through ``exit`` (see the module docstring).
    """

    def __init__(
        self,
        wait_for_next: Callable[[], bool],
        interrupt: Callable[[], None],
        before: dict[int, int],
        *,
        grace_s: float = SUPERSEDED_SETUP_GRACE_S,
        exit: Callable[[int], None] = os._exit,
        release: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(name="resilrun-setup-guard", daemon=True)
        self._wait_for_next = wait_for_next
        self._interrupt = interrupt
        self._before = before
        self._grace_s = grace_s
        self._exit = exit
        self._release = release
        self._done = threading.Event()
        self.superseded = threading.Event()

    def run(self) -> None:
        try:
            self._guard()
        finally:
            self._release()

    def _guard(self) -> None:
        while not self._done.is_set():
            try:
                if self._wait_for_next():
                    break
            except Exception as exc:  # noqa: BLE001 - the agent went away or we finished: stop guarding
                logger.debug("setup guard stops: %s", exc)
                return
        if self._done.is_set():
            return
        self.superseded.set()
        logger.warning("this generation was superseded while its process group was being set up: abandoning it")
        waited = 0.0
        while not self._done.wait(_DRAIN_EVERY_S):
            shut_down({fd: inode for fd, inode in tcp_sockets().items() if self._before.get(fd) != inode})
            waited += _DRAIN_EVERY_S
            if waited >= self._grace_s:
                sys.stderr.write(
                    f"resilrun: still setting up a superseded generation's process group after {self._grace_s:g} s "
                    "(its store is gone): exiting so that a fresh process takes this rank\n"
                )
                sys.stderr.flush()
                self._exit(SUPERSEDED_SETUP_EXIT_CODE)
                return

    def finish(self, join_timeout_s: float = 5.0) -> None:
        """The setup returned or failed: stop guarding (no connection is shut down after this returns)."""
        self._done.set()
        self._interrupt()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(join_timeout_s)
